"""The Kueue flow with the real Kueue manager (tests/support/controlplane/kueue_manager.py) on the real kube-apiserver:
a GRPORun labelled with a LocalQueue gets the Workload the operator manages; it stays Suspended, with no pod, while its
ClusterQueue has no room; once the quota is raised Kueue admits the Workload, and the pods come and the run runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from grpo_operator.cluster import kueue
from tests.support.controlplane.control_plane_client import kubectl
from tests.support.controlplane.control_plane_cluster import RealCluster, real_cluster
from tests.support.controlplane.kueue_manager import KueueManager
from tests.support.emulator.kube_emulator import GRPORUNS, ApiError
from tests.support.specs import MULTI_RANK_ROLLOUT, grporun, minimal_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
REQUESTS = {"requests": {"cpu": "1", "memory": "1Gi"}}


@pytest.fixture(scope="module")
def kueue_manager(control_plane, admin, kueue_binaries) -> Iterator[KueueManager]:
    manager = KueueManager(control_plane, admin, kueue_binaries)
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


def _queues(cluster, cpu: str) -> str:
    """A ResourceFlavor, a ClusterQueue of `cpu` CPUs for this test's namespace, and its LocalQueue `team`."""
    admin, namespace = cluster.client, cluster.namespace
    queue = f"{namespace}-cq"
    try:
        admin.call("POST", f"{KUEUE_API}/resourceflavors", json={
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}})
    except ApiError as error:
        if error.code != 409:
            raise
    admin.call("POST", f"{KUEUE_API}/clusterqueues", json={
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                 "resourceGroups": _quota(cpu)}})
    admin.call("POST", f"{KUEUE_API}/namespaces/{namespace}/localqueues", json={
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": queue}})
    return queue


def _queued_run(cluster, name: str, **spec: Any) -> str:
    """Apply a run queued to `team`; the path of its Workload."""
    body = grporun(name, minimal_spec(rollout={"resources": REQUESTS}, learner={"resources": REQUESTS}, **spec))
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    cluster.apply(body)
    return f"{KUEUE_API}/namespaces/{cluster.namespace}/workloads/{kueue.workload_name(name)}"


def _merge_patch(admin, path: str, patch: dict[str, Any]) -> None:
    admin.call("PATCH", path, json=patch, headers={"Content-Type": "application/merge-patch+json"})


def test_a_queued_run_waits_for_kueue_to_admit_it_then_runs(cluster, learner, progress_urls):
    admin = cluster.client
    queue = _queues(cluster, "2")
    game = {"name": "guess", "image": "game:1", "resources": REQUESTS}
    workload_path = _queued_run(cluster, "kq", environments=[game])
    # Three pods of 1 CPU each (a rollout server, the learner and the environment's server) against a quota of 2:
    # Kueue sees the Workload and leaves it pending. Without the environment's pod set it would fit.
    pending = cluster.wait_for(lambda: (c := _conditions(_workload(admin, workload_path)).get("QuotaReserved"))
                               and c["status"] == "False" and c, what="Kueue's verdict on the Workload")
    assert "insufficient" in pending["message"].lower() or "couldn't" in pending["message"].lower(), pending
    assert [s["name"] for s in _workload(admin, workload_path)["spec"]["podSets"]] == ["rollout", "learner",
                                                                                      "env-guess"]
    cluster.wait_phase("kq", "Suspended")
    assert cluster.condition("kq", "Suspended")["reason"] == "WaitingForAdmission"
    assert cluster.pods_ever_created("kq") == []

    _merge_patch(admin, f"{KUEUE_API}/clusterqueues/{queue}", {"spec": {"resourceGroups": _quota("4")}})
    cluster.wait_for(lambda: len(cluster.pods("kq")) == 3, timeout=30, what="the pods once Kueue admits the run")
    assert _conditions(_workload(admin, workload_path))["Admitted"]["status"] == "True"
    progress_urls["kq-learner-0"] = learner.url()
    cluster.bring_up("kq", pods=3)
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase("kq", "Running")
    cluster.wait_event("kq", "WaitingForAdmission", "Resumed")
    learner.update(phase="Succeeded", groups_consumed=40, groups_trained=40, epochs_done=1)
    cluster.kubelet.exit("kq-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("kq", "Succeeded")
    cluster.wait_for(lambda: _conditions(_workload(admin, workload_path)).get("Finished", {}).get("status") == "True",
                     what="the Workload marked Finished, so Kueue frees its quota")


def test_a_run_kueue_evicts_is_suspended_without_a_restart_and_resumes_when_readmitted(cluster, learner,
                                                                                      progress_urls):
    admin = cluster.client
    _queues(cluster, "4")
    workload_path = _queued_run(cluster, "ke")
    cluster.wait_for(lambda: len(cluster.pods("ke")) == 2, timeout=30, what="the pods once Kueue admits the run")
    progress_urls["ke-learner-0"] = learner.url()
    cluster.bring_up("ke")
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase("ke", "Running")

    _merge_patch(admin, workload_path, {"spec": {"active": False}})  # what `kueuectl stop workload` does
    cluster.wait_phase("ke", "Suspended")
    assert cluster.condition("ke", "Suspended")["reason"] == "Evicted"
    cluster.wait_for(lambda: cluster.pods("ke") == [], what="the pods deleted by the operator")
    released = cluster.wait_for(lambda: (c := _conditions(_workload(admin, workload_path)).get("QuotaReserved"))
                                and c["status"] == "False" and c, what="the quota given back to Kueue")
    assert released, released
    assert cluster.status("ke").get("restarts", 0) == 0

    _merge_patch(admin, workload_path, {"spec": {"active": True}})
    cluster.wait_for(lambda: len(cluster.pods("ke")) == 2, timeout=30, what="the pods once Kueue admits it again")
    cluster.bring_up("ke")
    cluster.wait_phase("ke", "Running")
    assert cluster.status("ke").get("restarts", 0) == 0
    cluster.wait_event("ke", "Evicted", "Resumed")


def test_an_admitted_run_that_fails_invalid_spec_gives_its_quota_back_to_the_next_run(cluster):
    admin = cluster.client
    _queues(cluster, "2")  # room for one run of two 1-CPU pods
    cluster.refuse_pod("kr-rollout-0", "the cluster's admission refuses this pod")  # 422 when Kueue admits it
    workload_path = _queued_run(cluster, "kr")
    cluster.wait_phase("kr", "Failed", timeout=30)
    failed = cluster.condition("kr", "Failed")
    assert failed["reason"] == "InvalidSpec" and "the cluster's admission refuses this pod" in failed["message"]
    finished = cluster.wait_for(lambda: (c := _conditions(_workload(admin, workload_path)).get("Finished"))
                                and c["status"] == "True" and c, what="the failed run's Workload marked Finished")
    assert finished["reason"] == "Failed", finished
    # Kueue gave the quota back: the next run in the queue is admitted and gets its pods.
    _queued_run(cluster, "kn")
    cluster.wait_for(lambda: len(cluster.pods("kn")) == 2, timeout=30, what="the next run admitted into the quota")


def test_a_run_whose_workload_kueue_refuses_as_invalid_fails_instead_of_waiting(cluster):
    """Kueue's webhook validates the Workload's pod templates (the run's pods): a malformed volume is refused there,
    before any admission, and the run fails InvalidSpec instead of waiting for a Kueue that is installed."""
    _queues(cluster, "2")
    spec = minimal_spec(rollout={"resources": REQUESTS}, learner={"resources": REQUESTS},
                        checkpoint={"volume": {"persistentVolumeClaim": {"claimNmae": "typo"}}})
    body = grporun("kw", spec)
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    cluster.apply(body)
    status = cluster.wait_phase("kw", "Failed", timeout=30)
    assert status["failure"]["reason"] == "InvalidSpec"
    message = cluster.condition("kw", "Failed")["message"]
    assert message.startswith('the Kueue Workload grporun-kw was rejected: Workload.kueue.x-k8s.io "grporun-kw" is '
                              "invalid"), message
    assert "persistentVolumeClaim.claimName: Required value" in message
    assert cluster.pods_ever_created("kw") == []


RACK = "topology.example.com/rack"
HOSTNAME = "kubernetes.io/hostname"


def _tas_nodes(admin, namespace: str) -> list[str]:
    """Three Ready nodes of 4 CPUs in the test's pool: two in rack a, one in rack b (no kubelet: nothing runs)."""
    names = []
    for index, rack in enumerate(("a", "a", "b")):
        name = f"{namespace}-node-{index}"
        labels = {"topology.example.com/pool": namespace, RACK: f"{namespace}-{rack}", HOSTNAME: name}
        admin.call("POST", "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node",
                                                   "metadata": {"name": name, "labels": labels}})
        names.append(name)
        capacity = {"cpu": "4", "memory": "8Gi", "pods": "110"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}
        admin.call("PATCH", f"/api/v1/nodes/{name}/status", json={
            "status": {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}},
            headers={"Content-Type": "application/merge-patch+json"})
        # The API server's admission taints a new node not-ready; no node controller runs here to lift it.
        admin.call("PATCH", f"/api/v1/nodes/{name}", json={"spec": {"taints": None}},
                   headers={"Content-Type": "application/merge-patch+json"})
    return names


def test_a_roles_topology_request_reaches_kueue_which_places_its_pods_in_one_domain(cluster):
    """spec.learner.topology.required = rack: the Workload's learner pod set carries it, the real Kueue (a Topology,
    a ResourceFlavor naming it, Ready nodes in two racks) admits it into one rack, and its TopologyUngater gives the
    run's gated learner pods that rack's node labels."""
    admin, namespace = cluster.client, cluster.namespace
    topology, flavor, queue = f"{namespace}-topo", f"{namespace}-tas", f"{namespace}-tas-cq"
    nodes = _tas_nodes(admin, namespace)
    created = [f"{KUEUE_API}/topologies/{topology}", f"{KUEUE_API}/resourceflavors/{flavor}",
               f"{KUEUE_API}/clusterqueues/{queue}"]
    try:
        admin.call("POST", f"{KUEUE_API}/topologies", json={
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": topology},
            "spec": {"levels": [{"nodeLabel": RACK}, {"nodeLabel": HOSTNAME}]}})
        admin.call("POST", f"{KUEUE_API}/resourceflavors", json={
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor},
            "spec": {"nodeLabels": {"topology.example.com/pool": namespace}, "topologyName": topology}})
        admin.call("POST", f"{KUEUE_API}/clusterqueues", json={
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                     "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": flavor,
                                         "resources": [{"name": "cpu", "nominalQuota": "12"},
                                                       {"name": "memory", "nominalQuota": "24Gi"}]}]}]}})
        admin.call("POST", f"{KUEUE_API}/namespaces/{namespace}/localqueues", json={
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "racks"},
            "spec": {"clusterQueue": queue}})
        # Two learner ranks of 3 CPUs: only rack a (two 4-CPU nodes) holds both, rack b (one) holds one.
        spec = minimal_spec(rollout={**MULTI_RANK_ROLLOUT, "resources": REQUESTS},
                            learner={"nodes": 2, "resources": {"requests": {"cpu": "3", "memory": "1Gi"}},
                                     "topology": {"required": RACK}})
        body = grporun("kt", spec)
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "racks"}
        cluster.apply(body)
        workload_path = f"{KUEUE_API}/namespaces/{namespace}/workloads/{kueue.workload_name('kt')}"
        workload = cluster.wait_for(lambda: _workload(admin, workload_path), what="the Workload")
        pod_sets = {s["name"]: s for s in workload["spec"]["podSets"]}
        assert pod_sets["learner"]["topologyRequest"]["required"] == RACK
        try:
            admitted = cluster.wait_for(
                lambda: (w := _workload(admin, workload_path)) and _conditions(w).get("Admitted", {}).get("status")
                == "True" and w, timeout=30, what="Kueue's admission into one rack")
        except AssertionError as error:
            raise AssertionError(f"{error}; Kueue says {_conditions(_workload(admin, workload_path))}") from None
        learner_assignment = next(a for a in admitted["status"]["admission"]["podSetAssignments"]
                                  if a["name"] == "learner")
        # Kueue names the lowest level's domains (the nodes); the rack is what chose them.
        assert learner_assignment["topologyAssignment"]["levels"] == [HOSTNAME], learner_assignment
        cluster.wait_for(lambda: len(cluster.pods("kt", "learner")) == 2, timeout=30, what="the learner pods")
        placed = cluster.wait_for(
            lambda: (pods := cluster.pods("kt", "learner")) and all(
                not p["spec"].get("schedulingGates") and HOSTNAME in p["spec"].get("nodeSelector", {}) for p in pods)
            and pods, timeout=30, what="Kueue's TopologyUngater placing the learner pods")
        assert {p["spec"]["nodeSelector"][HOSTNAME] for p in placed} == set(nodes[:2])  # both of rack a's nodes
    finally:
        cluster.client.request("DELETE", cluster.client.path(
            GRPORUNS, namespace, "kt")[len(cluster.client.url):])
        for path in reversed(created):
            admin.request("DELETE", path)
        for name in nodes:
            admin.request("DELETE", f"/api/v1/nodes/{name}")


def _counts(admin, path: str) -> tuple[dict[str, int], dict[str, int]]:
    """The Workload's pod set counts, and those its admission holds quota for (empty while it holds none)."""
    workload = _workload(admin, path) or {}
    return kueue.pod_set_counts(workload), kueue.admitted_counts(workload)


def test_a_run_never_has_more_pods_than_kueue_admitted_however_its_size_changes(cluster, learner, progress_urls):
    """Kueue v0.17 resizes no pod set of a Workload that holds quota. Scaled while queued, the Workload asks for the
    new size; scaled while admitted (`kubectl scale`), the run keeps the pods Kueue admitted and says why, and the
    size is admitted with the Workload after an eviction; sized up while suspended, admitted, it resumes at the
    admitted counts (docs/kueue.md, "Scaling")."""
    admin = cluster.client
    queue = _queues(cluster, "1")
    body = grporun("ks", minimal_spec(rollout={"resources": REQUESTS, "weightSync": {"mode": "filesystem"}},
                                      learner={"resources": REQUESTS}))
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team"}
    cluster.apply(body)
    path = f"{KUEUE_API}/namespaces/{cluster.namespace}/workloads/{kueue.workload_name('ks')}"
    scale = ("-n", cluster.namespace, "scale", "grporun/ks")

    # Queued (a quota of 1 CPU holds none of its 1-CPU pod sets): the Workload takes the new size before Kueue
    # admits it.
    cluster.wait_for(lambda: _workload(admin, path), what="the Workload")
    kubectl(cluster.plane, cluster.plane.kubeconfig, *scale, "--replicas=2")
    counts = cluster.wait_for(lambda: (c := _counts(admin, path))[0] == {"rollout": 2, "learner": 1} and c,
                              what="the queued Workload resized")
    assert counts[1] == {}, f"admitted at the old size before the resize: {counts}"
    _merge_patch(admin, f"{KUEUE_API}/clusterqueues/{queue}", {"spec": {"resourceGroups": _quota("4")}})
    cluster.wait_for(lambda: len(cluster.pods("ks")) == 3, timeout=30, what="the pods once Kueue admits the run")
    assert _counts(admin, path) == ({"rollout": 2, "learner": 1}, {"rollout": 2, "learner": 1})
    progress_urls["ks-learner-0"] = learner.url()
    cluster.bring_up("ks", pods=3)
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase("ks", "Running")

    # Admitted: refused, the Workload left alone.
    kubectl(cluster.plane, cluster.plane.kubeconfig, *scale, "--replicas=3")
    refused = cluster.wait_for(lambda: cluster.status("ks")["rollout"].get("scaleRefused"), what="the refusal")
    assert refused.startswith("spec.rollout.replicas: 3 is more than the 2 rollout pod(s) Kueue admitted"), refused
    cluster.wait_event("ks", "ScaleRefused")
    assert cluster.pod_names("ks", "rollout") == ["ks-rollout-0", "ks-rollout-1"]
    assert _counts(admin, path) == ({"rollout": 2, "learner": 1}, {"rollout": 2, "learner": 1})
    assert cluster.status("ks")["phase"] == "Running"

    # Evicted (deactivated): once the pods are gone and the quota given back, the Workload asks for 3, and Kueue
    # admits that when it is active again.
    _merge_patch(admin, path, {"spec": {"active": False}})
    cluster.wait_for(lambda: cluster.pods("ks") == [], what="the pods deleted by the operator")
    cluster.wait_for(lambda: _counts(admin, path) == ({"rollout": 3, "learner": 1}, {}),
                     what="the Workload resized once its quota is given back")
    _merge_patch(admin, path, {"spec": {"active": True}})
    cluster.wait_for(lambda: len(cluster.pods("ks")) == 4, timeout=30, what="the pods once Kueue admits it again")
    assert _counts(admin, path) == ({"rollout": 3, "learner": 1}, {"rollout": 3, "learner": 1})
    cluster.bring_up("ks", pods=4)
    cluster.wait_phase("ks", "Running")
    cluster.wait_for(lambda: "scaleRefused" not in cluster.status("ks")["rollout"], what="the refusal cleared")

    # Suspended while admitted, sized up, resumed: held to the admitted counts.
    cluster.patch_spec("ks", {"runPolicy": {"suspend": True}})
    cluster.wait_for(lambda: cluster.pods("ks") == [], what="the pods deleted on suspend")
    cluster.patch_spec("ks", {"rollout": {"replicas": 4}, "learner": {"nodes": 2}})
    cluster.patch_spec("ks", {"runPolicy": {"suspend": False}})
    refused = cluster.wait_for(lambda: (r := cluster.status("ks")["rollout"].get("scaleRefused")) and "4" in r and r,
                               what="the refusal")
    assert refused.startswith("spec.rollout.replicas: 4 is more than the 3 rollout pod(s) Kueue admitted; "
                              "spec.learner.nodes: 2 is more than the 1 learner pod(s) Kueue admitted"), refused
    cluster.wait_for(lambda: len(cluster.pods("ks")) == 4, what="the pods of the admitted counts")
    assert _counts(admin, path) == ({"rollout": 3, "learner": 1}, {"rollout": 3, "learner": 1})
    assert not {"ks-rollout-3", "ks-learner-1"} & set(cluster.pods_ever_created("ks")), "more pods than admitted"
