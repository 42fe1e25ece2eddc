"""The run's time limits, as pure checks: activeDeadlineSeconds, startupDeadlineSeconds and the stall rules."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from ..api import GRPORunSpec, GRPORunStatus, Reason
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
    """Why the run counts as stalled: the learner's own stall streak, or no group trained for the deadline."""
    progress, deadline = status.progress, spec.progress.progress_deadline_seconds
    if progress is not None and progress.stall_limit > 0 and progress.stall_streak >= progress.stall_limit:
        return Exceeded(Reason.STALL_LIMIT_REACHED, f"{progress.stall_streak} groups consumed in a row without one "
                        f"training (limit {progress.stall_limit})")
    if running and idle >= deadline:
        return Exceeded(Reason.PROGRESS_DEADLINE_EXCEEDED,
                        f"no group trained for {int(idle)} s (progressDeadlineSeconds {deadline})")
    return None
