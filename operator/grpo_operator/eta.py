"""Progress users can plan with: percentage, estimated remaining time and the time of the last update, under the
names of Kubeflow Trainer's TrainJob progress (KEP-2779: `progressPercentage`, `estimatedRemainingSeconds`,
`lastUpdatedTime`), from the recent rate, not the average since the start. Pure: the status and `now` in, fields out.

The rate comes from progress samples kept in `status.progressRate.samples` (so an operator restart keeps them): one
at most every SAMPLE_SPACING_SECONDS while the learner's counts move, dropped once older than WINDOW_SECONDS. Over
the window, the trained-group rate and the trained share of consumed groups give the time to consume what remains
of the epoch bound: remaining × Δt / Δconsumed. It is absent while the window holds no trained group (a stall, a hung
learner, a run that just started), while the Stalled condition is True, and while the run is not Running.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from pydantic import ConfigDict, Field

from grpo_trainer.contract.wire import INT64_MAX, WireModel

from .apitime import format_time, parse_time

#: The "recent" in recent rate: long enough to span several optimizer steps of a large model, short enough that a
#: slowdown (a preempted node, longer completions) shows within minutes.
WINDOW_SECONDS = 600.0
SAMPLE_SPACING_SECONDS = 60.0


class _StatusModel(WireModel):
    model_config = ConfigDict(extra="ignore")


class RateSample(_StatusModel):
    time: str
    groups_consumed: int
    groups_trained: int


class ProgressRate(_StatusModel):
    """Samples of the learner's counts over the last WINDOW_SECONDS, oldest first."""

    samples: list[RateSample] = Field(default_factory=list)


def percentage(consumed: int, total: int) -> int | None:
    """Whole percent of the bound consumed (KEP-2779's progressPercentage is an integer), None without a bound."""
    return min(100, consumed * 100 // total) if total > 0 else None


def recent_samples(samples: list[RateSample], now: datetime.datetime) -> list[RateSample]:
    return [s for s in samples if (now - parse_time(s.time)).total_seconds() <= WINDOW_SECONDS]


def record(samples: list[RateSample], consumed: int, trained: int, now: datetime.datetime) -> list[RateSample]:
    """The window's samples after an observation of the counts at `now` (a new sample only when they moved)."""
    kept = recent_samples(samples, now)
    last = kept[-1] if kept else None
    if last is not None and (last.groups_consumed, last.groups_trained) == (consumed, trained):
        return kept
    if last is not None and (now - parse_time(last.time)).total_seconds() < SAMPLE_SPACING_SECONDS:
        return kept
    return [*kept, RateSample(time=format_time(now), groups_consumed=consumed, groups_trained=trained)]


def remaining_seconds(samples: list[RateSample], consumed: int, trained: int, total: int,
                      updated: datetime.datetime) -> int | None:
    """Seconds to the bound at the window's rate, as of `updated` (when the counts were read); None without a rate."""
    if not samples or total <= 0:
        return None
    oldest = samples[0]
    elapsed = (updated - parse_time(oldest.time)).total_seconds()
    consumed_delta, trained_delta = consumed - oldest.groups_consumed, trained - oldest.groups_trained
    if elapsed <= 0 or consumed_delta <= 0 or trained_delta <= 0:
        return None
    # Capped to what the API server stores: a learner may report any count up to int64.
    return min(INT64_MAX, round(max(0, total - consumed) * elapsed / consumed_delta))


def update_estimate(progress: Any, rate: ProgressRate | None, previous: Any, now: datetime.datetime, *,
                    running: bool, stalled: bool, succeeded: bool) -> ProgressRate | None:
    """Fill `progress`'s percentage, estimate and update time in place; returns the samples to keep.

    `progress` is this pass's status.progress, `previous` the last pass's (None at first): the update time moves only
    when the counts do.
    """
    moved = previous is None or previous.last_updated_time is None or (
        (progress.groups_consumed, progress.groups_trained) != (previous.groups_consumed, previous.groups_trained))
    progress.last_updated_time = format_time(now) if moved else previous.last_updated_time
    progress.progress_percentage = percentage(progress.groups_consumed, progress.groups_total)
    if succeeded:
        progress.estimated_remaining_seconds = 0
        return None
    samples = record(rate.samples if rate else [], progress.groups_consumed, progress.groups_trained, now)
    estimate = remaining_seconds(samples, progress.groups_consumed, progress.groups_trained, progress.groups_total,
                                 parse_time(progress.last_updated_time))
    progress.estimated_remaining_seconds = estimate if running and not stalled else None
    if not running:
        return None  # suspended, restarting or failed: the next rate starts afresh when training does
    return ProgressRate(samples=samples) if samples else None


#: KEP-2779 types these as int32.
INT32_MAX = 2**31 - 1
#: status.progress's figures that status.trainerStatus.metrics[] repeats, as (metric name, field), in this order.
TRAINER_METRICS = (
    ("currentEpoch", "epoch"), ("totalEpochs", "epochs"), ("globalStep", "global_step"),
    ("groupsConsumed", "groups_consumed"), ("groupsTotal", "groups_total"), ("groupsTrained", "groups_trained"),
    ("groupsDropped", "groups_dropped"), ("rewardMean", "reward_mean"), ("maskedFraction", "masked_fraction"),
)


class TrainerMetric(_StatusModel):
    name: str
    value: str


class TrainerStatus(_StatusModel):
    """Kubeflow Trainer's `status.trainerStatus` (KEP-2779), field for field, so what reads a TrainJob's progress
    reads a GRPORun's."""

    progress_percentage: int | None = Field(None, ge=0, le=100)
    estimated_remaining_seconds: int | None = Field(None, ge=0, le=INT32_MAX)
    metrics: list[TrainerMetric] = Field(default_factory=list)
    last_updated_time: str | None = None


def _metric_value(value: Any) -> str | None:
    """A figure as KEP-2779's string value: integers whole, other numbers to 6 significant digits; None for a missing
    or non-finite one (not a number a dashboard can plot)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return format(value, ".6g")
    return None


def trainer_status(progress: Any) -> TrainerStatus:
    """status.trainerStatus from this pass's status.progress (after `update_estimate`): its percentage, estimate and
    update time, and its counts as name/value metrics. Only the fixed names above, so what the learner reports can
    add no entry and no field, and every value is a short string."""
    metrics = [TrainerMetric(name=name, value=value) for name, attribute in TRAINER_METRICS
               if (value := _metric_value(getattr(progress, attribute, None))) is not None]
    estimate = progress.estimated_remaining_seconds
    return TrainerStatus(
        progress_percentage=progress.progress_percentage,
        estimated_remaining_seconds=None if estimate is None else min(max(estimate, 0), INT32_MAX),
        metrics=metrics, last_updated_time=progress.last_updated_time)


def format_duration(seconds: int | None) -> str:
    """1h02m, 5m07s, 42s; '-' without an estimate (the `grporun local` bar)."""
    if seconds is None:
        return "-"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
