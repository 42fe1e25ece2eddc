"""A real Prometheus (Debian's 2.42, loopback only, temporary storage) scrapes a real learner exporter and an
operator metrics endpoint, evaluates the chart's alert rules on what it scraped, and answers queries for the stalled
series through its HTTP API.

- Learner: grpo_trainer.exporter.ProgressServer serving a real ProgressReport set to a stalled state.
- Operator: prometheus_client's own HTTP server with gauges named from grpo_operator.metric_names and the per-run
  labels it documents (grpo_operator.operator_metrics did not exist when this test was written; swap it in once it
  does). The scrape job name mirrors the ServiceMonitor's, which GRPOOperatorDown matches.
- The learner job attaches namespace/run as static labels, as the chart's PodMonitor relabeling does.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from chart_render import CHART_DIR
from grpo_operator import metric_names as op
from grpo_trainer import contract
from grpo_trainer.exporter import ProgressServer

pytestmark = pytest.mark.slow

NAMESPACE, RUN = "ml", "stuck"
STALL_LIMIT = 32
ALERTS_FILE = CHART_DIR / "files" / "alerts.yaml"
DASHBOARD = json.loads((CHART_DIR / "files" / "dashboard.json").read_text())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LearnerState:
    """What the learner's report function returns; the test flips it between stalled and recovered."""

    def __init__(self):
        self.report = contract.ProgressReport(
            phase=contract.LearnerPhase.STALLED,
            groups_total=128, groups_consumed=40, groups_trained=8,
            dropped={"no_signal": STALL_LIMIT}, epochs=1, stall_streak=STALL_LIMIT, stall_limit=STALL_LIMIT,
            global_step=2, last_trained_time=1_700_000_000.0, reward_mean=0.25,
            message=f"{STALL_LIMIT} groups in a row consumed without training",
        )


def _operator_registry() -> tuple[CollectorRegistry, dict[str, Gauge]]:
    registry = CollectorRegistry()
    labels = list(op.RUN_LABELS)
    gauges = {
        op.RUN_STALLED: Gauge(op.RUN_STALLED, "1 while Stalled", labels, registry=registry),
        op.RUN_PHASE: Gauge(op.RUN_PHASE, "current phase", [*labels, "phase"], registry=registry),
        op.RUN_STALL_STREAK: Gauge(op.RUN_STALL_STREAK, "stall streak", labels, registry=registry),
        op.RUN_STALL_LIMIT: Gauge(op.RUN_STALL_LIMIT, "stall limit", labels, registry=registry),
    }
    gauges[op.RUN_STALLED].labels(NAMESPACE, RUN).set(1)
    gauges[op.RUN_STALL_STREAK].labels(NAMESPACE, RUN).set(STALL_LIMIT)
    gauges[op.RUN_STALL_LIMIT].labels(NAMESPACE, RUN).set(STALL_LIMIT)
    for phase in ("Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed"):
        gauges[op.RUN_PHASE].labels(NAMESPACE, RUN, phase).set(1 if phase == "Running" else 0)
    return registry, gauges


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, tuple[str, dict[str, str]]]):
        self.port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS_FILE)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [address], "labels": labels}]}
                for job, (address, labels) in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.workdir = workdir

    def _get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict]:
        answer = self._get("/api/v1/query", query=expr)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, expr: str, predicate, timeout: float = 30) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr!r} never matched; last result {result}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def stack(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`; `make setup-apt`)")
    state = LearnerState()
    learner = ProgressServer(lambda: state.report, port=0, host="127.0.0.1").start()
    registry, gauges = _operator_registry()
    operator_server, operator_thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    operator_address = f"127.0.0.1:{operator_server.server_address[1]}"
    prometheus = Prometheus(binary, tmp_path, {
        "grpo-operator-metrics": (operator_address, {}),
        "grpo-learner": (f"127.0.0.1:{learner.port}", {"namespace": NAMESPACE, "run": RUN}),
    })
    try:
        prometheus.wait_ready()
        yield prometheus, state, gauges
    finally:
        prometheus.stop()
        operator_server.shutdown()
        operator_server.server_close()
        operator_thread.join(timeout=5)
        learner.stop()


def _values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def test_prometheus_scrapes_the_stalled_run_and_alerts(stack):
    prometheus, state, gauges = stack
    selector = f'namespace="{NAMESPACE}", run="{RUN}"'
    has_samples = bool

    up = prometheus.wait_for('up{job=~"grpo-.*"}', lambda r: len(r) == 2 and _values(r) == [1.0, 1.0])
    assert {s["metric"]["job"] for s in up} == {"grpo-operator-metrics", "grpo-learner"}

    assert _values(prometheus.wait_for(f"{contract.METRIC_STALLED}{{{selector}}}", has_samples)) == [1.0]
    assert _values(prometheus.query(f"{contract.METRIC_STALL_STREAK}{{{selector}}}")) == [STALL_LIMIT]
    assert _values(prometheus.query(f"{contract.METRIC_STALL_LIMIT}{{{selector}}}")) == [STALL_LIMIT]
    assert _values(prometheus.query(f'{contract.METRIC_GROUPS_DROPPED}{{{selector}, reason="no_signal"}}')) == [STALL_LIMIT]
    assert _values(prometheus.query(f"{contract.METRIC_GROUPS_TRAINED}{{{selector}}}")) == [8]
    assert _values(prometheus.wait_for(f"{op.RUN_STALLED}{{{selector}}}", has_samples)) == [1.0]

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
        assert _values(prometheus.query(target["expr"].replace("$namespace", NAMESPACE).replace("$run", RUN))) == [STALL_LIMIT]

    # Progress resumes: the learner trains again, the operator clears Stalled, the alert goes away.
    state.report = state.report.model_copy(update={
        "phase": contract.LearnerPhase.RUNNING, "stall_streak": 0, "groups_trained": 9, "groups_consumed": 41})
    gauges[op.RUN_STALLED].labels(NAMESPACE, RUN).set(0)
    prometheus.wait_for(f"{contract.METRIC_STALLED}{{{selector}}} == 0", has_samples)
    prometheus.wait_for(f'ALERTS{{alertname="GRPORunStalled", {selector}}}', lambda r: not r, timeout=30)
    assert _values(prometheus.query(f"{contract.METRIC_GROUPS_TRAINED}{{{selector}}}")) == [9]
