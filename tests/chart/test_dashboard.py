"""The Grafana dashboard: well-formed dashboard JSON, templated by namespace and run, every query valid PromQL
(parsed by promtool) that reads only metrics the project exports."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from grpo_operator import metric_names as op
from grpo_trainer.contract.metrics import (
    METRIC_ENVIRONMENT_FAILURES,
    METRIC_EPISODES,
    METRIC_REWARD_MEAN,
    METRIC_STEP_CLIP_RATIO,
    METRIC_TOOL_CALLS,
    METRIC_TOOL_FAILURES,
    STEP_METRIC_NAMES,
)
from tests.support.chart_render import CHART_DIR
from tests.support.promql_names import metric_names_in, unknown_metrics

DASHBOARD = json.loads((CHART_DIR / "files" / "dashboard.json").read_text())
PANEL_TYPES = {"timeseries", "stat", "bargauge", "state-timeline", "gauge", "table", "text", "row"}
# Cluster-level panels (the operator's own reconcile loop) are the only ones not filtered by run.
UNFILTERED_METRICS = {f"{op.RECONCILE_SECONDS}_bucket", op.RECONCILE_ERRORS}


def _targets():
    return [(panel, target) for panel in DASHBOARD["panels"] for target in panel.get("targets", [])]


def _variable_queries():
    return [v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]


def test_dashboard_is_grafana_dashboard_json():
    assert isinstance(DASHBOARD["schemaVersion"], int) and DASHBOARD["schemaVersion"] >= 36
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for panel in DASHBOARD["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_dashboard_is_templated_by_namespace_and_run():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["type"] == variables["run"]["type"] == "query"
    assert "$namespace" in variables["run"]["query"]["query"]  # run choices follow the namespace
    for panel, target in _targets():
        if metric_names_in(target["expr"]) <= UNFILTERED_METRICS:
            continue
        assert 'namespace=~"$namespace"' in target["expr"] and 'run=~"$run"' in target["expr"], panel["title"]


def test_every_query_names_only_exported_metrics():
    for panel, target in _targets():
        assert not unknown_metrics(target["expr"]), (panel["title"], unknown_metrics(target["expr"]))
    for query in _variable_queries():
        assert not unknown_metrics(query), query


def test_metric_check_catches_a_typo():
    typo = "grpo_learner_groups_traind_total"
    assert unknown_metrics(f'rate({typo}{{run=~"$run"}}[5m])') == {typo}
    with pytest.raises(ValueError, match="unknown PromQL function"):
        metric_names_in("rat(grpo_learner_groups_trained_total[5m])")


def test_dashboard_shows_what_on_call_needs():
    read = set().union(*(metric_names_in(target["expr"]) for _, target in _targets()))
    for needed in (
        op.RUN_EPOCH, op.RUN_GROUPS_CONSUMED, op.RUN_GROUPS_TRAINED, op.RUN_GROUPS_DROPPED, op.RUN_STALL_STREAK,
        op.RUN_STALL_LIMIT, op.RUN_PHASE, op.RUN_ROLLOUT_READY, op.RUN_ROLLOUT_REPLICAS, op.RUN_STALLED,
        op.RUN_ESTIMATED_REMAINING, METRIC_REWARD_MEAN,
    ):
        assert needed in read, f"no panel shows {needed}"
    timelines = [p for p in DASHBOARD["panels"] if p["type"] == "state-timeline"]
    assert any(op.RUN_PHASE in metric_names_in(t["expr"]) for p in timelines for t in p["targets"])
    drops = [t for _, t in _targets() if op.RUN_GROUPS_DROPPED in metric_names_in(t["expr"])]
    assert any("reason" in t["expr"] and "{{reason}}" in t["legendFormat"] for t in drops)


def test_dashboard_shows_the_training_curves():
    """Every step curve the learner exports from TRL's logs has a panel; clip ratio per bound."""
    read = set().union(*(metric_names_in(target["expr"]) for _, target in _targets()))
    missing = set(STEP_METRIC_NAMES) - read
    assert not missing, f"no panel shows {sorted(missing)}"
    clips = [t for _, t in _targets() if METRIC_STEP_CLIP_RATIO in metric_names_in(t["expr"])]
    assert clips and all("{{bound}}" in t["legendFormat"] for t in clips)


def test_every_query_is_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`): PromQL syntax unchecked here")
    exprs = [target["expr"] for _, target in _targets()]
    # Grafana substitutes its variables before Prometheus sees the query; "All" becomes `.*`.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$namespace", ".*").replace("$run", ".*")}
        for i, expr in enumerate(exprs)
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_phase_timeline_colours_every_phase_the_operator_exports():
    from grpo_operator.api import Phase

    timeline = next(p for p in DASHBOARD["panels"] if p["type"] == "state-timeline")
    coloured = {override["matcher"]["options"].removeprefix(".*: ").removesuffix("$")
                for override in timeline["fieldConfig"]["overrides"]}
    assert coloured == {phase.value for phase in Phase}


def test_dashboard_shows_tool_use_and_environment_failures_as_rates():
    """A tool-using run's episodes, tool calls, tool failures and environment failures (per environment), as rates:
    the learner's counters start from 0 in a restarted process, which rate() reads as a reset, not a drop."""
    reads = {name: [t for _, t in _targets() if name in metric_names_in(t["expr"])]
             for name in (METRIC_EPISODES, METRIC_TOOL_CALLS, METRIC_TOOL_FAILURES,
                          METRIC_ENVIRONMENT_FAILURES)}
    for name, targets in reads.items():
        assert targets, f"no panel shows {name}"
        assert all(f"rate({name}" in t["expr"] for t in targets), name
    failures = reads[METRIC_ENVIRONMENT_FAILURES]
    assert all("environment" in t["expr"] and "{{environment}}" in t["legendFormat"] for t in failures)
