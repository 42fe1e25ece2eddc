"""SampleFilterQueue: the rollout queue without the rollouts that would train nothing, and its size."""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..agentic.episodes import environment_failed, group_rows, strip_stamps
from ..contract.codes import DropReason
from ..contract.config import FilterConfig
from .accounting import RolloutProgress


def queue_bound(max_staleness: int, *, samples_per_step: int) -> int:
    """The rollout queue's default size, in samples: `max_staleness` optimizer steps' worth (at least one step).

    A sample waits in the queue behind at most this many samples, so it reaches training within `max_staleness`
    steps of being queued. TRL's default, 1024 samples, made a fast server fill the queue with samples that went
    stale before training (9 prompts, 3 epochs, max_staleness 1: 9 stale groups in a row and a stall). The same step
    size TRL derives its `max_inflight_tasks` from: per-device batch x gradient accumulation x processes.
    """
    return max(max_staleness, 1) * max(samples_per_step, 1)


@dataclass(frozen=True)
class SampleLimits:
    """The trainer's sizes a sample is held to: TRL's `max_staleness` (versions), `num_generations` (a group's
    samples) and `token_budget` (one row's tokens; 0: no limit)."""

    max_staleness: int
    num_generations: int
    token_budget: int = 0


DEFAULT_FILTER = FilterConfig()
#: How often a wait on an empty queue looks for a stop request (SIGTERM).
STOP_CHECK_S = 0.25

#: How often (in group ids) SampleFilterQueue forgets accepted groups that never delivered all their samples.
PRUNE_EVERY_GROUPS = 4096


class SampleFilterQueue:
    """The rollout queue, without the rollouts that would train nothing.

    Duck-types the queue TRL's RolloutQueueDataset reads (`get(timeout)`, `qsize()`). Drops, each reported to
    `progress` with its reason:
    - unscorable: no reward scored the sample (its reward is NaN: TRL's worker gives it advantage 0) or its reward
      is infinite, whatever `drop_no_signal` says;
    - no signal: `reward_std <= eps` (never `advantage == 0`: identical rewards give advantages near 1e-9) or NaN;
    - truncated: the last token is neither eos nor pad (only when `filter_config.drop_truncated`);
    - stale: TRL's exact rule, `version - sample.model_version > max_staleness`, so TRL's own silent drop never fires;
    - too long: more tokens than one row's `token_budget`, TRL's oversize rule, so its silent drop never fires.
    A group is settled once all its samples were dropped (`num_generations`, or the row count the rollout loop
    stamped: with tools a conversation may be several rows or none, grpo_trainer.agentic.episodes), or when it is given
    up (below). A stale group is regenerated (`RolloutProgress.regenerate`), and dropped as stale only past the
    regeneration limit. So is a group that trains nothing and had an episode whose environment failed (its rows are
    marked: grpo_trainer.agentic.episodes.ENVIRONMENT_FAILED_KEY): the environment, not the policy, took its signal,
    and a server that went away must not lose the run's groups. Past the limit it is dropped with its first row's
    reason (unscorable, as every failed episode's row is).

    Groups that never arrive (TRL drops rows with no trained token:
    `trl/experimental/async_grpo/async_rollout_worker.py:194 (trl 1.16.0)`) would block "all consumed" forever. A
    group is missing once a later id arrived; it is given up when:
    - its samples would be stale if they came: the worker stamps a group with the policy version at which it issued
      the group's first request, in id order, so a group is at most as new as any later group; once the learner is
      more than `max_staleness` versions past the later group that revealed it missing, it is regenerated like a
      stale group (a merely slow group that is still fresh is waited for, however many groups overtook it);
    - or no sample of it came for `lost_after_s` seconds (versions stop advancing when nothing trains): dropped as
      `lost`, or with its samples' drop reason if some arrived.
    Groups past the run's bound (the next pass's overflow) are passed on unfiltered: the batchers emit a micro-batch
    only when more samples arrive, so the last needed groups get collated only if overflow keeps flowing.

    `get` re-raises `queue.Empty` when no acceptable sample came within the timeout, so TRL's worker health check
    still runs.
    """

    def __init__(
        self,
        inner: Any,
        progress: RolloutProgress,
        *,
        model_version_fn: Callable[[], int],
        limits: SampleLimits,
        filter_config: FilterConfig = DEFAULT_FILTER,
        end_token_ids: Iterable[int] = (),
        lost_after_s: float = 1800.0,  # GRPOLearner's default with TRL's request_timeout (600 s)
        clock: Callable[[], float] = time.monotonic,
    ):
        self.inner = inner
        self.progress = progress
        self.model_version_fn = model_version_fn
        self.max_staleness = limits.max_staleness
        self.num_generations = limits.num_generations
        self.token_budget = limits.token_budget
        self.drop_no_signal = filter_config.drop_no_signal
        self.drop_truncated = filter_config.drop_truncated
        self.no_signal_epsilon = filter_config.no_signal_epsilon
        self.end_token_ids = frozenset(int(t) for t in end_token_ids)
        self.lost_after_s = lost_after_s
        self._clock = clock
        # Per group seen and not yet settled, in containers of ints and interned strings only: an object per group
        # is one the garbage collector tracks, and their growth brought a young-generation collection about every
        # micro-batch (205 vs TRL's 11 on 3,184 48-token samples).
        self._accepted: set[int] = set()  # groups with a sample passed on
        self._samples: dict[int, int] = {}  # group -> samples seen
        self._dropped: dict[int, int] = {}  # group -> samples dropped
        self._reason: dict[int, str] = {}  # group -> its first dropped sample's reason
        self._rows: dict[int, int] = {}  # group -> the rows it has, where that is not num_generations
        self._environment_failed: set[int] = set()  # groups with a row of an episode its environment failed
        self._newest = -1
        # Missing group id -> (when a later id revealed it, that later group's version), in id order: both grow
        # with the id, so the first entry is always the first to give up.
        self._missing: dict[int, tuple[float, int]] = {}

    def qsize(self) -> int:
        return self.inner.qsize()

    def get(self, timeout: float | None = None) -> Any:
        # The queue is usually full (generation outruns training): try it without a deadline first. Measured on
        # 48-token samples, the deadline arithmetic and per-call allocations were most of our few µs per sample.
        deadline = None
        progress = self.progress
        while True:
            if progress.stop_pending:  # SIGTERM, an environment gone too long: stop now, not at the queue's timeout
                progress.check()
            try:
                sample = self.inner.get_nowait()
            except queue.Empty:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                remaining = math.inf if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise
                try:
                    # In slices: a SIGTERM while the queue is empty is seen at once, not after TRL's 5 s poll (the
                    # pod's grace period also holds the checkpoint and the worker child's stop).
                    sample = self.inner.get(timeout=min(remaining, STOP_CHECK_S))
                except queue.Empty:
                    continue
            if self._accept(sample):
                return strip_stamps(sample)

    def drop_reason(self, sample: Any) -> DropReason | None:
        """Pure per-sample rule (no accounting): why this sample would train nothing, or None."""
        if not math.isfinite(sample.metrics.get("reward", 0.0)):
            # Every reward returned None (NaN: TRL trains it with advantage 0), or a reward returned an infinity
            # (its group's std is NaN). Whatever dropNoSignal says, a group of these is the reward's failure, not a
            # group without signal.
            return DropReason.UNSCORABLE
        std = sample.metrics.get("reward_std", float("nan"))
        if self.drop_no_signal and (math.isnan(std) or std <= self.no_signal_epsilon):
            return DropReason.NO_SIGNAL
        if self.model_version_fn() - sample.model_version > self.max_staleness:
            return DropReason.STALE
        if self.token_budget > 0 and len(sample.input_ids) > self.token_budget:
            return DropReason.TOO_LONG
        if self.drop_truncated and int(sample.input_ids[-1]) not in self.end_token_ids:
            return DropReason.TRUNCATED
        return None

    def _accept(self, sample: Any) -> bool:
        group_id = int(sample.group_id)
        progress = self.progress
        if group_id > self._newest:
            self._reveal(group_id, int(sample.model_version))
        if not progress.needs(group_id):
            progress.pass_overflow(group_id)
            self._sweep()
            return True
        accepted = group_id in self._accepted
        if not accepted and group_id in progress.consumed:
            # Settled already (a late sample of a group given up or regenerated, or a fork beyond num_generations),
            # or consumed before a resume: training it now would train it twice.
            return False
        self._samples[group_id] = self._samples.get(group_id, 0) + 1
        rows = group_rows(sample, self.num_generations)
        if rows != self.num_generations:
            self._rows[group_id] = rows
        reason = self.drop_reason(sample)
        if reason is None:
            if not accepted:
                self._accepted.add(group_id)
            self._sweep()
            return True
        if environment_failed(sample):
            self._environment_failed.add(group_id)
        dropped = self._dropped[group_id] = self._dropped.get(group_id, 0) + 1
        first_reason = self._reason.setdefault(group_id, reason.value)
        if not accepted and dropped >= rows:
            self._give_up(group_id, first_reason)
        self._sweep()
        return False

    def _reveal(self, newest: int, version: int) -> None:
        """Every id below `newest` was issued before it, so at a version no newer than `version`."""
        now = self._clock()
        for group_id in range(max(self._newest, 0), newest):
            self._missing.setdefault(group_id, (now, version))
        if newest // PRUNE_EVERY_GROUPS > self._newest // PRUNE_EVERY_GROUPS:
            # A group TRL delivered only part of stays accepted here; forget those long settled.
            horizon = newest - PRUNE_EVERY_GROUPS
            for group_id in [g for g in self._accepted if g < horizon]:
                self._forget(group_id)
        self._newest = newest

    def _forget(self, group_id: int) -> None:
        self._accepted.discard(group_id)
        self._samples.pop(group_id, None)
        self._dropped.pop(group_id, None)
        self._reason.pop(group_id, None)
        self._rows.pop(group_id, None)
        self._environment_failed.discard(group_id)

    def _give_up(self, group_id: int, reason: str) -> None:
        """Settle a group that will not train: regenerate it if stale or its environment failed (within the limit),
        else drop it."""
        self._missing.pop(group_id, None)
        for_environment = group_id in self._environment_failed and reason != DropReason.STALE.value
        self._forget(group_id)
        if ((reason == DropReason.STALE.value or for_environment)
                and self.progress.regenerate(group_id, for_environment=for_environment)):
            return
        self.progress.drop(group_id, reason)

    def _sweep(self) -> None:
        missing = self._missing
        if not missing:
            return
        version = self.model_version_fn()
        now = self._clock()
        progress = self.progress
        while missing:
            group_id, (revealed, newest_version) = next(iter(missing.items()))
            if group_id in progress.consumed or group_id in self._accepted or not progress.needs(group_id):
                del missing[group_id]
                if self._samples.get(group_id, 0) >= self._rows.get(group_id, self.num_generations):
                    self._forget(group_id)  # complete: a group missing part of its samples waits for the prune
            elif version - newest_version > self.max_staleness:
                self._give_up(group_id, self._reason.get(group_id) or DropReason.STALE.value)
            elif now - revealed > self.lost_after_s:
                self._give_up(group_id, self._reason.get(group_id) or DropReason.LOST.value)
            else:
                return
