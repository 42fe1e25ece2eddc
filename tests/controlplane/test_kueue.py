"""The Kueue flow with the real Kueue manager (tests/support/kueue_manager.py) on the real kube-apiserver: a GRPORun
labelled with a LocalQueue gets the Workload the operator manages; it stays Suspended, with no pod, while its
ClusterQueue has no room; once the quota is raised Kueue admits the Workload, and the pods come and the run runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from grpo_operator import kueue
from tests.support.control_plane import Unavailable
from tests.support.control_plane_cluster import RealCluster, real_cluster
from tests.support.kube_emulator import ApiError
from tests.support.kueue_manager import KueueManager, kueue_binaries
from tests.support.specs import grporun, minimal_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
REQUESTS = {"requests": {"cpu": "1", "memory": "1Gi"}}


@pytest.fixture(scope="module")
def kueue_manager(control_plane, admin) -> Iterator[KueueManager]:
    try:
        bin_dir = kueue_binaries()
    except Unavailable as why:
        pytest.skip(f"no Kueue: {why}")
    manager = KueueManager(control_plane, admin, bin_dir)
    try:
        yield manager.start()
    finally:
        manager.stop()


@pytest.fixture()
def cluster(kueue_manager, control_plane, admin, operator_account, namespace, progress_urls,
            emulator_options) -> Iterator[RealCluster]:
    with real_cluster(control_plane, admin, operator_account, namespace, progress_urls, emulator_options) as real:
        yield real


def _quota(cpu: str) -> list[dict[str, Any]]:
    return [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": "default-flavor", "resources": [
        {"name": "cpu", "nominalQuota": cpu}, {"name": "memory", "nominalQuota": "64Gi"}]}]}]


def _conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions", [])}


def _workload(admin, path: str) -> dict[str, Any] | None:
    try:
        return admin.call("GET", path)
    except ApiError as error:
        if error.code == 404:
            return None
        raise


def test_a_queued_run_waits_for_kueue_to_admit_it_then_runs(cluster, learner, progress_urls):
    admin, namespace = cluster.client, cluster.namespace
    queue = f"{namespace}-cq"
    admin.call("POST", f"{KUEUE_API}/resourceflavors", json={
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}})
    admin.call("POST", f"{KUEUE_API}/clusterqueues", json={
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
        "spec": {"namespaceSelector": {}, "resourceGroups": _quota("1")}})
    admin.call("POST", f"{KUEUE_API}/namespaces/{namespace}/localqueues", json={
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": queue}})

    body = grporun("kq", minimal_spec(rollout={"resources": REQUESTS}, learner={"resources": REQUESTS}))
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    cluster.apply(body)
    workload_path = f"{KUEUE_API}/namespaces/{namespace}/workloads/{kueue.workload_name('kq')}"
    # Two pods of 1 CPU each against a quota of 1: Kueue sees the Workload and leaves it pending.
    pending = cluster.wait_for(lambda: (c := _conditions(_workload(admin, workload_path)).get("QuotaReserved"))
                               and c["status"] == "False" and c, what="Kueue's verdict on the Workload")
    assert "insufficient" in pending["message"].lower() or "couldn't" in pending["message"].lower(), pending
    cluster.wait_phase("kq", "Suspended")
    assert cluster.condition("kq", "Suspended")["reason"] == "WaitingForAdmission"
    assert cluster.pods_ever_created("kq") == []

    admin.call("PATCH", f"{KUEUE_API}/clusterqueues/{queue}", json={"spec": {"resourceGroups": _quota("4")}},
               headers={"Content-Type": "application/merge-patch+json"})
    cluster.wait_for(lambda: len(cluster.pods("kq")) == 2, timeout=30, what="the pods once Kueue admits the run")
    assert _conditions(_workload(admin, workload_path))["Admitted"]["status"] == "True"
    progress_urls["kq-learner-0"] = learner.url()
    cluster.bring_up("kq")
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase("kq", "Running")
    cluster.wait_event("kq", "WaitingForAdmission", "Resumed")
