"""grpo_operator.cluster.operator_metrics: per-run series under the shared names, dropped when a run is deleted."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grpo_operator import metric_names
from grpo_operator.cluster.operator_metrics import OperatorMetrics


def test_metrics_use_the_shared_names_and_forget_a_deleted_run():
    metrics = OperatorMetrics()
    metrics.observe_run("ns", "r", "m", 1800, {
        "phase": "Running", "restarts": 2, "lastProgressTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Stalled", "status": "True", "reason": "x",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "progress": {"groupsTotal": 40, "groupsConsumed": 10, "groupsTrained": 8, "dropped": {"no_signal": 2},
                     "estimatedRemainingSeconds": 90},
        "rollout": {"replicas": 2, "ready": 1, "restarts": 3}})
    metrics.reconcile_errors.labels("lifecycle").inc()
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    exported = {name.removesuffix("_total") for name in metric_names.OPERATOR_METRIC_NAMES}
    assert exported <= set(families)
    get = metrics.registry.get_sample_value
    labels = {"namespace": "ns", "run": "r"}
    assert get(metric_names.RUN_PROGRESS_RATIO, labels) == 0.25
    assert get(metric_names.RUN_STALLED, labels) == 1 and get(metric_names.RUN_RESTARTS, labels) == 2
    assert get(metric_names.RUN_PHASE, {**labels, "phase": "Running"}) == 1
    assert get(metric_names.RUN_LAST_PROGRESS, labels) == 1767225600.0
    assert get(metric_names.RECONCILE_ERRORS, {"handler": "lifecycle"}) == 1
    assert get(metric_names.RUN_ESTIMATED_REMAINING, labels) == 90
    assert get(metric_names.RUN_ROLLOUT_RESTARTS, labels) == 3
    metrics.observe_run("ns", "r", "m", 1800, {"phase": "Running", "progress": {"groupsTotal": 40}})
    assert get(metric_names.RUN_ESTIMATED_REMAINING, labels) is None, "no estimate, no series"
    metrics.forget_run("ns", "r")
    text = generate_latest(metrics.registry).decode()
    assert 'run="r"' not in text


def test_the_replicas_series_counts_the_servers_wanted_not_those_still_draining():
    """After a scale-down the removed servers' pods stay until they drain: the not-ready alert compares ready
    servers with the servers wanted, so a drain never fires it."""
    metrics = OperatorMetrics()
    metrics.observe_run("ns", "r", "m", 1800, {"phase": "Running", "rollout": {"replicas": 3, "ready": 1}},
                        rollout_wanted=1)
    labels = {"namespace": "ns", "run": "r"}
    assert metrics.registry.get_sample_value(metric_names.RUN_ROLLOUT_REPLICAS, labels) == 1
    assert metrics.registry.get_sample_value(metric_names.RUN_ROLLOUT_READY, labels) == 1
