"""A running run's rollout servers scaled with `kubectl scale` on the real kube-apiserver, the real kopf operator
logged in as the chart's ServiceAccount: the scale subresource, the run config's rollout.urls, the learner pod kept,
removed servers deleted only once the learner no longer reports them (or after the drain deadline).

The learner is a real ProgressServer serving the report each step needs (tests/support/emulator/operator_fixtures.py),
its servers' states as a learner watching rollout.urls reports them; the kubelet is the status writer of the lifecycle
suite.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from grpo_operator import builders
from tests.operator.test_lifecycle import _running
from tests.operator.test_scaling import test_servers_scaled_back_while_they_drain_serve_again  # noqa: F401
from tests.support.controlplane.control_plane_client import kubectl
from tests.support.controlplane.control_plane_cluster import RealCluster, real_cluster
from tests.support.emulator.kube_emulator import PODS
from tests.support.specs import minimal_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

#: Several servers need filesystem weight sync (NCCL serves one).
FILESYSTEM = {"weightSync": {"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}
#: A drain deadline of 5 s (request timeout) + 30 s (the pods' grace period).
QUICK_DRAIN = {"extraArgs": {"request_timeout": 5}}


@pytest.fixture()
def cluster(control_plane, admin, operator_account, namespace, progress_urls,
            emulator_options) -> Iterator[RealCluster]:
    with real_cluster(control_plane, admin, operator_account, namespace, progress_urls, emulator_options) as real:
        yield real


def _spec(replicas: int) -> dict[str, Any]:
    return minimal_spec(rollout={"replicas": replicas, **FILESYSTEM}, training=QUICK_DRAIN)


def _scale(cluster, run: str, replicas: int) -> None:
    kubectl(cluster.plane, cluster.plane.kubeconfig, "-n", cluster.namespace, "scale", f"grporun/{run}",
            f"--replicas={replicas}")


def _read_scale(cluster, run: str) -> dict[str, Any]:
    done = kubectl(cluster.plane, cluster.plane.kubeconfig, "-n", cluster.namespace, "get", f"grporun/{run}",
                   "--subresource=scale", "-o", "json")
    return json.loads(done.stdout)


def _urls(cluster, run: str) -> list[str]:
    [config_map] = cluster.config_maps(run)
    return json.loads(config_map["data"]["run.json"])["rollout"]["urls"]


def _report(cluster, learner, run: str, *states: str) -> None:
    """The learner reports servers 0.. in these states (`-`: that server has left its report)."""
    urls = builders.rollout_urls(run, cluster.namespace, len(states))
    learner.update(rollout=[{"replica": i, "url": urls[i], "ready": state == "serving", "state": state}
                            for i, state in enumerate(states) if state != "-"])


def _uid(cluster, run: str, role: str) -> list[str]:
    return [pod["metadata"]["uid"] for pod in cluster.pods(run, role)]


def test_kubectl_scale_up_adds_rollout_pods_and_keeps_the_learner_pod(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "up", _spec(1))
    _report(cluster, learner, "up", "serving")
    learner_uid = _uid(cluster, "up", "learner")
    assert _read_scale(cluster, "up")["status"] == {"replicas": 1, "selector": "grpo.dev/run=up,grpo.dev/role=rollout"}

    _scale(cluster, "up", 3)
    cluster.wait_for(lambda: len(cluster.pods("up", "rollout")) == 3, what="two more rollout pods")
    assert _urls(cluster, "up") == builders.rollout_urls("up", cluster.namespace, 3)
    for pod in ("up-rollout-1", "up-rollout-2"):
        cluster.kubelet.run(pod)
    _report(cluster, learner, "up", "serving", "joining", "serving")
    cluster.wait_for(lambda: cluster.status("up")["rollout"]["ready"] == 3, what="3 rollout servers ready")
    status = cluster.status("up")
    assert status["phase"] == "Running" and status["restarts"] == 0
    assert _uid(cluster, "up", "learner") == learner_uid
    assert cluster.pods_ever_created("up") == ["up-learner-0", "up-rollout-0", "up-rollout-1", "up-rollout-2"]
    cluster.wait_for(lambda: [s.get("state") for s in cluster.status("up")["rollout"]["servers"]]
                     == ["serving", "joining", "serving"], what="the learner's view of each server")
    scale = _read_scale(cluster, "up")
    assert scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 3, "selector": "grpo.dev/run=up,grpo.dev/role=rollout"}
    # The selector selects exactly the rollout pods (what an HPA counts).
    selected = cluster.client.list(PODS, cluster.namespace, scale["status"]["selector"])
    assert sorted(p["metadata"]["name"] for p in selected) == ["up-rollout-0", "up-rollout-1", "up-rollout-2"]
    cluster.wait_event("up", "Scaled")


def test_kubectl_scale_down_deletes_each_server_once_the_learner_stops_reporting_it(cluster, learner,
                                                                                  progress_urls):
    _running(cluster, learner, progress_urls, "down", _spec(3))
    _report(cluster, learner, "down", "serving", "serving", "serving")
    learner_uid = _uid(cluster, "down", "learner")

    _scale(cluster, "down", 1)
    cluster.wait_for(lambda: _urls(cluster, "down") == builders.rollout_urls("down", cluster.namespace, 1),
                     what="rollout.urls down to one server")
    # The learner drains both: nothing is deleted while it reports them.
    _report(cluster, learner, "down", "serving", "draining", "draining")
    cluster.wait_for(lambda: [s.get("state") for s in cluster.status("down")["rollout"]["servers"]]
                     == ["serving", "draining", "draining"], what="the learner's drain in status")
    assert len(cluster.pods("down", "rollout")) == 3
    assert all(s.get("drainStartTime") for s in cluster.status("down")["rollout"]["servers"][1:])

    _report(cluster, learner, "down", "serving", "draining", "-")  # server 2 has drained
    cluster.wait_for(lambda: [p["metadata"]["name"] for p in cluster.pods("down", "rollout")]
                     == ["down-rollout-0", "down-rollout-1"], what="down-rollout-2 deleted")
    _report(cluster, learner, "down", "serving", "-", "-")
    cluster.wait_for(lambda: [p["metadata"]["name"] for p in cluster.pods("down", "rollout")] == ["down-rollout-0"],
                     what="down-rollout-1 deleted")
    cluster.wait_for(lambda: cluster.status("down")["rollout"]["replicas"] == 1, what="status replicas 1")
    status = cluster.status("down")
    assert status["phase"] == "Running" and status["restarts"] == 0 and status["rollout"]["restarts"] == 0
    assert [s["replica"] for s in status["rollout"]["servers"]] == [0]
    assert _uid(cluster, "down", "learner") == learner_uid
    assert _read_scale(cluster, "down")["status"]["replicas"] == 1
    cluster.wait_event("down", "Scaled", "Drained")
    assert "DrainDeadlineExceeded" not in cluster.event_reasons("down")


def test_a_server_the_learner_keeps_reporting_is_deleted_at_the_drain_deadline(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "stuck", _spec(2))
    _report(cluster, learner, "stuck", "serving", "serving")
    _scale(cluster, "stuck", 1)
    _report(cluster, learner, "stuck", "serving", "draining")  # a request that never finishes
    cluster.wait_for(lambda: (cluster.status("stuck")["rollout"]["servers"][-1].get("drainStartTime")),
                     what="the drain started")
    assert len(cluster.pods("stuck", "rollout")) == 2
    cluster.wait_for(lambda: len(cluster.pods("stuck", "rollout")) == 1, timeout=40,
                     what="stuck-rollout-1 deleted at the drain deadline")
    cluster.wait_event("stuck", "DrainDeadlineExceeded")
    [event] = [e for e in cluster.events("stuck") if e["reason"] == "DrainDeadlineExceeded"]
    assert event["type"] == "Warning"
    assert event["message"].startswith("stuck-rollout-1 left the rollout set 35 s ago (the drain deadline) and the "
                                       "learner still reports it draining")
    assert cluster.status("stuck")["phase"] == "Running"


def test_the_scale_subresource_keeps_the_rules_of_the_spec(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "rules", _spec(1))
    done = kubectl(cluster.plane, cluster.plane.kubeconfig, "-n", cluster.namespace, "scale", "grporun/rules",
                   "--replicas=0", check=False)
    assert done.returncode != 0 and "spec.rollout.replicas" in done.stderr
    nccl = minimal_spec()  # NCCL weight sync: one server
    cluster.apply({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": "nccl"}, "spec": nccl})
    done = kubectl(cluster.plane, cluster.plane.kubeconfig, "-n", cluster.namespace, "scale", "grporun/nccl",
                   "--replicas=2", check=False)
    assert done.returncode != 0 and "must be 1 with weightSync.mode nccl" in done.stderr
