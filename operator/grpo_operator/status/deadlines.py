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


def deadline_exceeded(spec: GRPORunSpec, status: GRPORunStatus, now: datetime.datetime) -> Exceeded | None:
    """The active deadline (since the run started or resumed), then the startup deadline (nothing trained yet)."""
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
