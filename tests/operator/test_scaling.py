"""A live scale on the API emulator, where the kube-apiserver suite (tests/controlplane/test_scaling.py) cannot go:
an operator restarted in the middle of a drain."""

from __future__ import annotations

import json

import pytest

from grpo_operator import builders
from tests.operator.test_lifecycle import _running
from tests.support.specs import NAMESPACE, minimal_spec

pytestmark = pytest.mark.slow

FILESYSTEM = {"weightSync": {"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}


def _report(learner, run: str, *states: str) -> None:
    urls = builders.rollout_urls(run, NAMESPACE, len(states))
    learner.update(rollout=[{"replica": i, "url": urls[i], "ready": state == "serving", "state": state}
                            for i, state in enumerate(states) if state != "-"])


def test_a_drain_survives_an_operator_restart(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "restart", minimal_spec(rollout={"replicas": 2, **FILESYSTEM}))
    _report(learner, "restart", "serving", "serving")
    cluster.patch_spec("restart", {"rollout": {"replicas": 1}})
    _report(learner, "restart", "serving", "draining")
    started = cluster.wait_for(lambda: cluster.status("restart")["rollout"]["servers"][-1].get("drainStartTime"),
                               what="the drain started")
    cluster.stop_operator()
    cluster.start_operator()
    cluster.wait_for(lambda: cluster.status("restart")["rollout"]["servers"][-1].get("state") == "draining",
                     what="the new operator reading the learner")
    assert cluster.pod_names("restart", "rollout") == ["restart-rollout-0", "restart-rollout-1"]
    assert cluster.status("restart")["rollout"]["servers"][-1]["drainStartTime"] == started  # the deadline holds
    [config_map] = cluster.config_maps("restart")
    assert json.loads(config_map["data"]["run.json"])["rollout"]["urls"] == builders.rollout_urls(
        "restart", NAMESPACE, 1)
    _report(learner, "restart", "serving", "-")
    cluster.wait_for(lambda: cluster.pod_names("restart", "rollout") == ["restart-rollout-0"],
                     what="the drained server's pod deleted")
    assert cluster.pods_ever_created("restart") == ["restart-learner-0", "restart-rollout-0", "restart-rollout-1"]
