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

Stale groups are regenerated, not consumed: a group whose samples are (or, for a group that never arrived, would be)
older than `max_staleness` versions counts neither as trained nor toward the stall streak, and the run's bound moves
by one so that the next group the worker generates takes its place. TRL's worker never generates a group id twice,
hence the stand-in. See docs/learner.md ("Stale and lost groups").
"""

from __future__ import annotations

import bisect
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableSet
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
    PREEMPTED = 4  # SIGTERM: save a checkpoint and stop


class RolloutStop(Exception):
    """Ends the rollout stream; error is set when the run made no progress."""

    def __init__(self, error: str | None = None, *, code: StopCode | None = None):
        super().__init__(error or "rollout stream complete")
        self.error = error
        self.code = code if code is not None else (StopCode.DONE if error is None else StopCode.STALLED)


#: A group's slot is regenerated at most this many times; the next stale generation is dropped as `stale`.
REGENERATE_LIMIT = 2


def queue_bound(max_staleness: int, *, samples_per_step: int) -> int:
    """The rollout queue's default size, in samples: `max_staleness` optimizer steps' worth (at least one step).

    A sample waits in the queue behind at most this many samples, so it reaches training within `max_staleness`
    steps of being queued. TRL's default, 1024 samples, made a fast server fill the queue with samples that went
    stale before training (9 prompts, 3 epochs, max_staleness 1: 9 stale groups in a row and a stall). The same step
    size TRL derives its `max_inflight_tasks` from: per-device batch x gradient accumulation x processes.
    """
    return max(max_staleness, 1) * max(samples_per_step, 1)


class StallError(RuntimeError):
    """Raised by `train()` on every rank when a full pass over the prompts trained nothing. Do not retry."""


class RolloutPipelineError(RuntimeError):
    """Raised on every rank when rank 0's rollout pipeline failed; rank 0 chains the original exception."""


class AccountingError(RuntimeError):
    """A report whose consumed groups are not all trained or dropped: a bug in the accounting, never user error."""


class ConsumedIds(MutableSet):
    """A set of group ids kept as `floor` (every id below it is a member) plus the members above it.

    The trainer's consumed set (TRL reads it with `in` and `len` only). A run of a million groups would otherwise
    hold a million ints; RolloutProgress.fold moves the settled prefix into `floor`.
    """

    def __init__(self, ids: Iterable[int] = ()):
        self.floor = 0
        self.above: set[int] = set()
        self.update(ids)

    def __contains__(self, group_id: object) -> bool:
        return (isinstance(group_id, int) and 0 <= group_id < self.floor) or group_id in self.above

    def __len__(self) -> int:
        return self.floor + len(self.above)

    def __iter__(self) -> Iterator[int]:
        yield from range(self.floor)
        yield from self.above

    def __repr__(self) -> str:
        return f"ConsumedIds(floor={self.floor}, above={sorted(self.above)})"

    def add(self, group_id: int) -> None:
        if group_id >= self.floor:
            self.above.add(group_id)

    def update(self, ids: Iterable[int]) -> None:
        for group_id in ids:
            self.add(group_id)

    def discard(self, group_id: int) -> None:
        if group_id < self.floor:  # unfold (rare: a discarded accumulation window)
            self.above.update(range(group_id + 1, self.floor))
            self.floor = group_id
        else:
            self.above.discard(group_id)

    def clear(self) -> None:
        self.floor = 0
        self.above.clear()

    def fold(self, limit: int) -> None:
        while self.floor < limit and self.floor in self.above:
            self.above.remove(self.floor)
            self.floor += 1

    def count_below(self, limit: int) -> int:
        return min(self.floor, limit) + sum(1 for group_id in self.above if group_id < limit)


class DropRuns:
    """Maximal runs of consecutive dropped group ids, each kept by its two ends: a drop joins its neighbours in O(1).

    A streak open before a resume is a run ending at id -1 (`prefix` ids long), so a resumed run continues it
    exactly. Walking the whole streak on every drop made one pass of 100,000 dropped groups take 234 s.
    """

    def __init__(self, prefix: int = 0):
        self.end_of: dict[int, int] = {}  # run start -> run end
        self.start_of: dict[int, int] = {}  # run end -> run start
        if prefix > 0:
            self.end_of[-prefix], self.start_of[-1] = -1, -prefix

    def join(self, group_id: int) -> tuple[int, int]:
        """Add a dropped id; returns its run (low, high)."""
        low = self.start_of.pop(group_id - 1, group_id)
        if low != group_id:
            del self.end_of[low]
        high = self.end_of.pop(group_id + 1, group_id)
        if high != group_id:
            del self.start_of[high]
        self.end_of[low], self.start_of[high] = high, low
        return low, high

    def run_of(self, group_id: int) -> tuple[int, int]:
        """The run holding a dropped id; walks to its end (only after a drop was undone, which is rare)."""
        high = group_id
        while high not in self.start_of:
            high += 1
        return self.start_of[high], high

    def leave(self, group_id: int) -> None:
        """Remove a dropped id that trained after all."""
        low, high = self.run_of(group_id)
        del self.start_of[high], self.end_of[low]
        for piece_low, piece_high in ((low, group_id - 1), (group_id + 1, high)):
            if piece_low <= piece_high:
                self.end_of[piece_low], self.start_of[piece_high] = piece_high, piece_low

    def length_ending_at(self, group_id: int) -> int:
        low = self.start_of.get(group_id)
        return 0 if low is None else group_id - low + 1

    def forget(self, start: int, stop: int) -> None:
        """Drop the runs that end in [start, stop): settled, they can neither grow nor shrink."""
        for end in range(start, stop):
            low = self.start_of.pop(end, None)
            if low is not None:
                del self.end_of[low]


class RolloutProgress:
    """Consumed and trained prompt groups, and the stream's stop conditions.

    `consumed` is the trainer's set TRL counts epochs and resumes from: a group counts once it trained or its
    rollouts were dropped. `stall_groups` bounds how many groups may be consumed in a row without one training
    (0: one pass over the prompts).

    Only rank 0 reports, from the rollout stream (reward-model scoring included: grpo_trainer.scoring runs inside it,
    before batching) and, with trainer-side scoring, from `score_step` (grpo_trainer.step_scoring: `exclude`); the
    stream raises the stop, so that it reaches every rank as a stop micro-batch.

    "In a row" is by group id, not by arrival time: groups finish out of order, and a group that was accepted but is
    still waiting in the batcher has not trained yet. Counting by arrival would call a run stalled while its trainable
    groups sit in the batcher; counting consecutive ids asks exactly "did a full pass over the prompts train nothing".

    Thread-safe: the trainer thread reports, the HTTP thread reads `report()` (iterating the live set from another
    thread raised "Set changed size during iteration"). `request_stop` only sets a flag, so a signal handler may call
    it while the main thread holds the lock.

    `regenerate` takes a stale group out of the accounting ("transparent": consumed for TRL's set, neither trained nor
    dropped, skipped by the streak) and moves the bound by one; a slot is regenerated at most `regenerate_limit`
    times, so the run generates at most (1 + limit) x its groups.
    """

    def __init__(
        self,
        consumed: MutableSet[int],
        *,
        epochs_done: int,
        stall_groups: int,
        groups_per_epoch: int | None = None,
        epochs: float | None = None,
        start_group: int = 0,
        trained: int = 0,
        dropped: dict[str, int] | None = None,
        resumed_streak: int = 0,
        dropped_ids: dict[int, str] | None = None,
        clock: Callable[[], float] = time.time,
        regenerate_limit: int = REGENERATE_LIMIT,
        regenerated: int = 0,
        bound: int | None = None,
        transparent_ids: Iterable[int] = (),
        transparent_before: int = 0,
        regeneration_attempts: dict[int, int] | None = None,
    ):
        if stall_groups < 0:
            raise ValueError(f"stall_groups must be >= 0, got {stall_groups}")
        if stall_groups == 0 and not groups_per_epoch:
            raise ValueError("stall_groups=0 means one pass over the prompts, which needs groups_per_epoch")
        self.consumed = consumed
        self._epochs_done = epochs_done
        self.groups_per_epoch = groups_per_epoch
        self.epochs = epochs
        self.stall_limit = stall_groups or groups_per_epoch
        self.start_group = start_group
        # The run's bound in worker ids; TRL rounds fractional epochs up the same way (`_epoch_stop_groups`).
        total = math.ceil(epochs * groups_per_epoch) if groups_per_epoch and epochs else None
        self.groups_total = total
        if bound is None:
            bound = total
        self.needed_end = None if bound is None else max(bound - start_group, 0)
        self.regenerate_limit = regenerate_limit
        self.regenerated = regenerated
        # Regenerated ids, and overflow ids the moved bound swallowed: consumed, neither trained nor dropped.
        self._transparent: list[int] = []  # sorted
        self._transparent_set: set[int] = set()
        self._transparent_before = transparent_before  # transparent positions before start_group
        self._overflow: set[int] = set()  # ids passed unfiltered as past the bound
        # Stand-in id -> how many times its slot was regenerated; a checkpoint keeps it, so the limit holds across
        # resumes.
        self._attempts: dict[int, int] = dict(regeneration_attempts or {})
        # Counters of this process (Prometheus': they start at 0 in every process, a resumed one too);
        # `groups_trained`, the run's total, is the checkpoint's count plus what they add.
        self._trained_before = trained
        self.groups_collated = 0
        self.groups_returned = 0
        self.groups_excluded = 0  # collated groups the training step's scoring took out of the loss whole
        self.dropped = {reason.value: 0 for reason in DropReason} | dict(dropped or {})
        self._lock = threading.RLock()
        self._drop_reason: dict[int, str] = {}  # dropped (not trained) ids -> reason, above the folded prefix
        self._trained_ids: set[int] = set()
        self._first_unconsumed = 0
        self._folded = 0  # ids below this are settled: their details are forgotten
        # A streak open right before the resume point, carried over from the checkpoint, is the run ending at -1.
        self._runs = DropRuns(resumed_streak)
        self._last_drop: int | None = None
        self._last_run: tuple[int, int] | None = None
        self.stop_requested: str | None = None
        self.last_trained_time: float | None = None
        self.reward_mean: float | None = None
        self._clock = clock
        for group_id, reason in sorted((dropped_ids or {}).items()):
            self.consumed.add(group_id)
            self._drop_reason[group_id] = reason
            self._runs.join(group_id)
        for group_id in sorted(transparent_ids):
            self._make_transparent(group_id)
        if self.needed_end is not None:  # a checkpoint keeps the consumed overflow among its consumed positions
            self._overflow.update(g for g in self._consumed_beyond(self.needed_end - 1))
        self._advance()

    # ---------------------------------------------------------------------------------------------------- reports
    def drop(self, group_id: int, reason: str | DropReason) -> None:
        """Count group_id as consumed without training; may end the stream."""
        with self._lock:
            if group_id in self.consumed:
                return
            if not self.needs(group_id):  # past the bound, as in train(): consumed, not counted
                self._consume_overflow(group_id)
                return
            self._record_drop(group_id, reason)
        self.check()

    def _record_drop(self, group_id: int, reason: str | DropReason) -> None:
        reason = DropReason(reason).value
        self.consumed.add(group_id)
        self._drop_reason[group_id] = reason
        self.dropped[reason] += 1
        self._last_drop = group_id
        self._last_run = self._runs.join(group_id)
        self._advance()

    def train(self, group_ids: Iterable[int]) -> None:
        """Record groups that trained.

        Groups past the run's bound (the next pass's overflow, which rides in the last micro-batch) join the consumed
        set but are not counted: "trained 193 of 192 groups" would read as a miscount.
        """
        now = self._clock()
        with self._lock:
            for group_id in group_ids:
                if group_id < self._folded or group_id in self._trained_ids or group_id in self._transparent_set:
                    continue
                if not self.needs(group_id):
                    self._consume_overflow(group_id)
                    continue
                previous = self._drop_reason.pop(group_id, None)
                if previous is not None:  # a late sample of a group swept as lost, or partly dropped, trained after all
                    self.dropped[previous] -= 1
                    self._runs.leave(group_id)
                    self._after_leave(group_id)
                self._trained_ids.add(group_id)
                self.consumed.add(group_id)
                self.groups_collated += 1
                self.last_trained_time = now
            self._advance()

    def exclude(self, group_id: int, reason: str | DropReason) -> None:
        """Count a collated group whose every sample scoring took out of the loss.

        Runs outside the stream (rank 0's training step, grpo_trainer.step_scoring), so the stall it may complete is
        raised by the stream's next check. Counted once: a group that is not collated and trained here (settled,
        dropped, excluded already, past the bound) is left as it is.
        """
        with self._lock:
            if group_id < self._folded or group_id not in self._trained_ids or not self.needs(group_id):
                return
            self._trained_ids.discard(group_id)
            self.groups_excluded += 1
            self._record_drop(group_id, reason)

    def untrain(self, group_ids: Iterable[int]) -> None:
        """Return collated groups that never reached an optimizer step to the unconsumed set (a discarded
        gradient-accumulation window): a checkpoint then leaves them out and a resumed run generates them again."""
        with self._lock:
            for group_id in group_ids:
                if (group_id < self._folded or group_id not in self.consumed or group_id in self._drop_reason
                        or group_id in self._transparent_set):
                    continue
                if group_id in self._trained_ids:
                    self._trained_ids.discard(group_id)
                    self.groups_returned += 1
                self.consumed.discard(group_id)
                self._first_unconsumed = min(self._first_unconsumed, group_id)

    def regenerate(self, group_id: int) -> bool:
        """Take a stale group out of the accounting and let the next group take its place.

        Returns False when its slot was regenerated `regenerate_limit` times already: the caller then drops it (as
        stale), and it counts toward the stall streak like any drop. A settled group returns True (nothing to do).
        """
        with self._lock:
            if group_id < self._folded or group_id in self.consumed:
                return True
            attempts = self._attempts.pop(group_id, 0)
            if attempts >= self.regenerate_limit:
                return False
            self.regenerated += 1
            self._make_transparent(group_id)
            if self.needed_end is not None:
                stand_in = self.needed_end
                while stand_in in self._overflow:  # went by unfiltered before the bound reached it
                    self._make_transparent(stand_in)
                    stand_in += 1
                self.needed_end = stand_in + 1
                self._attempts[stand_in] = attempts + 1
            self._advance()
            return True

    def _consume_overflow(self, group_id: int) -> None:
        # Consumed, counted nowhere: should a regeneration move the bound over it, the stand-in skips it.
        self.consumed.add(group_id)
        self._overflow.add(group_id)

    def pass_overflow(self, group_id: int) -> None:
        """Record an id passed unfiltered as past the bound: if the bound moves over it, it is not waited for."""
        with self._lock:
            if self.needed_end is not None and group_id >= self.needed_end:
                self._overflow.add(group_id)

    def _make_transparent(self, group_id: int) -> None:
        self.consumed.add(group_id)
        bisect.insort(self._transparent, group_id)
        self._transparent_set.add(group_id)
        run = self._runs.join(group_id)  # bridges the drops on both sides: it neither ends nor extends a streak
        if self._last_drop is not None and run[0] <= self._last_drop <= run[1]:
            self._last_run = run

    def _transparent_in(self, low: int, high: int) -> int:
        return bisect.bisect_right(self._transparent, high) - bisect.bisect_left(self._transparent, low)

    def _after_leave(self, group_id: int) -> None:
        if self._last_run is None or not self._last_run[0] <= group_id <= self._last_run[1]:
            return
        self._last_run = None if self._last_drop == group_id else self._runs.run_of(self._last_drop)

    def request_stop(self, reason: str) -> None:
        """Ask the stream to stop as preempted at the next sample or micro-batch (signal-handler safe)."""
        self.stop_requested = reason

    def fold(self, below: int) -> None:
        """Forget the details of settled groups: ids below both `below` (the oldest group not yet through an
        optimizer step) and the first unconsumed id. Keeps a long run's memory flat."""
        with self._lock:
            limit = min(below, self._first_unconsumed)
            if limit <= self._folded:
                return
            for group_id in range(self._folded, limit):
                self._drop_reason.pop(group_id, None)
                self._trained_ids.discard(group_id)
            self._runs.forget(self._folded - 1, limit - 1)  # the run ending at limit - 1 may still grow
            self._folded = limit
            if isinstance(self.consumed, ConsumedIds):
                self.consumed.fold(limit)

    # ---------------------------------------------------------------------------------------------------- decisions
    def check(self) -> None:
        """End the stream when a full pass over the prompts trained no group.

        Also ends it, without error, once the run's groups are consumed. The stall is checked first: in a one-epoch
        run where everything was dropped, "all consumed" is also true, and reporting success with zero steps would
        hide the failure. A requested stop (SIGTERM) comes before both.
        """
        if self.stop_requested is not None:
            raise RolloutStop(self.stop_requested, code=StopCode.PREEMPTED)
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
        return self.needed_end is None or (group_id < self.needed_end and group_id not in self._overflow)

    @property
    def groups_trained(self) -> int:
        """Groups that reached an optimizer step since the run began: those before the resume, plus this process's
        collated less those a stop returned and those the training step's scoring excluded."""
        return self._trained_before + self.groups_collated - self.groups_returned - self.groups_excluded

    @property
    def stall_streak(self) -> int:
        """Consecutive dropped group ids around the newest drop (a trained or unconsumed id ends the run)."""
        run = self._last_run
        return 0 if run is None else run[1] - run[0] + 1 - self._transparent_in(*run)

    @property
    def epochs_done(self) -> int:
        if not self.groups_per_epoch:
            return self._epochs_done
        return max(self._epochs_done, self._settled_before(self._first_unconsumed) // self.groups_per_epoch)

    def _settled_before(self, group_id: int) -> int:
        """Absolute groups settled (trained or dropped) below worker id `group_id`, all of which are consumed."""
        transparent = self._transparent_before + bisect.bisect_left(self._transparent, group_id)
        return self.start_group + group_id - transparent

    @property
    def first_unconsumed(self) -> int:
        """The first worker id not consumed (every id below it trained or was dropped)."""
        return self._first_unconsumed

    def _advance(self) -> None:
        while self._first_unconsumed in self.consumed:
            self._first_unconsumed += 1

    def _dropped_summary(self) -> str:
        summary = ", ".join(f"{reason} {count}" for reason, count in self.dropped.items() if count) or "none"
        if self.dropped[DropReason.STALE.value]:
            summary += (f"; stale past {self.regenerate_limit} regenerations: samples wait in the rollout queue "
                        "longer than training.maxStaleness steps (lower training.extraArgs.queue_maxsize or raise "
                        "maxStaleness)")
        return summary

    # ---------------------------------------------------------------------------------------------------- snapshots
    def consumed_positions(self) -> list[int]:
        """Absolute positions (prompts x passes) consumed within the run's bound, before a resume included."""
        with self._lock:
            relative = [g for g in self.consumed if self.needs(g)]
        return [*range(self.start_group), *sorted(self.start_group + g for g in relative)]

    @property
    def groups_consumed(self) -> int:
        with self._lock:
            consumed = self.consumed
            settled = self.start_group - self._transparent_before - len(self._transparent)
            if self.needed_end is None:
                return settled + len(consumed)
            if isinstance(consumed, ConsumedIds):
                return settled + consumed.count_below(self.needed_end)
            return settled + sum(1 for group_id in consumed if group_id < self.needed_end)

    def report(
        self, *, phase: LearnerPhase, global_step: int, weight_syncs: int = 0, message: str = ""
    ) -> ProgressReport:
        """The figures `/progress`, the metrics and the termination message carry. Raises AccountingError when a
        consumed group inside the bound is neither trained nor dropped (regenerated ones are not consumed)."""
        with self._lock:
            report = ProgressReport(
                phase=phase,
                groups_total=self.groups_total or 0,
                groups_consumed=self.groups_consumed,
                groups_trained=self.groups_trained,
                groups_collated=self.groups_collated,
                groups_returned=self.groups_returned,
                dropped=dict(self.dropped),
                epochs_done=self.epochs_done,
                epochs=self.epochs or 1,
                stall_streak=self.stall_streak,
                stall_limit=self.stall_limit,
                global_step=global_step,
                last_trained_time=self.last_trained_time,
                reward_mean=self.reward_mean,
                weight_syncs=weight_syncs,
                regenerated=self.regenerated,
                message=message,
            )
        if report.groups_consumed != report.groups_trained + report.dropped_total:
            raise AccountingError(
                f"progress accounting is broken: consumed {report.groups_consumed}, trained {report.groups_trained}, "
                f"dropped {report.dropped_total} ({self._dropped_summary()}), regenerated {self.regenerated}")
        return report

    def state_dict(self, *, exclude: Iterable[int] = ()) -> dict[str, Any]:
        """What a checkpoint keeps, by absolute position (prompts x passes).

        `exclude` are groups collated but not through an optimizer step: a resumed run must generate them again.
        The resumed worker starts at the first position not consumed; the checkpoint keeps what lies beyond it
        (consumed positions, and which of them were dropped) and the length of the dropped run that ends right
        before it, so the resumed run sees exactly the stall streaks an uninterrupted one would.
        """
        with self._lock:
            excluded = {g for g in exclude if g in self.consumed}
            start = min([self._first_unconsumed, *excluded])
            beyond = [*range(start + 1, self._first_unconsumed), *self._consumed_beyond(self._first_unconsumed)]
            beyond = sorted(g for g in beyond if g not in excluded)
            dropped_after: dict[str, list[int]] = {}
            for group_id in beyond:
                reason = self._drop_reason.get(group_id)
                if reason is not None:
                    dropped_after.setdefault(reason, []).append(self.start_group + group_id)
            excluded_trained = sum(1 for g in excluded if g in self._trained_ids)
            epochs_done = self._epochs_done
            if self.groups_per_epoch:
                epochs_done = max(epochs_done, self._settled_before(start) // self.groups_per_epoch)
            prefix = self._runs.length_ending_at(start - 1)
            if prefix:
                prefix -= self._transparent_in(start - prefix, start - 1)
            return {
                "first_unconsumed": self.start_group + start,
                "consumed_after": [self.start_group + g for g in beyond],
                "dropped_after": dropped_after,
                "prefix_streak": prefix,
                "regenerated": self.regenerated,
                "bound": None if self.needed_end is None else self.start_group + self.needed_end,
                "transparent_before": self._transparent_before + bisect.bisect_left(self._transparent, start),
                "transparent_after": [self.start_group + g for g in self._transparent if g > start],
                # JSON keys are strings: absolute position -> regenerations of its slot, for stand-ins not settled.
                "regeneration_attempts": {str(self.start_group + g): n for g, n in sorted(self._attempts.items())
                                          if g >= start and (g not in self.consumed or g in excluded)},
                "groups_trained": self.groups_trained - excluded_trained,
                "dropped": dict(self.dropped),
                "epochs_done": epochs_done,
            }

    def _consumed_beyond(self, group_id: int) -> list[int]:
        ids = self.consumed.above if isinstance(self.consumed, ConsumedIds) else self.consumed
        return [g for g in ids if g > group_id]

    @classmethod
    def from_state(
        cls, state: dict[str, Any], consumed: MutableSet[int], *, stall_groups: int, groups_per_epoch: int,
        epochs: float,
    ) -> RolloutProgress:
        """Rebuild after a resume. Fills `consumed` (TRL's set) with worker ids relative to the new start, which is
        the first absolute group not consumed: the worker skips every group before it, so none is generated again."""
        start = state["first_unconsumed"]
        consumed.clear()
        consumed.update(g - start for g in state["consumed_after"])
        dropped_ids = {g - start: reason for reason, ids in state["dropped_after"].items() for g in ids}
        return cls(
            consumed,
            epochs_done=state["epochs_done"],
            stall_groups=stall_groups,
            groups_per_epoch=groups_per_epoch,
            epochs=epochs,
            start_group=start,
            trained=state["groups_trained"],
            dropped=state["dropped"],
            resumed_streak=state["prefix_streak"],
            dropped_ids=dropped_ids,
            # Absent from checkpoints written before stale groups were regenerated: nothing was.
            regenerated=state.get("regenerated", 0),
            bound=state.get("bound"),
            transparent_ids=[g - start for g in state.get("transparent_after", ())],
            transparent_before=state.get("transparent_before", 0),
            regeneration_attempts={int(g) - start: n for g, n in state.get("regeneration_attempts", {}).items()},
        )


# -------------------------------------------------------------------------------------------------------- filtering
#: How often (in group ids) SampleFilterQueue forgets accepted groups that never delivered all their samples.
PRUNE_EVERY_GROUPS = 4096


class SampleFilterQueue:
    """The rollout queue, without the rollouts that would train nothing.

    Duck-types the queue TRL's RolloutQueueDataset reads (`get(timeout)`, `qsize()`). Drops, each reported to
    `progress` with its reason:
    - unscorable: no reward scored the sample (its reward is NaN: TRL's worker gives it advantage 0), whatever
      `drop_no_signal` says;
    - no signal: `reward_std <= eps` (never `advantage == 0`: identical rewards give advantages near 1e-9) or NaN;
    - truncated: the last token is neither eos nor pad (only when `drop_truncated`);
    - stale: TRL's exact rule, `version - sample.model_version > max_staleness`, so TRL's own silent drop never fires;
    - too long: more tokens than one row's `token_budget`, TRL's oversize rule, so its silent drop never fires.
    A group is settled once all its `num_generations` samples were dropped, or when it is given up (below). A stale
    group is regenerated (`RolloutProgress.regenerate`), and dropped as stale only past the regeneration limit.

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
        max_staleness: int,
        num_generations: int,
        token_budget: int = 0,
        drop_no_signal: bool = True,
        drop_truncated: bool = False,
        no_signal_epsilon: float = 1e-6,
        end_token_ids: Iterable[int] = (),
        lost_after_s: float = 1800.0,  # GRPOLearner's default with TRL's request_timeout (600 s)
        clock: Callable[[], float] = time.monotonic,
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
        self.lost_after_s = lost_after_s
        self._clock = clock
        # Per group seen and not yet settled, in containers of ints and interned strings only: an object per group
        # is one the garbage collector tracks, and their growth brought a young-generation collection about every
        # micro-batch (205 vs TRL's 11 on 3,184 48-token samples).
        self._accepted: set[int] = set()  # groups with a sample passed on
        self._samples: dict[int, int] = {}  # group -> samples seen
        self._dropped: dict[int, int] = {}  # group -> samples dropped
        self._reason: dict[int, str] = {}  # group -> its first dropped sample's reason
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
            if progress.stop_requested is not None:  # SIGTERM: stop now, not after the queue's timeout
                progress.check()
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
        if math.isnan(sample.metrics.get("reward", 0.0)):
            # Every reward returned None: TRL trains it with advantage 0. Whatever dropNoSignal says, a group of
            # these is the reward's failure, not a group without signal.
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
        reason = self.drop_reason(sample)
        if reason is None:
            if not accepted:
                self._accepted.add(group_id)
            self._sweep()
            return True
        dropped = self._dropped[group_id] = self._dropped.get(group_id, 0) + 1
        first_reason = self._reason.setdefault(group_id, reason.value)
        if not accepted and dropped >= self.num_generations:
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

    def _give_up(self, group_id: int, reason: str) -> None:
        """Settle a group that will not train: regenerate it if stale (within the limit), else drop it."""
        self._missing.pop(group_id, None)
        self._forget(group_id)
        if reason == DropReason.STALE.value and self.progress.regenerate(group_id):
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
                if self._samples.get(group_id, 0) >= self.num_generations:
                    self._forget(group_id)  # complete: a group missing part of its samples waits for the prune
            elif version - newest_version > self.max_staleness:
                self._give_up(group_id, self._reason.get(group_id) or DropReason.STALE.value)
            elif now - revealed > self.lost_after_s:
                self._give_up(group_id, self._reason.get(group_id) or DropReason.LOST.value)
            else:
                return


# -------------------------------------------------------------------------------------------------------- stream end
class StopAwareDataset(torch.utils.data.IterableDataset):
    """A rollout batcher whose stream ends with the RolloutStop it raised.

    `check()` runs before each micro-batch. On RolloutStop, or any exception of the pipeline (rank 0 alone would
    raise it and strand the other ranks in the broadcast until ddp_timeout), one stop item is yielded, then the
    stream ends. Sticky: the Trainer re-iterates the loader per "epoch", and a new iterator stops again at once.

    The run's end (DONE) comes only at a gradient-accumulation boundary (`window` micro-batches): the window it
    would cut short is filled with the next pass's overflow, so every group the run counts reaches an optimizer step.
    Other stops come at once; the trainer discards the partial window (GRPOLearner.get_batch_samples).
    """

    def __init__(self, batcher: Iterable[Any], progress: RolloutProgress | None = None, *, window: int = 1):
        self.batcher = batcher
        self.progress = progress
        self.window = window
        self.stop: RolloutStop | None = None
        self.micro_batches = 0

    def __iter__(self) -> Iterator[Any]:
        if self.stop is not None:
            yield self.stop
            return
        iterator = iter(self.batcher)
        try:
            if self.progress is not None:
                self.progress.check()
            for micro_batch in iterator:
                self.micro_batches += 1
                yield micro_batch
                # Let go of it before the batcher builds the next one: held here, its hundreds of young objects
                # (TRL's packing tries) were alive while the next micro-batch allocated as many, which crossed the
                # collector's threshold inside every micro-batch (205 collections vs TRL's 11 on one stream).
                del micro_batch
                if self.progress is not None:
                    self.progress.check()
        except RolloutStop as stop:
            self.stop = stop
        except Exception as error:  # noqa: BLE001 - any pipeline failure must reach every rank as a stop
            self._stop_on_error(error)
        if self.stop is None:
            self.stop = RolloutStop("the rollout stream ended", code=StopCode.PIPELINE_ERROR)
        if self.stop.code == StopCode.DONE:
            yield from self._fill_window(iterator)
        yield self.stop

    def _stop_on_error(self, error: Exception) -> None:
        logger.exception("rollout pipeline failed on rank 0; stopping every rank")
        self.stop = RolloutStop(f"{type(error).__name__}: {error}", code=StopCode.PIPELINE_ERROR)
        self.stop.__cause__ = error

    def _fill_window(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # A stop raised inside the batcher ended its generator: the fill then reads the queue through a new one.
        for source in (iterator, iter(self.batcher)):
            try:
                while self.micro_batches % self.window:
                    micro_batch = next(source)
                    self.micro_batches += 1
                    yield micro_batch
                    del micro_batch  # as in __iter__
                return
            except StopIteration:
                continue
            except RolloutStop as stop:  # a SIGTERM while filling: stop now, the window is discarded
                self.stop = stop
                return
            except Exception as error:  # noqa: BLE001 - the window is discarded and the run fails: nothing is counted twice
                self._stop_on_error(error)
                return


# -------------------------------------------------------------------------------------------------------- collation
STOP_KEY = "rollout_stop"
#: Each rank's row of samples as group ids (-1 pads rows to one width): the training step's scoring reports by group.
SAMPLE_GROUP_KEY = "sample_group"


@dataclass
class ProgressCollator(DataCollatorForRollout):
    """TRL's collator, reporting trained groups and passing a stream stop on.

    Groups are reported at collate time, like TRL's own count (fine for the stop decision, which is FIFO); the
    micro-batches collated but not yet trained are kept in `in_flight` so a checkpoint can leave them out.
    """

    progress: RolloutProgress | None = None
    in_flight: deque = field(default_factory=deque)
    #: With trainer-side scoring (grpo_trainer.step_scoring), rank 0's samples collated per group, which tells it
    #: when every collated sample of a group was scored.
    samples_collated: dict[int, int] | None = None

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (item,) = examples
        if isinstance(item, RolloutStop):
            # One row per rank; every leaf is a tensor so accelerate's dispatcher can slice and broadcast it.
            streak = self.progress.stall_streak if self.progress else 0
            limit = self.progress.stall_limit if self.progress else 0
            return {STOP_KEY: torch.tensor([[int(item.code), streak, limit]] * self.num_processes)}
        batch = super().torch_call(examples)
        rows = [torch.tensor([sample["group_id"] for sample in row.samples], dtype=torch.long) for row in item]
        batch[SAMPLE_GROUP_KEY] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
        if self.samples_collated is not None:
            for group_id in batch[SAMPLE_GROUP_KEY][batch[SAMPLE_GROUP_KEY] >= 0].tolist():
                self.samples_collated[group_id] = self.samples_collated.get(group_id, 0) + 1
        group_ids = frozenset({sample["group_id"] for row in item for sample in row.samples})
        self.in_flight.append(group_ids)
        if self.progress is not None:
            self.progress.train(group_ids)
            # TRL's collator has just logged this micro-batch's nan-aware mean reward into the metric sink. A reward
            # function may return inf: the report holds finite numbers only (the operator copies it into status).
            rewards = self.metrics.get("reward")
            if rewards and math.isfinite(rewards[-1]):
                self.progress.reward_mean = rewards[-1]
        return batch


def stop_from_batch(inputs: dict[str, Any]) -> tuple[StopCode, int, int] | None:
    """The stop a micro-batch carries, as every rank sees it after dispatch, or None for a normal micro-batch."""
    if STOP_KEY not in inputs:
        return None
    code, streak, limit = (int(v) for v in inputs[STOP_KEY].reshape(-1, 3)[0].tolist())
    return StopCode(code), streak, limit
