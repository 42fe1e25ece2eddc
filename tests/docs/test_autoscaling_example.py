"""docs/rollout.md's KEDA ScaledObject: it targets a GRPORun, reads only what the learner exports, and its query is
the share of time the learner waited (checked by promtool on a learner's counter)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from grpo_operator import api
from grpo_trainer.contract.metrics import METRIC_ROLLOUT_WAIT_SECONDS
from tests.support.paths import REPO
from tests.support.promql_names import unknown_metrics

ROLLOUT_DOC = REPO / "docs" / "rollout.md"


def scaled_object() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", ROLLOUT_DOC.read_text(), flags=re.S)
    found = [doc for doc in map(yaml.safe_load, blocks) if isinstance(doc, dict) and doc.get("kind") == "ScaledObject"]
    assert len(found) == 1, "docs/rollout.md shows one ScaledObject"
    return found[0]


def test_it_targets_the_grporun_through_its_scale_subresource_with_bounds():
    spec = scaled_object()["spec"]
    assert spec["scaleTargetRef"]["apiVersion"] == api.API_VERSION and spec["scaleTargetRef"]["kind"] == api.KIND
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert 0 < float(trigger["metadata"]["threshold"]) < 1  # a share of time


def test_its_query_reads_the_learners_wait_counter_only():
    query = scaled_object()["spec"]["triggers"][0]["metadata"]["query"]
    assert not unknown_metrics(query)
    assert METRIC_ROLLOUT_WAIT_SECONDS in query


def test_its_query_is_the_share_of_time_the_learner_waited(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; `make setup-apt`)")
    query = scaled_object()["spec"]["triggers"][0]["metadata"]["query"]
    labels = 'namespace="ml", run="my-run", role="learner", pod="my-run-learner-0"'
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            # 45 s of every minute waited, then a learner restart (the counter starts again at 0) and the same.
            "input_series": [{"series": f"{METRIC_ROLLOUT_WAIT_SECONDS}{{{labels}}}",
                              "values": "0+45x10 0+45x10"}],
            "promql_expr_test": [
                {"expr": query, "eval_time": "6m", "exp_samples": [{"labels": "{}", "value": 0.75}]},
                {"expr": query, "eval_time": "16m", "exp_samples": [{"labels": "{}", "value": 0.75}]},
            ],
        }],
    }
    path = tmp_path / "query.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
