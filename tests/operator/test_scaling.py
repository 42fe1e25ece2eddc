"""Live scales on the API emulator: an operator restarted in the middle of a drain, where the kube-apiserver suite
(tests/controlplane/test_scaling.py) cannot go, and servers scaled back while they drain (a scenario that keeps to
the methods both backends' `cluster` has)."""

from __future__ import annotations

import json

import pytest

from grpo_operator import builders
from tests.operator.test_lifecycle import _running
from tests.support.specs import minimal_spec

pytestmark = pytest.mark.slow

FILESYSTEM = {"weightSync": {"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}


def _report(cluster, learner, run: str, *states: str) -> None:
    """The learner reports servers 0.. in these states (`-`: that server has left its report)."""
    urls = builders.rollout_urls(run, cluster.namespace, len(states))
    learner.update(rollout=[{"replica": i, "url": urls[i], "ready": state == "serving", "state": state}
                            for i, state in enumerate(states) if state != "-"])


def test_a_drain_survives_an_operator_restart(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "restart", minimal_spec(rollout={"replicas": 2, **FILESYSTEM}))
    _report(cluster, learner, "restart", "serving", "serving")
    cluster.patch_spec("restart", {"rollout": {"replicas": 1}})
    _report(cluster, learner, "restart", "serving", "draining")
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
        "restart", cluster.namespace, 1)
    _report(cluster, learner, "restart", "serving", "-")
    cluster.wait_for(lambda: cluster.pod_names("restart", "rollout") == ["restart-rollout-0"],
                     what="the drained server's pod deleted")
    assert cluster.pods_ever_created("restart") == ["restart-learner-0", "restart-rollout-0", "restart-rollout-1"]


def _urls(cluster, run: str) -> list[str]:
    [config_map] = cluster.config_maps(run)
    return json.loads(config_map["data"]["run.json"])["rollout"]["urls"]


def test_servers_scaled_back_while_they_drain_serve_again(cluster, learner, progress_urls):
    """1 -> 3 -> 1 -> 3, the last scale before servers 1 and 2 have drained: their pods are kept (none is missing)
    and their URLs join the run config again, where the learner admits them again; no pod is created or deleted."""
    _running(cluster, learner, progress_urls, "back", minimal_spec(rollout={"replicas": 1, **FILESYSTEM}))
    _report(cluster, learner, "back", "serving")
    cluster.patch_spec("back", {"rollout": {"replicas": 3}})
    cluster.wait_for(lambda: len(cluster.pods("back", "rollout")) == 3, what="two more rollout pods")
    for pod in ("back-rollout-1", "back-rollout-2"):
        cluster.kubelet.run(pod)
    _report(cluster, learner, "back", "serving", "serving", "serving")
    cluster.wait_for(lambda: cluster.status("back")["rollout"]["ready"] == 3, what="3 rollout servers ready")

    cluster.patch_spec("back", {"rollout": {"replicas": 1}})
    cluster.wait_for(lambda: _urls(cluster, "back") == builders.rollout_urls("back", cluster.namespace, 1),
                     what="rollout.urls down to one server")
    _report(cluster, learner, "back", "serving", "draining", "draining")
    cluster.wait_for(lambda: [s.get("state") for s in cluster.status("back")["rollout"]["servers"]]
                     == ["serving", "draining", "draining"], what="the learner's drain in status")

    cluster.patch_spec("back", {"rollout": {"replicas": 3}})
    cluster.wait_for(lambda: _urls(cluster, "back") == builders.rollout_urls("back", cluster.namespace, 3),
                     what="the draining servers' URLs back in rollout.urls")
    _report(cluster, learner, "back", "serving", "joining", "serving")
    cluster.wait_for(lambda: [s.get("state") for s in cluster.status("back")["rollout"]["servers"]]
                     == ["serving", "joining", "serving"], what="the learner admitting them again")
    rollout = cluster.status("back")["rollout"]
    assert rollout["replicas"] == 3 and rollout["ready"] == 3
    assert not any(server.get("drainStartTime") for server in rollout["servers"])
    assert cluster.pods_ever_created("back") == ["back-learner-0", "back-rollout-0", "back-rollout-1",
                                                 "back-rollout-2"]
    assert "Drained" not in cluster.event_reasons("back")
