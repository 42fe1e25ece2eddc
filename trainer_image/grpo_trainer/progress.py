"""Progress accounting and termination for async GRPO's rollout stream.

TRL's rollout worker cycles the prompts forever, and TRL ends an epoch-bounded run only when an optimizer step ends.
Rollouts dropped before training (no reward signal, truncated, too stale, too long) complete no step, so a run whose
remaining rollouts are all dropped would generate forever (reproduced: ~30,000 samples dropped in 20 s, step 0).

SampleFilterQueue drops the rollouts that would train nothing. Every drop and every trained micro-batch reports to
RolloutProgress, which keeps TRL's set of consumed prompt groups (read for the epoch bound and for resume). When the
run's prompt groups are consumed, or a full pass over the prompts trains nothing, the rank-0 pipeline raises
RolloutStop. StopAwareDataset turns it into one stop micro-batch that accelerate's dispatcher hands to every rank, so
all ranks end training (or raise the stall error) at the same micro-batch.

Group ids are the worker's: they start at 0 when the worker starts and grow across passes. `start_group` is the
absolute position (prompts x passes) of worker group 0, non-zero after a resume.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

from .contract import DropReason, LearnerPhase, ProgressReport

logger = logging.getLogger(__name__)


class StopCode(IntEnum):
    """What the stop micro-batch carries to every rank (tensors only: a string leaf breaks the broadcast)."""

    DONE = 1  # the run's groups are consumed
    STALLED = 2  # a full pass (stall limit) of groups trained nothing
    PIPELINE_ERROR = 3  # rank 0's rollout pipeline raised (e.g. the worker's health check)


class RolloutStop(Exception):
    """Ends the rollout stream; error is set when the run made no progress."""

    def __init__(self, error: str | None = None, *, code: StopCode | None = None):
        super().__init__(error or "rollout stream complete")
        self.error = error
        self.code = code if code is not None else (StopCode.DONE if error is None else StopCode.STALLED)


class StallError(RuntimeError):
    """Raised by `train()` on every rank when a full pass over the prompts trained nothing. Do not retry."""


class RolloutPipelineError(RuntimeError):
    """Raised on every rank when rank 0's rollout pipeline failed; rank 0 chains the original exception."""


class RolloutProgress:
    """Consumed and trained prompt groups, and the stream's stop conditions.

    `consumed` is the trainer's set TRL counts epochs and resumes from: a group counts once it trained or its
    rollouts were dropped. `stall_groups` bounds how many groups may be consumed in a row without one training
    (0: one pass over the prompts).

    Only rank 0 reports, from the rollout stream and, with trainer-side scoring, from score_step; the stream raises
    the stop, so that it reaches every rank as a stop micro-batch.

    "In a row" is by group id, not by arrival time: groups finish out of order, and a group that was accepted but is
    still waiting in the batcher has not trained yet. Counting by arrival would call a run stalled while its trainable
    groups sit in the batcher; counting consecutive ids asks exactly "did a full pass over the prompts train nothing".
    """

    def __init__(
        self,
        consumed: set[int],
        *,
        epochs_done: int,
        stall_groups: int,
        groups_per_epoch: int | None = None,
        epochs: float | None = None,
        start_group: int = 0,
        trained: int = 0,
        dropped: dict[str, int] | None = None,
        resumed_streak: int = 0,
        clock: Callable[[], float] = time.time,
    ):
        if stall_groups < 0:
            raise ValueError(f"stall_groups must be >= 0, got {stall_groups}")
        if stall_groups == 0 and not groups_per_epoch:
            raise ValueError("stall_groups=0 means one pass over the prompts, which needs groups_per_epoch")
        self.consumed = consumed
        self.epochs_done = epochs_done
        self.groups_per_epoch = groups_per_epoch
        self.epochs = epochs
        self.stall_limit = stall_groups or groups_per_epoch
        self.start_group = start_group
        # The run's bound in worker ids; TRL rounds fractional epochs up the same way (`_epoch_stop_groups`).
        total = math.ceil(epochs * groups_per_epoch) if groups_per_epoch and epochs else None
        self.groups_total = total
        self.needed_end = None if total is None else max(total - start_group, 0)
        self.groups_trained = trained
        self.dropped = {reason.value: 0 for reason in DropReason} | dict(dropped or {})
        self._drop_reason: dict[int, str] = {}  # dropped (not trained) ids -> reason
        self._trained_ids: set[int] = set()
        self._first_unconsumed = 0
        self._last_drop: int | None = None
        # A stall streak open right before the resume point, carried over from the checkpoint.
        self._resumed_streak = resumed_streak
        self.last_trained_time: float | None = None
        self.reward_mean: float | None = None
        self._clock = clock
        self._advance()

    # ---------------------------------------------------------------------------------------------------- reports
    def drop(self, group_id: int, reason: str | DropReason) -> None:
        """Count group_id as consumed without training; may end the stream."""
        if group_id in self.consumed:
            return
        self._record_drop(group_id, reason)
        self.check()

    def exclude(self, group_id: int, reason: str | DropReason) -> None:
        """Count a collated group whose every sample scoring took out of the loss.

        Runs outside the stream, so the stall it may complete is raised by the stream's next check.
        """
        if group_id in self._trained_ids:
            self._trained_ids.discard(group_id)
            self.groups_trained -= 1
        elif group_id in self._drop_reason:
            return
        self._record_drop(group_id, reason)

    def _record_drop(self, group_id: int, reason: str | DropReason) -> None:
        reason = DropReason(reason).value
        self.consumed.add(group_id)
        self._drop_reason[group_id] = reason
        self.dropped[reason] += 1
        self._last_drop = group_id
        self._advance()

    def train(self, group_ids: Iterable[int]) -> None:
        """Record groups that trained.

        Groups past the run's bound (the next pass's overflow, which rides in the last micro-batch) join the consumed
        set but are not counted: "trained 193 of 192 groups" would read as a miscount.
        """
        now = self._clock()
        for group_id in group_ids:
            if group_id in self._trained_ids:
                continue
            if not self.needs(group_id):
                self.consumed.add(group_id)
                continue
            previous = self._drop_reason.pop(group_id, None)
            if previous is not None:  # a late sample of a group swept as lost, or partly dropped, trained after all
                self.dropped[previous] -= 1
            self._trained_ids.add(group_id)
            self.consumed.add(group_id)
            self.groups_trained += 1
            self.last_trained_time = now
        self._advance()

    # ---------------------------------------------------------------------------------------------------- decisions
    def check(self) -> None:
        """End the stream when a full pass over the prompts trained no group.

        Also ends it, without error, once the run's groups are consumed. The stall is checked first: in a one-epoch
        run where everything was dropped, "all consumed" is also true, and reporting success with zero steps would
        hide the failure.
        """
        streak = self.stall_streak
        if streak >= self.stall_limit:
            raise RolloutStop(
                f"stalled: {streak} prompt groups in a row were consumed without one training "
                f"(limit {self.stall_limit}; dropped so far: {self._dropped_summary()})"
            )
        if self.all_consumed:
            if self.groups_trained == 0:
                raise RolloutStop(
                    f"stalled: all {self.groups_total} prompt groups were consumed and none trained "
                    f"(dropped: {self._dropped_summary()})"
                )
            raise RolloutStop()

    @property
    def all_consumed(self) -> bool:
        return self.needed_end is not None and self._first_unconsumed >= self.needed_end

    def needs(self, group_id: int) -> bool:
        """Whether the run's bound still includes this group (ids past it are the next pass's overflow)."""
        return self.needed_end is None or group_id < self.needed_end

    @property
    def stall_streak(self) -> int:
        """Consecutive dropped group ids around the newest drop (a trained or unconsumed id ends the run)."""
        if self._last_drop is None or self._last_drop not in self._drop_reason:
            return 0
        low = high = self._last_drop
        while low - 1 in self._drop_reason:
            low -= 1
        while high + 1 in self._drop_reason:
            high += 1
        if low == 0 and self.start_group > 0:
            # Resumed mid-run: the streak may have begun before the resume; the checkpoint keeps that tail.
            low -= self._resumed_streak
        return high - low + 1

    def _advance(self) -> None:
        while self._first_unconsumed in self.consumed:
            self._first_unconsumed += 1
        if self.groups_per_epoch:
            self.epochs_done = max(self.epochs_done, (self.start_group + self._first_unconsumed) // self.groups_per_epoch)

    def _dropped_summary(self) -> str:
        return ", ".join(f"{reason} {count}" for reason, count in self.dropped.items() if count) or "none"

    # ---------------------------------------------------------------------------------------------------- snapshots
    def consumed_positions(self) -> list[int]:
        """Absolute positions (prompts x passes) consumed within the run's bound, before a resume included."""
        relative = (g for g in self.consumed if self.needs(g))
        return [*range(self.start_group), *sorted(self.start_group + g for g in relative)]

    @property
    def groups_consumed(self) -> int:
        if self.needed_end is None:
            return self.start_group + len(self.consumed)
        return self.start_group + sum(1 for group_id in self.consumed if group_id < self.needed_end)

    def report(self, *, phase: LearnerPhase, global_step: int, weight_syncs: int = 0, message: str = "") -> ProgressReport:
        return ProgressReport(
            phase=phase,
            groups_total=self.groups_total or 0,
            groups_consumed=self.groups_consumed,
            groups_trained=self.groups_trained,
            dropped=dict(self.dropped),
            epochs_done=self.epochs_done,
            epochs=self.epochs or 1,
            stall_streak=self.stall_streak,
            stall_limit=self.stall_limit,
            global_step=global_step,
            last_trained_time=self.last_trained_time,
            reward_mean=self.reward_mean,
            weight_syncs=weight_syncs,
            message=message,
        )

    def state_dict(self, *, exclude: set[int] = frozenset()) -> dict[str, Any]:
        """What a checkpoint keeps: consumed groups by absolute position, counters, and the open stall streak.

        `exclude` are groups collated but not yet trained (accounting happens at collate time, up to GA+1
        micro-batches early): a resumed run must generate them again.
        """
        consumed = sorted(self.start_group + g for g in self.consumed if g not in exclude)
        excluded_trained = sum(1 for g in exclude if g in self._trained_ids)
        return {
            "consumed": consumed,
            "groups_trained": self.groups_trained - excluded_trained,
            "dropped": dict(self.dropped),
            "epochs_done": self.epochs_done,
            "stall_streak": self.stall_streak if self._last_drop is not None else 0,
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], consumed: set[int], *, stall_groups: int, groups_per_epoch: int, epochs: float
    ) -> RolloutProgress:
        """Rebuild after a resume. Fills `consumed` (TRL's set) with worker ids relative to the new start, which is
        the first absolute group not consumed: the worker skips every group before it, so none is generated again."""
        absolute = set(state["consumed"])
        start = first_unconsumed(absolute)
        consumed.clear()
        consumed.update(g - start for g in absolute if g > start)
        return cls(
            consumed,
            epochs_done=state["epochs_done"],
            stall_groups=stall_groups,
            groups_per_epoch=groups_per_epoch,
            epochs=epochs,
            start_group=start,
            trained=state["groups_trained"],
            dropped=state["dropped"],
            # The streak open at the checkpoint continues only if its last group was right before the new start.
            resumed_streak=state.get("stall_streak", 0) if (start - 1) in absolute else 0,
        )


def first_unconsumed(positions: Iterable[int]) -> int:
    """The first absolute position not consumed: where a resumed worker starts (everything before it is done)."""
    done = set(positions)
    return next(g for g in range(len(done) + 1) if g not in done)


# -------------------------------------------------------------------------------------------------------- filtering
@dataclass(slots=True)
class _GroupSeen:
    samples: int = 0
    dropped: int = 0
    reason: str | None = None
    accepted: bool = False


class SampleFilterQueue:
    """The rollout queue, without the rollouts that would train nothing.

    Duck-types the queue TRL's RolloutQueueDataset reads (`get(timeout)`, `qsize()`). Drops, each reported to
    `progress` with its reason:
    - no signal: `reward_std <= eps` (never `advantage == 0`: identical rewards give advantages near 1e-9) or NaN;
    - truncated: the last token is neither eos nor pad (only when `drop_truncated`);
    - stale: TRL's exact rule, `version - sample.model_version > max_staleness`, so TRL's own silent drop never fires;
    - too long: more tokens than one row's `token_budget`, TRL's oversize rule, so its silent drop never fires.
    A group counts as dropped once all its `num_generations` samples were dropped, or when it is swept (below).

    Groups that never arrive (TRL drops rows with no trained token, W:194) would block "all consumed" forever: a group
    older than the newest seen id minus `lost_after_groups` that is still not consumed is dropped as `lost` (or with
    its samples' drop reason if some arrived). Groups past the run's bound (the next pass's overflow) are passed on
    unfiltered: the batchers emit a micro-batch only when more samples arrive, so the last needed groups get collated
    only if overflow keeps flowing.

    `get` re-raises `queue.Empty` when no acceptable sample came within the timeout, so TRL's worker health check
    still runs.
    """

    def __init__(
        self,
        inner: Any,
        progress: RolloutProgress,
        *,
        model_version_fn: Callable[[], int],
        max_staleness: int,
        num_generations: int,
        token_budget: int = 0,
        drop_no_signal: bool = True,
        drop_truncated: bool = False,
        no_signal_epsilon: float = 1e-6,
        end_token_ids: Iterable[int] = (),
        lost_after_groups: int = 64,
    ):
        self.inner = inner
        self.progress = progress
        self.model_version_fn = model_version_fn
        self.max_staleness = max_staleness
        self.num_generations = num_generations
        self.token_budget = token_budget
        self.drop_no_signal = drop_no_signal
        self.drop_truncated = drop_truncated
        self.no_signal_epsilon = no_signal_epsilon
        self.end_token_ids = frozenset(int(t) for t in end_token_ids)
        self.lost_after_groups = lost_after_groups
        self._groups: dict[int, _GroupSeen] = {}
        self._newest = -1
        self._swept = 0  # every id below this was swept

    def qsize(self) -> int:
        return self.inner.qsize()

    def get(self, timeout: float | None = None) -> Any:
        # The queue is usually full (generation outruns training): try it without a deadline first. Measured on
        # 48-token samples, the deadline arithmetic and per-call allocations were most of our few µs per sample.
        deadline = None
        while True:
            try:
                sample = self.inner.get_nowait()
            except queue.Empty:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise
                sample = self.inner.get(timeout=remaining)
            if self._accept(sample):
                return sample

    def drop_reason(self, sample: Any) -> DropReason | None:
        """Pure per-sample rule (no accounting): why this sample would train nothing, or None."""
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
        if not progress.needs(group_id):
            self._sweep(group_id)
            return True
        seen = self._groups.get(group_id)
        if group_id in progress.consumed and (seen is None or not seen.accepted):
            # Dropped already (a late sample of a group swept as lost, or a fork beyond num_generations), or
            # consumed before a resume: training it now would train it twice.
            return False
        if seen is None:
            seen = self._groups[group_id] = _GroupSeen()
        seen.samples += 1
        reason = self.drop_reason(sample)
        if reason is None:
            seen.accepted = True
            self._sweep(group_id)
            return True
        seen.dropped += 1
        seen.reason = seen.reason or reason.value
        if not seen.accepted and seen.dropped >= self.num_generations:
            progress.drop(group_id, seen.reason)
        self._sweep(group_id)
        return False

    def _sweep(self, newest: int) -> None:
        self._newest = max(self._newest, newest)
        horizon = min(self._newest - self.lost_after_groups, self.progress.needed_end or self._newest)
        while self._swept < horizon:
            group_id = self._swept
            self._swept += 1
            seen = self._groups.pop(group_id, None)
            if group_id in self.progress.consumed or (seen is not None and seen.accepted):
                continue
            self.progress.drop(group_id, seen.reason if seen and seen.reason else DropReason.LOST)


# -------------------------------------------------------------------------------------------------------- stream end
class StopAwareDataset(torch.utils.data.IterableDataset):
    """A rollout batcher whose stream ends with the RolloutStop it raised.

    `check()` runs before each micro-batch. On RolloutStop, or any exception of the pipeline (rank 0 alone would
    raise it and strand the other ranks in the broadcast until ddp_timeout), one stop item is yielded, then the
    stream ends. Sticky: the Trainer re-iterates the loader per "epoch", and a new iterator stops again at once.
    """

    def __init__(self, batcher: Iterable[Any], progress: RolloutProgress | None = None):
        self.batcher = batcher
        self.progress = progress
        self.stop: RolloutStop | None = None
        self.micro_batches = 0

    def __iter__(self) -> Iterator[Any]:
        if self.stop is not None:
            yield self.stop
            return
        try:
            if self.progress is not None:
                self.progress.check()
            for micro_batch in self.batcher:
                self.micro_batches += 1
                yield micro_batch
                if self.progress is not None:
                    self.progress.check()
        except RolloutStop as stop:
            self.stop = stop
        except Exception as error:  # noqa: BLE001 - any pipeline failure must reach every rank as a stop
            logger.exception("rollout pipeline failed on rank 0; stopping every rank")
            self.stop = RolloutStop(f"{type(error).__name__}: {error}", code=StopCode.PIPELINE_ERROR)
            self.stop.__cause__ = error
        if self.stop is None:
            self.stop = RolloutStop("the rollout stream ended", code=StopCode.PIPELINE_ERROR)
        yield self.stop


# -------------------------------------------------------------------------------------------------------- collation
STOP_KEY = "rollout_stop"


@dataclass
class ProgressCollator(DataCollatorForRollout):
    """TRL's collator, reporting trained groups and passing a stream stop on.

    Groups are reported at collate time, like TRL's own count (fine for the stop decision, which is FIFO); the
    micro-batches collated but not yet trained are kept in `in_flight` so a checkpoint can leave them out.
    """

    progress: RolloutProgress | None = None
    in_flight: deque = field(default_factory=deque)

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (item,) = examples
        if isinstance(item, RolloutStop):
            # One row per rank; every leaf is a tensor so accelerate's dispatcher can slice and broadcast it.
            streak = self.progress.stall_streak if self.progress else 0
            limit = self.progress.stall_limit if self.progress else 0
            return {STOP_KEY: torch.tensor([[int(item.code), streak, limit]] * self.num_processes)}
        batch = super().torch_call(examples)
        group_ids = frozenset({sample["group_id"] for row in item for sample in row.samples})
        self.in_flight.append(group_ids)
        if self.progress is not None:
            self.progress.train(group_ids)
            # TRL's collator has just logged this micro-batch's nan-aware mean reward into the metric sink.
            rewards = self.metrics.get("reward")
            if rewards and not math.isnan(rewards[-1]):
                self.progress.reward_mean = rewards[-1]
        return batch


def stop_from_batch(inputs: dict[str, Any]) -> tuple[StopCode, int, int] | None:
    """The stop a micro-batch carries, as every rank sees it after dispatch, or None for a normal micro-batch."""
    if STOP_KEY not in inputs:
        return None
    code, streak, limit = (int(v) for v in inputs[STOP_KEY].reshape(-1, 3)[0].tolist())
    return StopCode(code), streak, limit
