"""RolloutProgress: consumed, trained and dropped prompt groups, and when the rollout stream must stop."""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable, MutableSet
from dataclasses import dataclass
from enum import IntEnum

from ..contract.codes import DropReason, LearnerPhase, StallCause
from ..contract.report import ProgressReport
from .ids import ConsumedIds, DropRuns
from .state import ProgressState


class StopCode(IntEnum):
    """What the stop micro-batch carries to every rank (tensors only: a string leaf breaks the broadcast)."""

    DONE = 1  # the run's groups are consumed
    STALLED = 2  # a full pass (stall limit) of groups trained nothing
    PIPELINE_ERROR = 3  # rank 0's rollout pipeline raised (e.g. the worker's health check)
    PREEMPTED = 4  # SIGTERM: save a checkpoint and stop


class RolloutStop(Exception):
    """Ends the rollout stream; error is set when the run made no progress, `cause` when it stalled."""

    def __init__(self, error: str | None = None, *, code: StopCode | None = None, cause: StallCause | None = None):
        super().__init__(error or "rollout stream complete")
        self.error = error
        self.code = code if code is not None else (StopCode.DONE if error is None else StopCode.STALLED)
        self.cause = cause


@dataclass(frozen=True)
class StallVerdict:
    """A stall by the learner's rules: what stalled (which /progress carries to the operator) and the message the
    run ends with."""

    cause: StallCause
    message: str


#: A group's slot is regenerated at most this many times; the next stale generation is dropped as `stale`.
REGENERATE_LIMIT = 2


class StallError(RuntimeError):
    """Raised by `train()` on every rank when a full pass over the prompts trained nothing. Do not retry."""


class RolloutPipelineError(RuntimeError):
    """Raised on every rank when rank 0's rollout pipeline failed; rank 0 chains the original exception."""


class AccountingError(RuntimeError):
    """A report whose consumed groups are not all trained or dropped: a bug in the accounting, never user error."""


class RolloutProgress:
    """Consumed and trained prompt groups, and the stream's stop conditions.

    `consumed` is the trainer's set TRL counts epochs and resumes from: a group counts once it trained or its
    rollouts were dropped. `stall_groups` bounds how many groups may be consumed in a row without one training
    (0: one pass over the prompts).

    Only rank 0 reports, from the rollout stream (reward-model scoring included: grpo_trainer.learner.scoring runs
    inside it, before batching) and, with trainer-side scoring, from `score_step` (grpo_trainer.learner.step_scoring:
    `exclude`); the stream raises the stop, so that it reaches every rank as a stop micro-batch.

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
        clock: Callable[[], float] = time.time,
        regenerate_limit: int = REGENERATE_LIMIT,
        stall_cause: Callable[[int], str | None] | None = None,
    ):
        """A fresh run's progress; `restore` rebuilds a resumed one from its checkpoint. `stall_cause(streak)`: what
        the stall's message adds about the last `streak` groups, if anything (the environment their episodes all
        failed in: `episodes.EpisodeCounts.failed_environments`)."""
        if stall_groups < 0:
            raise ValueError(f"stall_groups must be >= 0, got {stall_groups}")
        if stall_groups == 0 and not groups_per_epoch:
            raise ValueError("stall_groups=0 means one pass over the prompts, which needs groups_per_epoch")
        self.consumed = consumed
        self._epochs_done = epochs_done
        self.groups_per_epoch = groups_per_epoch
        self.epochs = epochs
        self.stall_limit = stall_groups or groups_per_epoch
        self.start_group = 0
        # The run's bound in worker ids; TRL rounds fractional epochs up the same way (`_epoch_stop_groups`).
        total = math.ceil(epochs * groups_per_epoch) if groups_per_epoch and epochs else None
        self.groups_total = total
        self.needed_end = total
        self.regenerate_limit = regenerate_limit
        self.stall_cause = stall_cause
        self.regenerated = 0
        self.regenerated_for_environment = 0  # of `regenerated`: groups an environment's failure left untrained
        # Regenerated ids, and overflow ids the moved bound swallowed: consumed, neither trained nor dropped.
        self._transparent: list[int] = []  # sorted
        self._transparent_set: set[int] = set()
        self._transparent_before = 0  # transparent positions before start_group
        self._overflow: set[int] = set()  # ids passed unfiltered as past the bound
        # Stand-in id -> how many times its slot was regenerated; a checkpoint keeps it, so the limit holds across
        # resumes.
        self._attempts: dict[int, int] = {}
        # Counters of this process (Prometheus': they start at 0 in every process, a resumed one too);
        # `groups_trained`, the run's total, is the checkpoint's count plus what they add.
        self._trained_before = 0
        self.groups_collated = 0
        self.groups_returned = 0
        self.groups_excluded = 0  # collated groups the training step's scoring took out of the loss whole
        self.dropped = {reason.value: 0 for reason in DropReason}
        self._lock = threading.RLock()
        self._drop_reason: dict[int, str] = {}  # dropped (not trained) ids -> reason, above the folded prefix
        self._trained_ids: set[int] = set()
        # Trained ids with a row in a window that reached an optimizer step, above the folded prefix. A group spans
        # windows when its rows outnumber a micro-batch's (a multi-row group, grpo_trainer.agentic.episodes): it trained
        # once any of its rows stepped, whatever happens to its rows in later windows.
        self._stepped: set[int] = set()
        self._first_unconsumed = 0
        self._folded = 0  # ids below this are settled: their details are forgotten
        self._runs = DropRuns()
        self._last_drop: int | None = None
        self._last_run: tuple[int, int] | None = None
        self.stop_requested: str | None = None
        self.environment_stall: str | None = None  # an environment unavailable past its bound (`stop_unavailable`)
        self.last_trained_time: float | None = None
        self.reward_mean: float | None = None
        self._clock = clock
        self._advance()

    @classmethod
    def restore(cls, state: ProgressState, consumed: MutableSet[int], *, stall_groups: int, groups_per_epoch: int,
                epochs: float, clock: Callable[[], float] = time.time,
                regenerate_limit: int = REGENERATE_LIMIT,
                stall_cause: Callable[[int], str | None] | None = None) -> RolloutProgress:
        """Rebuild after a resume. Fills `consumed` (TRL's set) with worker ids relative to the new start, which is
        the first absolute group not consumed: the worker skips every group before it, so none is generated again."""
        start = state.first_unconsumed
        consumed.clear()
        consumed.update(g - start for g in state.consumed_after)
        progress = cls(consumed, epochs_done=state.epochs_done, stall_groups=stall_groups,
                       groups_per_epoch=groups_per_epoch, epochs=epochs, clock=clock,
                       regenerate_limit=regenerate_limit, stall_cause=stall_cause)
        progress._resume_at(state)
        return progress

    def _resume_at(self, state: ProgressState) -> None:
        start = self.start_group = state.first_unconsumed
        bound = self.groups_total if state.bound is None else state.bound
        self.needed_end = None if bound is None else max(bound - start, 0)
        self.regenerated = state.regenerated
        self.regenerated_for_environment = state.regenerated_environment
        self._transparent_before = state.transparent_before
        self._attempts = {g - start: n for g, n in state.regeneration_attempts.items()}
        self._trained_before = state.groups_trained
        self.dropped |= state.dropped
        # A streak open right before the resume point, carried over from the checkpoint, is the run ending at -1.
        self._runs = DropRuns(state.prefix_streak)
        self._first_unconsumed = 0
        dropped_ids = {g - start: reason for reason, ids in state.dropped_after.items() for g in ids}
        for group_id, reason in sorted(dropped_ids.items()):
            self.consumed.add(group_id)
            self._drop_reason[group_id] = reason
            self._runs.join(group_id)
        for group_id in sorted(g - start for g in state.transparent_after):
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
                if self._drop_reason.get(group_id) == DropReason.EXCLUDED.value:
                    # The training step's scoring took every sample of it out: a late sample trains it only if
                    # that sample is kept (`readmit`), which its own verdict decides after this.
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

        Runs outside the stream (rank 0's training step, grpo_trainer.learner.step_scoring), so the stall it may
        complete is raised by the stream's next check. Counted once: a group that is not collated and trained here
        (settled, dropped, excluded already, past the bound) is left as it is.
        """
        with self._lock:
            if group_id < self._folded or group_id not in self._trained_ids or not self.needs(group_id):
                return
            self._trained_ids.discard(group_id)
            self.groups_excluded += 1
            self._record_drop(group_id, reason)

    def readmit(self, group_id: int) -> None:
        """Count an excluded group as trained after all: the training step's scoring kept a late sample of it.

        Undoes `exclude`, and only that: a group dropped for another reason, or settled, is left as it is."""
        now = self._clock()
        with self._lock:
            if group_id < self._folded or self._drop_reason.get(group_id) != DropReason.EXCLUDED.value:
                return
            del self._drop_reason[group_id]
            self.dropped[DropReason.EXCLUDED.value] -= 1
            self.groups_excluded -= 1
            self._runs.leave(group_id)
            self._after_leave(group_id)
            self._trained_ids.add(group_id)
            self.last_trained_time = now

    def stepped(self, group_ids: Iterable[int]) -> None:
        """Record collated groups whose window goes on to an optimizer step: trained for good, even when rows of
        theirs in a later window are discarded (`untrain`) or only collated when a checkpoint is saved."""
        with self._lock:
            self._stepped.update(g for g in group_ids if g >= self._folded and g in self._trained_ids)

    def untrain(self, group_ids: Iterable[int]) -> None:
        """Return collated groups that never reached an optimizer step to the unconsumed set (a discarded
        gradient-accumulation window): a checkpoint then leaves them out and a resumed run generates them again.
        A group with rows in an earlier window that stepped stays trained (`stepped`): its rows here are lost, as
        rows of a trained group still in the queue are at a stop, and none of it trains twice."""
        with self._lock:
            for group_id in group_ids:
                if (group_id < self._folded or group_id not in self.consumed or group_id in self._drop_reason
                        or group_id in self._transparent_set or group_id in self._stepped):
                    continue
                if group_id in self._trained_ids:
                    self._trained_ids.discard(group_id)
                    self.groups_returned += 1
                self.consumed.discard(group_id)
                self._first_unconsumed = min(self._first_unconsumed, group_id)

    def regenerate(self, group_id: int, *, for_environment: bool = False) -> bool:
        """Take a stale group, or (`for_environment`) one an environment's failure left untrained, out of the
        accounting and let the next group take its place.

        Both kinds share one budget per slot: a slot is generated at most 1 + `regenerate_limit` times whatever went
        wrong with each try, so a run generates at most (1 + limit) x its groups however its environments and queue
        behave. Returns False when the slot's budget is spent: the caller then drops it (as stale, or with the
        environment's episodes' drop reason), and it counts toward the stall streak like any drop. A settled group
        returns True (nothing to do).
        """
        with self._lock:
            if group_id < self._folded or group_id in self.consumed:
                return True
            attempts = self._attempts.pop(group_id, 0)
            if attempts >= self.regenerate_limit:
                return False
            self.regenerated += 1
            self.regenerated_for_environment += for_environment
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

    def stop_unavailable(self, message: str) -> None:
        """End the stream as stalled: an environment had no ready server for longer than its unavailableSeconds
        (grpo_trainer.agentic.availability). Only sets a flag, from the watch's thread: the stream raises it."""
        self.environment_stall = message

    @property
    def stop_pending(self) -> bool:
        """Whether the stream must stop at its next look, whatever its queue holds."""
        return self.stop_requested is not None or self.environment_stall is not None

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
                self._stepped.discard(group_id)
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

        The stream checks with what it knows: the training step's scoring may still exclude groups it collated, so
        the end it raises is confirmed by `end_stop` once they all trained.
        """
        if self.stop_requested is not None:
            raise RolloutStop(self.stop_requested, code=StopCode.PREEMPTED)
        stall = self._stall()
        if stall is not None:
            raise stall
        if self.all_consumed:
            raise RolloutStop()

    def end_stop(self) -> RolloutStop:
        """How a run whose stream ended at the bound really ends, once every group collated before the end trained
        and was scored: the stall when the exclusions that came after the stream's decision make a full pass
        without one group training (or nothing trained at all), else the end at the bound."""
        with self._lock:
            return self._stall() or RolloutStop()

    def _stall(self) -> RolloutStop | None:
        verdict = self.stall_verdict()
        return None if verdict is None else RolloutStop(verdict.message, code=StopCode.STALLED, cause=verdict.cause)

    def stall_verdict(self) -> StallVerdict | None:
        """The stall rules, written here only: the stream stops on them, and every report carries their verdict,
        which the operator shows as it is. An environment with no ready server past its unavailableSeconds
        (`stop_unavailable`), a full pass (the stall limit) of groups in a row consumed without one training, or the
        whole run consumed and none trained (a run shorter than its stall limit)."""
        with self._lock:
            if self.environment_stall is not None:
                return StallVerdict(StallCause.ENVIRONMENT_UNAVAILABLE, f"stalled: {self.environment_stall}")
            streak = self.stall_streak
            if streak >= self.stall_limit:
                return StallVerdict(StallCause.STREAK, (
                    f"stalled: {streak} prompt groups in a row were consumed without one training "
                    f"(limit {self.stall_limit}; dropped so far: {self._dropped_summary()}){self._cause(streak)}"))
            if self.all_consumed and self.groups_trained == 0:
                return StallVerdict(StallCause.NOTHING_TRAINED, (
                    f"stalled: all {self.groups_total} prompt groups were consumed and none trained "
                    f"(dropped: {self._dropped_summary()}){self._cause(streak)}"))
            return None

    def _cause(self, streak: int) -> str:
        cause = self.stall_cause(streak) if self.stall_cause is not None else None
        return f"; {cause}" if cause else ""

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
        return self._epochs_done_before(self._first_unconsumed)

    def _epochs_done_before(self, group_id: int) -> int:
        """Whole passes over the prompts settled below worker id `group_id`, within the run's bound: the worker
        goes on generating past the last epoch, and the overflow it consumed is no epoch of this run. Derived from
        the positions alone (a checkpoint's own figure may predate the bound), `epochs_done` as given without
        `groups_per_epoch`."""
        if not self.groups_per_epoch:
            return self._epochs_done
        settled = self._settled_before(group_id)
        if self.groups_total is not None:
            settled = min(settled, self.groups_total)
        return settled // self.groups_per_epoch

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
            stall = self.stall_verdict()
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
                stalled=stall is not None,
                stall_cause=None if stall is None else stall.cause,
                global_step=global_step,
                last_trained_time=self.last_trained_time,
                reward_mean=self.reward_mean,
                weight_syncs=weight_syncs,
                regenerated=self.regenerated,
                regenerated_environment=self.regenerated_for_environment,
                message=message,
            )
        if report.groups_consumed != report.groups_trained + report.dropped_total:
            raise AccountingError(
                f"progress accounting is broken: consumed {report.groups_consumed}, trained {report.groups_trained}, "
                f"dropped {report.dropped_total} ({self._dropped_summary()}), regenerated {self.regenerated}")
        return report

    def checkpoint_state(self, *, exclude: Iterable[int] = ()) -> ProgressState:
        """What a checkpoint keeps, by absolute position (prompts x passes).

        `exclude` are groups collated but not through an optimizer step: a resumed run must generate them again.
        Groups with rows in a window that stepped, and settled (folded) groups, are kept whatever `exclude` says:
        their rows in `exclude` are later rows of a group that trained.
        The resumed worker starts at the first position not consumed; the checkpoint keeps what lies beyond it
        (consumed positions, and which of them were dropped) and the length of the dropped run that ends right
        before it, so the resumed run sees exactly the stall streaks an uninterrupted one would.
        """
        with self._lock:
            excluded = {g for g in exclude
                        if g >= self._folded and g in self.consumed and g not in self._stepped}
            # Resume at the first group not consumed, or at the bound: the overflow consumed past it (the worker
            # generates on after the last epoch) is no group of this run, and a run resumed there is at its end.
            bound = [] if self.needed_end is None else [self.needed_end]
            start = min([self._first_unconsumed, *excluded, *bound])
            beyond = [*range(start + 1, self._first_unconsumed), *self._consumed_beyond(self._first_unconsumed)]
            beyond = sorted(g for g in beyond if g not in excluded)
            dropped_after: dict[str, list[int]] = {}
            for group_id in beyond:
                reason = self._drop_reason.get(group_id)
                if reason is not None:
                    dropped_after.setdefault(reason, []).append(self.start_group + group_id)
            excluded_trained = sum(1 for g in excluded if g in self._trained_ids)
            prefix = self._runs.length_ending_at(start - 1)
            if prefix:
                prefix -= self._transparent_in(start - prefix, start - 1)
            return ProgressState(
                first_unconsumed=self.start_group + start,
                consumed_after=[self.start_group + g for g in beyond],
                dropped_after=dropped_after,
                prefix_streak=prefix,
                regenerated=self.regenerated,
                regenerated_environment=self.regenerated_for_environment,
                bound=None if self.needed_end is None else self.start_group + self.needed_end,
                transparent_before=self._transparent_before + bisect.bisect_left(self._transparent, start),
                transparent_after=[self.start_group + g for g in self._transparent if g > start],
                # Absolute position -> regenerations of its slot, for stand-ins not settled.
                regeneration_attempts={self.start_group + g: n for g, n in sorted(self._attempts.items())
                                       if g >= start and (g not in self.consumed or g in excluded)},
                groups_trained=self.groups_trained - excluded_trained,
                dropped=dict(self.dropped),
                epochs_done=self._epochs_done_before(start),
            )

    def _consumed_beyond(self, group_id: int) -> list[int]:
        ids = self.consumed.above if isinstance(self.consumed, ConsumedIds) else self.consumed
        return [g for g in ids if g > group_id]
