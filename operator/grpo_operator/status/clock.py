"""The progress clock: how long a run has gone without training a group, counting only time spent Running.

Pure functions on `status.progressClock` (api.ProgressClock). The clock measures inactivity, not age: it restarts
on every trained group and pauses while the run is not Running (queued, pulling images, loading the model,
suspended), and its anchors live in the status so an operator restart neither resets nor skips it.
docs/operator.md describes the rules.
"""

from __future__ import annotations

import datetime

from ..run_status import ProgressClock
from .conditions import format_time, seconds_since


def tick(clock: ProgressClock | None, now: datetime.datetime, *, running: bool) -> ProgressClock | None:
    """The clock after a pass: running starts it (or resumes it from a pause), anything else pauses it."""
    original = clock
    clock = (clock or ProgressClock()).model_copy()
    stamp = format_time(now)
    if running:
        if clock.anchor_time is None:
            clock.anchor_time = stamp
        if clock.paused_since is not None:
            clock.paused_seconds += seconds_since(now, clock.paused_since)
            clock.paused_since = None
    elif clock.anchor_time is not None and clock.paused_since is None:
        clock.paused_since = stamp
    return clock if clock.anchor_time is not None else original


def restart(clock: ProgressClock | None, now: datetime.datetime) -> ProgressClock:
    """A group trained: the clock starts again from `now` (still paused if it was paused)."""
    clock = (clock or ProgressClock()).model_copy()
    clock.anchor_time, clock.paused_seconds = format_time(now), 0.0
    clock.paused_since = None if clock.paused_since is None else format_time(now)
    return clock


def restart_pause(clock: ProgressClock | None, now: datetime.datetime) -> ProgressClock | None:
    """A paused clock's pause, counted so far, folded into `pausedSeconds`; the pause goes on from `now`."""
    if clock is None or clock.paused_since is None:
        return clock
    clock = clock.model_copy()
    clock.paused_seconds += seconds_since(now, clock.paused_since)
    clock.paused_since = format_time(now)
    return clock


def idle_seconds(clock: ProgressClock | None, now: datetime.datetime) -> float:
    """Running seconds since the clock's anchor (the last trained group, or the start of running)."""
    if clock is None or clock.anchor_time is None:
        return 0.0
    paused = clock.paused_seconds + (seconds_since(now, clock.paused_since) if clock.paused_since else 0.0)
    return max(0.0, seconds_since(now, clock.anchor_time) - paused)
