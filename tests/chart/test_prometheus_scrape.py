"""A real Prometheus (Debian's 2.42, loopback only, temporary storage) scrapes a real learner exporter and an
operator metrics endpoint, evaluates the chart's alert rules on what it scraped, and answers queries for the stalled
series through its HTTP API.

- Learner: grpo_trainer.learner.exporter.ProgressServer serving a real ProgressReport set to a stalled state.
- Operator: the real grpo_operator.cluster.operator_metrics.OperatorMetrics fed a stalled run's status (the shape the
  operator writes), served by prometheus_client's HTTP server as OperatorMetrics.serve does (started here directly
  so the test can stop it). The scrape job name mirrors the ServiceMonitor's, which GRPOOperatorDown matches.
- The learner job attaches namespace/run as static labels, as the chart's PodMonitor relabeling does.
"""

from __future__ import annotations

import json
import shutil

import pytest
from prometheus_client import start_http_server

from grpo_operator import metric_names as op
from grpo_operator.cluster.operator_metrics import OperatorMetrics
from grpo_trainer.contract.codes import LearnerPhase
from grpo_trainer.contract.metrics import (
    METRIC_GROUPS_DROPPED,
    METRIC_GROUPS_TRAINED,
    METRIC_STALL_LIMIT,
    METRIC_STALL_STREAK,
    METRIC_STALLED,
)
from grpo_trainer.contract.report import ProgressReport
from grpo_trainer.learner.exporter import ProgressServer, StepMetrics
from tests.support.chart_render import CHART_DIR
from tests.support.servers.prometheus_harness import Prometheus

pytestmark = pytest.mark.slow

NAMESPACE, RUN = "ml", "stuck"
STALL_LIMIT = 32
DASHBOARD = json.loads((CHART_DIR / "files" / "dashboard.json").read_text())


class LearnerState:
    """What the learner's report function returns; the test flips it between stalled and recovered."""

    def __init__(self):
        self.report = ProgressReport(
            phase=LearnerPhase.STALLED,
            groups_total=128, groups_consumed=40, groups_trained=8,
            dropped={"no_signal": STALL_LIMIT}, epochs=1, stall_streak=STALL_LIMIT, stall_limit=STALL_LIMIT,
            global_step=2, last_trained_time=1_700_000_000.0, reward_mean=0.25,
            message=f"{STALL_LIMIT} groups in a row consumed without training",
        )


def _run_status(stalled: bool) -> dict:
    """A Running run's status as the operator writes it, with the Stalled condition set or cleared."""
    return {
        "phase": "Running",
        "lastProgressTime": "2026-01-01T00:00:00Z",
        "conditions": [{
            "type": "Stalled", "status": "True" if stalled else "False",
            "reason": "StallStreak" if stalled else "Progressing", "lastTransitionTime": "2026-01-01T00:10:00Z",
        }],
        "progress": {
            "epoch": 0, "epochs": 1, "groupsConsumed": 40, "groupsTotal": 128, "groupsTrained": 8,
            "groupsDropped": STALL_LIMIT, "dropped": {"no_signal": STALL_LIMIT},
            "stallStreak": STALL_LIMIT if stalled else 0, "stallLimit": STALL_LIMIT,
        },
        "rollout": {"replicas": 1, "ready": 1},
    }


def _observe(metrics: OperatorMetrics, stalled: bool) -> None:
    metrics.observe_run(NAMESPACE, RUN, "tiny-model", 1800, _run_status(stalled))


@pytest.fixture
def stack(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`; `make setup-apt`)")
    state = LearnerState()
    step_metrics = StepMetrics()
    step_metrics.record({"loss": 0.5, "entropy": 1.25, "kl": 0.01, "clip_ratio/low_mean": 0.0,
                         "clip_ratio/high_mean": 0.125, "clip_ratio/region_mean": 0.125, "learning_rate": 1e-6,
                         "grad_norm": float("nan"), "completions/mean_length": 20.0, "completions/max_length": 64.0,
                         "sample/staleness_mean": 0.5, "sample/staleness_max": 1.0})
    learner = ProgressServer(lambda: state.report, port=0, host="127.0.0.1", step_metrics=step_metrics).start()
    metrics = OperatorMetrics()
    _observe(metrics, stalled=True)
    operator_server, operator_thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    operator_address = f"127.0.0.1:{operator_server.server_address[1]}"
    prometheus = Prometheus(binary, tmp_path, {
        "grpo-operator-metrics": (operator_address, {}),
        "grpo-learner": (f"127.0.0.1:{learner.port}", {"namespace": NAMESPACE, "run": RUN}),
    })
    try:
        prometheus.wait_ready()
        yield prometheus, state, metrics
    finally:
        prometheus.stop()
        operator_server.shutdown()
        operator_server.server_close()
        operator_thread.join(timeout=5)
        learner.stop()


def _values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def test_prometheus_scrapes_the_stalled_run_and_alerts(stack):
    prometheus, state, metrics = stack
    selector = f'namespace="{NAMESPACE}", run="{RUN}"'
    has_samples = bool

    up = prometheus.wait_for('up{job=~"grpo-.*"}', lambda r: len(r) == 2 and _values(r) == [1.0, 1.0])
    assert {s["metric"]["job"] for s in up} == {"grpo-operator-metrics", "grpo-learner"}

    assert _values(prometheus.wait_for(f"{METRIC_STALLED}{{{selector}}}", has_samples)) == [1.0]
    assert _values(prometheus.query(f"{METRIC_STALL_STREAK}{{{selector}}}")) == [STALL_LIMIT]
    assert _values(prometheus.query(f"{METRIC_STALL_LIMIT}{{{selector}}}")) == [STALL_LIMIT]
    dropped = f'{METRIC_GROUPS_DROPPED}{{{selector}, reason="no_signal"}}'
    assert _values(prometheus.query(dropped)) == [STALL_LIMIT]
    assert _values(prometheus.query(f"{METRIC_GROUPS_TRAINED}{{{selector}}}")) == [8]
    assert _values(prometheus.wait_for(f"{op.RUN_STALLED}{{{selector}}}", has_samples)) == [1.0]
    assert _values(prometheus.query(f"{op.RUN_STALL_STREAK}{{{selector}}}")) == [STALL_LIMIT]
    assert _values(prometheus.query(f'{op.RUN_PHASE}{{{selector}, phase="Running"}}')) == [1.0]

    # The chart's alert rule, evaluated by Prometheus on the scraped series: pending now, firing after its `for`.
    pending = prometheus.wait_for(
        f'ALERTS{{alertname="GRPORunStalled", {selector}}}', has_samples, timeout=30)
    assert pending[0]["metric"]["alertstate"] == "pending" and pending[0]["metric"]["severity"] == "critical"

    # Every dashboard query runs on the real series; the per-run stall panel finds this run.
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            prometheus.query(target["expr"].replace("$namespace", NAMESPACE).replace("$run", RUN))
    streak_panel = next(p for p in DASHBOARD["panels"] if p["title"] == "Stall streak vs limit")
    for target in streak_panel["targets"]:
        expr = target["expr"].replace("$namespace", NAMESPACE).replace("$run", RUN)
        assert _values(prometheus.query(expr)) == [STALL_LIMIT]

    # The training-curve panels read the learner's step gauges: clip ratio one series per bound.
    clip_panel = next(p for p in DASHBOARD["panels"] if p["title"] == "Clip ratio by bound")
    clips = prometheus.query(clip_panel["targets"][0]["expr"].replace("$namespace", NAMESPACE).replace("$run", RUN))
    assert {s["metric"]["bound"]: float(s["value"][1]) for s in clips} == {"low": 0.0, "high": 0.125, "region": 0.125}

    # Progress resumes: the learner trains again, the operator clears Stalled, the alert goes away.
    state.report = state.report.model_copy(update={
        "phase": LearnerPhase.RUNNING, "stall_streak": 0, "groups_trained": 9, "groups_consumed": 41})
    _observe(metrics, stalled=False)
    prometheus.wait_for(f"{METRIC_STALLED}{{{selector}}} == 0", has_samples)
    prometheus.wait_for(f'ALERTS{{alertname="GRPORunStalled", {selector}}}', lambda r: not r, timeout=30)
    assert _values(prometheus.query(f"{METRIC_GROUPS_TRAINED}{{{selector}}}")) == [9]
