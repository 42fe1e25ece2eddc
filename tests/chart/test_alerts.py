"""The shipped alert rules: valid for Prometheus (`promtool check rules`), and unit-tested with `promtool test rules`
(tests/fixtures/alerts.test.yaml): each alert fires on a broken run, stays silent on a slow healthy one, and
resolves when the run recovers."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.chart_render import CHART_DIR, REPO
from tests.support.promql_names import unknown_metrics

ALERTS_FILE = CHART_DIR / "files" / "alerts.yaml"
ALERT_TESTS = REPO / "tests" / "fixtures" / "alerts.test.yaml"
EXPECTED_ALERTS = {"GRPORunStalled", "GRPORunNoProgress", "GRPORunRolloutNotReady", "GRPORunFailed", "GRPOOperatorDown",
                   "GRPORunRolloutAtMaxReplicas", "GRPORunEnvironmentFailing"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; `make setup-apt`)")
    return path


def _rules(text: str) -> list[dict]:
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def test_promtool_check_rules(promtool):
    result = subprocess.run([promtool, "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run([promtool, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_silent():
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    firing, silent = set(), set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
    names = {rule["alert"] for rule in _rules(ALERTS_FILE.read_text())}
    assert names == EXPECTED_ALERTS
    assert firing == names and silent == names


def test_alerts_name_only_exported_metrics_and_say_what_to_do():
    for rule in _rules(ALERTS_FILE.read_text()):
        assert not unknown_metrics(rule["expr"]), (rule["alert"], unknown_metrics(rule["expr"]))
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# Plausible mistakes the unit tests must catch, each as (what, original text, broken text).
MUTATIONS = [
    ("stalled fires without waiting", "        for: 2m\n", "        for: 0m\n"),
    ("no-progress measures age, not inactivity",
     "(time() - grpo_operator_run_last_progress_timestamp_seconds)\n",
     "(time() - 0 * grpo_operator_run_last_progress_timestamp_seconds)\n"),
    ("no-progress ignores the phase",
     '          and on (namespace, run) (grpo_operator_run_phase{phase="Running"} == 1)\n        for: 1m\n',
     "        for: 1m\n"),
    ("operator-down ignores a missing target", 'absent(up{job=~".*grpo-operator.*"}) or ', ""),
    ("at-max ignores whether the learner waits", "[5m])) > 0.2)\n", "[5m])) >= 0)\n"),
    ("environment-failing fires without waiting", "> 0.5\n        for: 5m\n", "> 0.5\n        for: 0m\n"),
    ("environment-failing fires on any failure", "> 0.5\n", "> 0\n"),
    ("environment-failing adds up the run's environments",
     "sum by (namespace, run, environment) (rate(grpo_learner_environment_failures_total",
     "sum by (namespace, run) (rate(grpo_learner_environment_failures_total"),
    ("at-max ignores the maximum", "  >= on (namespace, horizontalpodautoscaler)",
     "  <= on (namespace, horizontalpodautoscaler)"),
]


@pytest.mark.parametrize(("what", "original", "broken"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_unit_tests_catch_a_broken_rule(promtool, tmp_path: Path, what, original, broken):
    text = ALERTS_FILE.read_text()
    assert text.count(original) == 1, f"mutation {what!r} no longer applies to alerts.yaml"
    rules_dir = tmp_path / "charts" / "grpo-operator" / "files"
    rules_dir.mkdir(parents=True)
    (rules_dir / "alerts.yaml").write_text(text.replace(original, broken))
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    shutil.copy(ALERT_TESTS, tmp_path / "tests" / "fixtures" / "alerts.test.yaml")
    result = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "tests" / "fixtures" / "alerts.test.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0, f"promtool's unit tests pass although {what}"
