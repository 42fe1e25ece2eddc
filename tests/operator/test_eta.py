"""The time-remaining estimate on the status (KEP-2779's progressPercentage, estimatedRemainingSeconds,
lastUpdatedTime): from the recent rate, absent until there is one, gone on a stall; its printer column; the local
bar."""

from __future__ import annotations

from typing import Any

from grpo_operator import eta
from grpo_operator.local.console import bar_fields
from tests.operator.test_lifecycle import printer_columns
from tests.operator.test_status import T0, at, report, running_pods, spec_of, step

TOTAL = 1000


class Run:
    """A Running run driven one operator pass at a time, the learner's counts set per pass."""

    def __init__(self, **spec: Any):
        self.spec = spec_of(**spec)
        self.status = step(self.spec, {}, [], now=T0).status

    def observe(self, seconds: float, consumed: int, trained: int | None = None) -> dict[str, Any]:
        trained = consumed if trained is None else trained
        progress = report(groupsTotal=TOTAL, groupsConsumed=consumed, groupsTrained=trained)
        self.status = step(self.spec, self.status, running_pods(), progress, now=at(seconds)).status
        return self.status["progress"]


def test_no_estimate_until_there_is_a_rate():
    run = Run()
    first = run.observe(0, consumed=10)
    assert first["progressPercentage"] == 1 and first["lastUpdatedTime"] == "2026-01-01T12:00:00Z"
    assert "estimatedRemainingSeconds" not in first, "one sample is no rate"


def test_a_steady_rate_gives_the_remaining_time_at_that_rate():
    run = Run()
    for minute in range(5):
        progress = run.observe(60 * minute, consumed=100 * minute, trained=90 * minute)  # 100 groups a minute
    # 400 of 1000 consumed at 100 a minute: 6 minutes left, whatever share of them trains.
    assert progress["estimatedRemainingSeconds"] == 360 and progress["progressPercentage"] == 40
    assert printer_columns({"status": run.status})["ETA"] == 360


def test_the_estimate_follows_the_recent_rate_not_the_average_since_the_start():
    run = Run()
    for minute in range(10):  # 50 groups a minute for 9 minutes ...
        run.observe(60 * minute, consumed=50 * minute)
    for minute in range(10, 21):  # ... then 10 a minute
        progress = run.observe(60 * minute, consumed=450 + 10 * (minute - 9))
    # 560 consumed; the average since the start (28/min) would say 16 min, the last 10 minutes (10/min) say 44 min.
    assert progress["groupsConsumed"] == 560
    assert progress["estimatedRemainingSeconds"] == 44 * 60


def test_the_trainer_status_is_kubeflow_trainers_view_of_the_progress():
    """status.trainerStatus has exactly KEP-2779's fields and shape: integers, name/value strings, a timestamp."""
    run = Run()
    for minute in range(5):
        progress = run.observe(60 * minute, consumed=100 * minute, trained=90 * minute)
    trainer = run.status["trainerStatus"]
    assert set(trainer) == {"progressPercentage", "estimatedRemainingSeconds", "metrics", "lastUpdatedTime"}
    assert trainer["progressPercentage"] == progress["progressPercentage"] == 40
    assert trainer["estimatedRemainingSeconds"] == progress["estimatedRemainingSeconds"] == 360
    assert trainer["lastUpdatedTime"] == progress["lastUpdatedTime"]
    assert [m["name"] for m in trainer["metrics"]] == ["currentEpoch", "totalEpochs", "globalStep", "groupsConsumed",
                                                        "groupsTotal", "groupsTrained", "groupsDropped"]
    values = {m["name"]: m["value"] for m in trainer["metrics"]}
    assert values["groupsConsumed"] == "400" and values["groupsTrained"] == "360" and values["totalEpochs"] == "1"


def test_trainer_metrics_are_finite_short_strings_whatever_the_learner_sends():
    status = eta.trainer_status(_Progress(epochs=1.7e308, reward_mean=float("nan"), masked_fraction=0.123456789,
                                          estimated_remaining_seconds=2**63 - 1, global_step=2**63 - 1))
    values = {m.name: m.value for m in status.metrics}
    assert "rewardMean" not in values  # NaN is no value a dashboard can plot
    assert values["totalEpochs"] == "1.7e+308" and values["maskedFraction"] == "0.123457"
    assert values["globalStep"] == str(2**63 - 1) and all(len(v) < 64 for v in values.values())
    assert status.estimated_remaining_seconds == 2**31 - 1  # KEP-2779's int32


class _Progress:
    def __init__(self, **fields: Any):
        defaults = {"epoch": 0, "epochs": 1.0, "global_step": 0, "groups_consumed": 0, "groups_total": 0,
                    "groups_trained": 0, "groups_dropped": 0, "reward_mean": None, "masked_fraction": None,
                    "progress_percentage": None, "estimated_remaining_seconds": None, "last_updated_time": None}
        self.__dict__.update({**defaults, **fields})


def test_a_stall_clears_the_estimate():
    run = Run()
    for minute in range(3):
        progress = run.observe(60 * minute, consumed=100 * minute)
    assert progress["estimatedRemainingSeconds"] == 800 * 60 // 100
    # Groups keep being consumed but none trains: once the window holds no trained group there is no estimate.
    for minute in range(3, 15):
        progress = run.observe(60 * minute, consumed=200 + 10 * (minute - 2), trained=200)
    assert "estimatedRemainingSeconds" not in progress
    assert printer_columns({"status": run.status})["ETA"] is None


def test_the_stalled_condition_clears_the_estimate_at_once():
    run = Run()
    run.observe(0, consumed=100)
    progress = run.observe(60, consumed=200)
    assert progress["estimatedRemainingSeconds"] == 800 * 60 // 100
    stalled = report(groupsTotal=TOTAL, groupsConsumed=205, groupsTrained=200, stallStreak=5, stallLimit=5,
                     stalled=True, stallCause="streak")
    status = step(run.spec, run.status, running_pods(), stalled, now=at(70)).status
    assert "estimatedRemainingSeconds" not in status["progress"]


def test_the_update_time_moves_only_with_the_counts():
    run = Run()
    run.observe(0, consumed=10)
    run.observe(60, consumed=20)
    assert run.observe(90, consumed=20)["lastUpdatedTime"] == "2026-01-01T12:01:00Z"


def test_samples_stay_within_the_window_and_spaced():
    samples: list[eta.RateSample] = []
    for second in range(0, 3601, 5):
        samples = eta.record(samples, second, second, at(second))
    assert len(samples) == eta.WINDOW_SECONDS / eta.SAMPLE_SPACING_SECONDS + 1


def test_the_local_bar_shows_the_estimate():
    fields = bar_fields({"phase": "Running", "progress": {"groupsTotal": 10, "groupsConsumed": 5,
                                                           "estimatedRemainingSeconds": 3725}})
    assert fields["eta"] == "1h02m"
    assert bar_fields({})["eta"] == "-"
    assert [eta.format_duration(s) for s in (None, 42, 307)] == ["-", "42s", "5m07s"]
