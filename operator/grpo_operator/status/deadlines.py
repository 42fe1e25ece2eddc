"""The run's time limits, as pure checks: activeDeadlineSeconds, startupDeadlineSeconds, progressDeadlineSeconds;
and the learner's stall verdict, which the operator shows as the learner reports it (the stall rules are the
learner's: grpo_trainer.progress.accounting)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from grpo_trainer.contract.codes import StallCause

from ..api import GRPORunSpec
from ..run_status import GRPORunStatus, ProgressStatus, Reason
from .conditions import seconds_since


@dataclass(frozen=True)
class Exceeded:
    reason: str
    message: str
    waiting: str | None = None  # why the run was still waiting, for a startup deadline


def deadline_exceeded(spec: GRPORunSpec, status: GRPORunStatus, now: datetime.datetime, *,
                      pending: bool) -> Exceeded | None:
    """The active deadline (since the run started or resumed), then the startup deadline: nothing trained yet, or
    (`pending`: the run is Pending or Starting again) not running again, since the pause began."""
    policy, progress = spec.run_policy, spec.progress
    active = seconds_since(now, status.start_time)
    if policy.active_deadline_seconds is not None and active >= policy.active_deadline_seconds:
        return Exceeded(Reason.DEADLINE_EXCEEDED, f"the run was active for {int(active)} s "
                        f"(activeDeadlineSeconds {policy.active_deadline_seconds})")
    startup = progress.startup_deadline_seconds
    if startup is not None and status.last_progress_time is None and active >= startup:
        waiting = status.message
        message = f"no group trained {int(active)} s after the pods were created (startupDeadlineSeconds {startup})"
        return Exceeded(Reason.STARTUP_DEADLINE_EXCEEDED, message + (f"; {waiting}" if waiting else ""), waiting)
    paused_since = status.progress_clock.paused_since if status.progress_clock else None
    if startup is not None and pending and status.last_progress_time is not None and paused_since is not None:
        waited = seconds_since(now, paused_since)
        if waited >= startup:
            why = status.message
            message = f"the run has waited {int(waited)} s to run again (startupDeadlineSeconds {startup})"
            return Exceeded(Reason.STARTUP_DEADLINE_EXCEEDED, message + (f"; {why}" if why else ""), why)
    return None


def stall_cause(spec: GRPORunSpec, status: GRPORunStatus, idle: float, *, running: bool) -> Exceeded | None:
    """Why the run counts as stalled: the learner says so, or no group trained for the deadline."""
    progress, deadline = status.progress, spec.progress.progress_deadline_seconds
    if progress is not None and progress.stalled:
        return learner_stall(progress)
    if running and idle >= deadline:
        return Exceeded(Reason.PROGRESS_DEADLINE_EXCEEDED,
                        f"no group trained for {int(idle)} s (progressDeadlineSeconds {deadline})")
    return None


def learner_stall(progress: ProgressStatus) -> Exceeded:
    """The Stalled condition for the learner's verdict, named by the cause it reports (a cause only a newer learner
    knows, by its name)."""
    cause = progress.stall_cause
    if cause == StallCause.STREAK:
        return Exceeded(Reason.STALL_LIMIT_REACHED, f"{progress.stall_streak} groups consumed in a row without one "
                        f"training (limit {progress.stall_limit})")
    if cause == StallCause.NOTHING_TRAINED:
        return Exceeded(Reason.STALLED, f"all {progress.groups_total} groups of the run were consumed and none "
                        "trained")
    if cause == StallCause.WEIGHT_SYNC:
        return Exceeded(Reason.WEIGHT_SYNC_STUCK, "a weight sync outlived rollout.weightSync.deadlineSeconds")
    if cause == StallCause.ENVIRONMENT_UNAVAILABLE:
        return Exceeded(Reason.STALLED, "an environment had no ready server for longer than its "
                        "spec.environments[].unavailableSeconds")
    return Exceeded(Reason.STALLED, "the learner reports that it stalled" + (f" ({cause})" if cause else ""))
