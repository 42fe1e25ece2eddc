"""Trainer-side scoring: each rank takes samples out of the loss that must not train, on its own micro-batch.

Reward-model scoring (grpo_trainer.learner.scoring) needs whole groups and runs on rank 0 before batching. What is
decided here needs the learner's own forward, so it runs in the training step, on every rank, on the rows that rank
trains: `score_step` gives each sample a verdict, and a sample that is not kept leaves the loss:
- `non_finite`: a NaN or infinite logprob (learner's or rollout's) or per-sample loss;
- `importance_ratio`: masked importance sampling at the sequence level, TRL GRPO's `sequence_mask` mode: the ratio
  exp(sum over the sample's trained tokens of learner - rollout logprob) outside
  [`vllmImportanceSamplingClipMin`, `vllmImportanceSamplingClipMax`] (off unless one is set). The mismatch it guards
  against grows with staleness: the learner has moved on from the policy that generated the sample.

The verdicts of every rank reach rank 0 in one small gather per micro-batch; `ExclusionTracker` there turns them into
`RolloutProgress.exclude` calls for the groups whose every collated sample was taken out (and `readmit` calls for an
excluded group a late sample of which was kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from ..contract.codes import MaskReason


class Verdict(IntEnum):
    PAD = -1  # no sample: a row shorter than the micro-batch's widest
    KEPT = 0
    NON_FINITE = 1
    IMPORTANCE_RATIO = 2


#: The contract's reason for each verdict that masks.
MASK_REASON = {
    Verdict.NON_FINITE: MaskReason.NON_FINITE.value,
    Verdict.IMPORTANCE_RATIO: MaskReason.IMPORTANCE_RATIO.value,
}


@dataclass(frozen=True)
class ImportanceBounds:
    """[clip_min, clip_max] for the sequence ratio; None on a side is unbounded there."""

    clip_min: float | None = None
    clip_max: float | None = None

    @property
    def enabled(self) -> bool:
        return self.clip_min is not None or self.clip_max is not None


def score_step(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, per_token_loss: torch.Tensor, segment_id: torch.Tensor,
    num_samples: int, bounds: ImportanceBounds,
) -> torch.Tensor:
    """One verdict per sample of this rank's row (a `Verdict` value), from its loss terms (no gradient).

    The term tensors are TRL's flat per-token ones: term `t` belongs to sample `segment_id[t]`.
    """
    with torch.no_grad():
        def per_sample(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add_(0, segment_id, values)

        finite = torch.isfinite(log_probs) & torch.isfinite(old_log_probs) & torch.isfinite(per_token_loss)
        bad_terms = per_sample((~finite).to(torch.float32))
        verdicts = torch.full((num_samples,), int(Verdict.KEPT), dtype=torch.long, device=log_probs.device)
        if bounds.enabled:
            log_ratio = per_sample(torch.where(finite, log_probs.float() - old_log_probs.float(), 0.0))
            low = math.log(bounds.clip_min) if bounds.clip_min else -math.inf
            high = math.log(bounds.clip_max) if bounds.clip_max is not None else math.inf
            outside = (log_ratio < low) | (log_ratio > high)  # compared in log space: exp would overflow first
            verdicts[outside] = int(Verdict.IMPORTANCE_RATIO)
        verdicts[bad_terms > 0] = int(Verdict.NON_FINITE)
        return verdicts


def masked_terms(verdicts: torch.Tensor, segment_id: torch.Tensor) -> torch.Tensor:
    """Per loss term: whether its sample was taken out."""
    return verdicts[segment_id] != int(Verdict.KEPT)


@dataclass
class Decisions:
    """What one micro-batch's verdicts decided, in id order."""

    excluded: list[int] = field(default_factory=list)  # every collated sample taken out: `RolloutProgress.exclude`
    readmitted: list[int] = field(default_factory=list)  # excluded, then a late sample kept: `RolloutProgress.readmit`


class ExclusionTracker:
    """Rank 0: which collated groups lost every sample, from every rank's verdicts.

    `samples_collated` is the collator's count per group (ProgressCollator), which runs ahead of training: a group
    is decided once as many of its samples were scored as were collated. A group of which one sample was kept
    trained; one whose scored samples were all taken out is excluded. A straggler sample collated after its group
    was decided is decided on its own verdict: kept, it readmits an excluded group (it trained); taken out, it
    changes nothing.
    """

    def __init__(self, samples_collated: dict[int, int]):
        self.samples_collated = samples_collated
        self._scored: dict[int, int] = {}
        self._kept: set[int] = set()
        self._decided: set[int] = set()
        self._excluded: set[int] = set()  # decided groups that are excluded now
        self.samples_scored = 0
        self.samples_masked = dict.fromkeys(MASK_REASON.values(), 0)

    def add(self, group_ids: list[int], verdicts: list[int]) -> Decisions:
        """Take one micro-batch's verdicts (all ranks); returns the groups to exclude and to readmit."""
        touched = set()
        for group_id, verdict in zip(group_ids, verdicts, strict=True):
            if verdict == Verdict.PAD:
                continue
            self.samples_scored += 1
            if verdict == Verdict.KEPT:
                self._kept.add(group_id)
            else:
                self.samples_masked[MASK_REASON[Verdict(verdict)]] += 1
            self._scored[group_id] = self._scored.get(group_id, 0) + 1
            touched.add(group_id)
        decisions = Decisions()
        for group_id in sorted(touched):
            if self._scored[group_id] < self.samples_collated.get(group_id, 0):
                continue  # more of it was collated: wait for their verdicts
            kept = group_id in self._kept
            self._scored.pop(group_id)
            self._kept.discard(group_id)
            self.samples_collated.pop(group_id, None)
            if group_id not in self._decided:
                self._decided.add(group_id)
                if not kept:
                    self._excluded.add(group_id)
                    decisions.excluded.append(group_id)
            elif kept and group_id in self._excluded:
                self._excluded.discard(group_id)
                decisions.readmitted.append(group_id)
        return decisions

    def forget_below(self, group_id: int) -> None:
        """Groups below `group_id` are settled (RolloutProgress folded them): no straggler of theirs is counted."""
        self._decided = {g for g in self._decided if g >= group_id}
        self._excluded = {g for g in self._excluded if g >= group_id}
