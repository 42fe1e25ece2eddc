"""Kueue admission through a Workload the operator manages: the pure pieces, then the whole flow with the real kopf
operator against the API emulator, the test playing Kueue (it writes the Workload's admission and conditions as
Kueue's scheduler would)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

import pytest

from grpo_operator import builders, run_config_map
from grpo_operator.api import parse_spec
from grpo_operator.cluster import kueue
from grpo_operator.cluster.kube import APIClientError
from grpo_operator.run_ref import RunRef
from grpo_operator.status import ResizeWorkload, WorkloadObservation
from grpo_operator.status.admission import workload_actions
from tests.operator.test_lifecycle import _owner
from tests.support.emulator.kube_emulator import RESOURCE_FLAVORS, WORKLOADS
from tests.support.specs import NAMESPACE, grporun, minimal_spec

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
GPU = {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": "4", "memory": "16Gi"}}
TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
FLAVOR = {"apiVersion": kueue.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "h100"},
          "spec": {"nodeLabels": {"gpu.example.com/type": "h100"}, "tolerations": [TAINT]}}


def _condition(kind: str, status: str, reason: str = "Test", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


def admitted_status(flavor: str = "h100", *, rollout: int = 1, learner: int = 1) -> dict[str, Any]:
    """What Kueue's scheduler writes when it admits the run (`rollout` and `learner` pods)."""
    counts = {"rollout": rollout, "learner": learner}
    return {"admission": {"clusterQueue": "gpus", "podSetAssignments": [
                {"name": role, "count": counts[role], "flavors": {"nvidia.com/gpu": flavor, "cpu": flavor}}
                for role in ("rollout", "learner")]},
            "conditions": [_condition("QuotaReserved", "True", "QuotaReserved"), _condition("Admitted", "True"),
                           _condition("Evicted", "False", "QuotaReserved")]}


def evicted_status() -> dict[str, Any]:
    return {"conditions": [_condition("QuotaReserved", "True", "QuotaReserved"), _condition("Admitted", "True"),
                           _condition("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority "
                                      "Workload")]}


def queued_spec() -> dict[str, Any]:
    return minimal_spec(rollout={"resources": GPU}, learner={"resources": GPU,
                                                             "podTemplateOverride": {"spec": {
                                                                 "priorityClassName": "research"}}})


# --- pure ---------------------------------------------------------------------------------------------------------
def test_the_workload_holds_both_roles_with_their_requests_and_priority():
    spec = parse_spec(minimal_spec(rollout={"replicas": 2, "resources": GPU}, learner={
        "nodes": 3, "resources": GPU, "podTemplateOverride": {"spec": {"priorityClassName": "research"}}}))
    pods = builders.build_pods(RunRef("r", "ml", "uid-1"), spec, trainer_image="img")
    workload = kueue.build_workload(RunRef("r", "ml", "uid-1"), "team-q", pods)
    assert workload["metadata"]["name"] == "grporun-r" and workload["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert workload["spec"]["queueName"] == "team-q"
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [("rollout", 2), ("learner", 3)]
    for pod_set in workload["spec"]["podSets"]:
        assert pod_set["template"]["spec"]["containers"][0]["resources"] == GPU
    assert workload["spec"]["priorityClassName"] == "research"


GAME_CPU = {"requests": {"cpu": "2", "memory": "1Gi"}}


def test_environment_servers_take_quota_as_a_pod_set_of_their_own():
    """Environment servers are pods of the run: Kueue reserves quota for them too (a pod set per environment, its
    servers' count and requests), or the run would run pods no quota holds."""
    spec = parse_spec(minimal_spec(rollout={"resources": GPU}, environments=[
        {"name": "guess", "image": "game:1", "replicas": 3, "resources": GAME_CPU},
        {"name": "idle", "image": "game:1", "replicas": 0}]))
    run = RunRef("r", "ml", "uid-1")
    pods = builders.build_pods(run, spec, trainer_image="img") + builders.build_environment_pods(run, spec)
    workload = kueue.build_workload(run, "team-q", pods)
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [
        ("rollout", 1), ("learner", 1), ("env-guess", 3)]  # an environment without servers takes nothing
    game = workload["spec"]["podSets"][2]["template"]["spec"]["containers"][0]
    assert (game["image"], game["resources"]) == ("game:1", GAME_CPU)
    assert [kueue.pod_set_of(pod) for pod in pods] == ["rollout", "learner", "env-guess", "env-guess", "env-guess"]


def test_a_queued_run_with_more_environments_than_a_workload_holds_is_refused_naming_the_field():
    spec = parse_spec(minimal_spec(environments=[{"name": f"e{i}", "image": "game:1"} for i in range(7)]))
    run = RunRef("r", "ml", "uid-1")
    pods = builders.build_pods(run, spec, trainer_image="img") + builders.build_environment_pods(run, spec)
    with pytest.raises(kueue.TooManyPodSets, match=r"^spec.environments: a run queued in Kueue has at most 6 "
                                                   r"environments with servers, not 7 \(a Kueue Workload holds"):
        kueue.build_workload(run, "team-q", pods)


RACK = "topology.example.com/rack"
BLOCK = "topology.example.com/block"


def test_each_roles_topology_request_goes_into_its_pod_set():
    spec = parse_spec(minimal_spec(rollout={"resources": GPU, "topology": {"preferred": BLOCK}},
                                   learner={"nodes": 2, "resources": GPU, "topology": {"required": RACK}}))
    run = RunRef("r", "ml", "uid-1")
    workload = kueue.build_workload(run, "team-q", builders.build_pods(run, spec, trainer_image="img"),
                                    kueue.role_topologies(spec))
    requests = {s["name"]: s.get("topologyRequest") for s in workload["spec"]["podSets"]}
    assert requests == {"rollout": {"preferred": BLOCK}, "learner": {"required": RACK}}
    no_topology = parse_spec(minimal_spec())
    assert kueue.role_topologies(no_topology) == {}
    plain = kueue.build_workload(run, "q", builders.build_pods(run, no_topology, trainer_image="img"), {})
    assert all("topologyRequest" not in s for s in plain["spec"]["podSets"])


def test_a_pod_of_a_topology_role_waits_for_kueue_to_place_it():
    """What Kueue's TopologyUngater needs to find the pod and give it its domain's node labels."""
    spec = parse_spec(minimal_spec(learner={"topology": {"required": RACK}}))
    pod = next(p for p in builders.build_pods(RunRef("r", "ml", "uid-1"), spec, trainer_image="img")
               if p["metadata"]["labels"]["grpo.dev/role"] == "learner")
    gated = kueue.topology_gated(pod, "r", "learner", spec.learner.topology)
    assert gated["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/topology"}]
    assert gated["metadata"]["annotations"]["kueue.x-k8s.io/workload"] == "grporun-r"
    assert gated["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == RACK
    assert gated["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "learner"
    assert kueue.topology_gated(gated, "r", "learner", spec.learner.topology) == gated  # one gate, however often
    assert "schedulingGates" not in pod["spec"], "the built pod is not changed"


@pytest.mark.parametrize("status, state", [
    ({}, "pending"),
    ({"conditions": [_condition("QuotaReserved", "True")], "admission": {"podSetAssignments": []}}, "pending"),
    (admitted_status(), "admitted"),
    (evicted_status(), "evicted"),
])
def test_admission_state_of_a_workload(status, state):
    assert kueue.admission_of({"status": status}).state == state


def test_flavours_reach_the_pods_of_their_pod_set():
    labels, tolerations = kueue.placement([FLAVOR])
    pod = builders.build_pods(RunRef("r", "ml", "u"), parse_spec(minimal_spec(learner={
        "nodeSelector": {"zone": "a"}, "tolerations": [TAINT]})), trainer_image="img")[-1]
    placed = kueue.place(pod, labels, tolerations)
    assert placed["spec"]["nodeSelector"] == {"zone": "a", "gpu.example.com/type": "h100"}
    assert placed["spec"]["tolerations"] == [TAINT]
    assert pod["spec"]["nodeSelector"] == {"zone": "a"}, "the built pod is not changed"


def test_workload_status_is_written_in_the_version_the_server_prefers():
    # Kueue v0.17 refuses a v1beta1 status write to a Workload holding quota without a priority class (a CEL rule
    # reads a field its conversion from the stored v1beta2 leaves out); tests/controlplane/test_kueue.py meets it.
    group = {"kind": "APIGroup", "name": "kueue.x-k8s.io",
             "preferredVersion": {"groupVersion": "kueue.x-k8s.io/v1beta2", "version": "v1beta2"}}
    assert kueue.status_api_version(group) == "kueue.x-k8s.io/v1beta2"
    older = {**group, "preferredVersion": {"groupVersion": "kueue.x-k8s.io/v1beta1", "version": "v1beta1"}}
    assert kueue.status_api_version(older) == kueue.API_VERSION
    assert kueue.status_api_version(None) == kueue.API_VERSION  # discovery unavailable: the version it creates


def test_releasing_an_evicted_workload_clears_its_admission():
    released = kueue.released_status({"status": {**admitted_status(), **evicted_status()}}, NOW)
    assert released["admission"] is None
    kinds = {c["type"]: c["status"] for c in released["conditions"]}
    assert kinds == {"QuotaReserved": "False", "Admitted": "False", "Evicted": "True"}


def _admitted_workload(rollout: int, learner: int, *, assigned: dict[str, int] | None = None) -> dict[str, Any]:
    """A Workload whose pod sets hold `rollout` and `learner` pods, admitted (for `assigned`, else those counts)."""
    counts = {"rollout": rollout, "learner": learner}
    status = admitted_status()
    for assignment in status["admission"]["podSetAssignments"]:
        assignment["count"] = (assigned or counts)[assignment["name"]]
    return {"spec": {"podSets": [{"name": role, "count": count} for role, count in counts.items()]}, "status": status}


def test_the_admitted_counts_are_kueues_assignments():
    assert kueue.admitted_counts(_admitted_workload(3, 2)) == {"rollout": 3, "learner": 2}
    # Partial admission: Kueue assigns fewer pods than the pod set asks for, and only those hold quota.
    assert kueue.admitted_counts(_admitted_workload(3, 1, assigned={"rollout": 2, "learner": 1})) == {
        "rollout": 2, "learner": 1}
    without_counts = _admitted_workload(3, 1)
    for assignment in without_counts["status"]["admission"]["podSetAssignments"]:
        del assignment["count"]
    assert kueue.admitted_counts(without_counts) == {"rollout": 3, "learner": 1}
    assert kueue.admitted_counts({"spec": _admitted_workload(3, 1)["spec"], "status": {}}) == {}


def test_a_workload_is_resized_when_the_spec_asks_for_other_counts():
    workload = _admitted_workload(1, 1)
    assert not kueue.resized_pod_sets(workload, parse_spec(minimal_spec()))
    assert kueue.resized_pod_sets(workload, parse_spec(minimal_spec(rollout={"replicas": 3})))
    assert kueue.resized_pod_sets(workload, parse_spec(minimal_spec(learner={"nodes": 2})))


class _NoKueue:
    """A cluster without Kueue: the Workload kind is unknown to the API server."""

    async def read(self, *args: Any) -> None:
        return None

    async def create(self, obj: dict[str, Any]) -> bool:
        raise APIClientError({"message": "the server could not find the requested resource"}, status=404, headers={})


def test_a_cluster_without_kueue_keeps_the_run_waiting_and_says_why():
    spec, run = parse_spec(queued_spec()), RunRef("r", "ml", "u")
    refusal = asyncio.run(kueue.create(_NoKueue(), run, "team-q", spec, trainer_image="img"))
    gate, seen = asyncio.run(kueue.observe(_NoKueue(), run, "team-q", spec, create_error=refusal))
    assert seen == WorkloadObservation(exists=False)  # the next pass creates it again
    reason, message = gate.hold
    assert reason == "WaitingForAdmission"
    assert message == ("the Kueue Workload grporun-r was rejected: the server could not find the requested resource "
                       "(is Kueue installed?)")


class _KueueWith:
    """A cluster whose Workload is `workload`; records the operator's patches, refusing them with `refusal`."""

    def __init__(self, workload: dict[str, Any], refusal: APIClientError | None = None):
        self.workload, self.refusal, self.patches = workload, refusal, []
        self.logger = logging.getLogger("test")

    async def read(self, *args: Any) -> dict[str, Any]:
        return self.workload

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.patches.append((kind, name, patch))


def _gate(kube, spec: dict[str, Any]) -> kueue.Gate:
    """One pass's part in Kueue: the Workload observed (read only), then what status.admission decides done."""
    run, parsed = RunRef("r", "ml", "u"), parse_spec(spec)
    gate, seen = asyncio.run(kueue.observe(kube, run, "team-q", parsed))
    if workload_actions(seen, finished=False, pods_exist=False) == [ResizeWorkload()]:
        asyncio.run(kueue.resize(kube, run, "team-q", parsed, gate.workload, trainer_image="img"))
    return gate


def test_a_workload_that_holds_no_quota_is_resized_to_the_spec_if_it_has_not_changed_since_read():
    queued = {"metadata": {"resourceVersion": "7"}, "spec": _admitted_workload(1, 1)["spec"], "status": {}}
    kube = _KueueWith(queued)
    gate = _gate(kube, minimal_spec(rollout={"replicas": 3}))
    assert gate.hold[0] == "WaitingForAdmission" and gate.admitted == {}
    ((kind, name, patch),) = kube.patches
    assert (kind, name, patch["metadata"]) == ("Workload", "grporun-r", {"resourceVersion": "7"})
    assert [(s["name"], s["count"]) for s in patch["spec"]["podSets"]] == [("rollout", 3), ("learner", 1)]

    _gate(kube, minimal_spec())  # the counts it has: nothing to write
    assert len(kube.patches) == 1


def test_a_workload_that_holds_quota_is_not_resized_and_holds_the_run_to_its_admission():
    kube = _KueueWith({"metadata": {"resourceVersion": "7"}, **_admitted_workload(1, 1)})
    gate = _gate(kube, minimal_spec(rollout={"replicas": 3}))
    assert gate.hold is None and gate.admitted == {"rollout": 1, "learner": 1}
    assert kube.patches == []


def test_a_resize_kueue_refuses_is_tried_again_later():
    """Kueue reserved quota between the read and the write (its webhook refuses the pod sets' change), or the
    Workload changed (409): the run keeps waiting, and the next pass reads the Workload again."""
    queued = {"metadata": {"resourceVersion": "7"}, "spec": _admitted_workload(1, 1)["spec"], "status": {}}
    refusal = APIClientError({"message": "spec.podSets: field is immutable"}, status=422, headers={})
    gate = _gate(_KueueWith(queued, refusal), minimal_spec(rollout={"replicas": 3}))
    assert gate.hold[0] == "WaitingForAdmission"


# --- the flow -----------------------------------------------------------------------------------------------------
def _workload(cluster, name: str) -> dict[str, Any] | None:
    return cluster.client.get(WORKLOADS, NAMESPACE, kueue.workload_name(name))


def _kueue_writes(cluster, name: str, status: dict[str, Any]) -> None:
    cluster.client.patch(WORKLOADS, NAMESPACE, kueue.workload_name(name), {"status": status}, subresource="status")


def _queued(cluster, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    body = grporun(name, spec or queued_spec())
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-q"}
    return cluster.apply(body)


def _admitted_and_running(cluster, learner, progress_urls, name: str, spec: dict[str, Any] | None = None) -> None:
    """A queued run whose Workload Kueue admits, its pods up and its learner reporting: Running."""
    cluster.client.create(RESOURCE_FLAVORS, None, FLAVOR)
    _queued(cluster, name, spec)
    cluster.wait_for(lambda: _workload(cluster, name), what="the Workload")
    _kueue_writes(cluster, name, admitted_status())
    progress_urls[f"{name}-learner-0"] = learner.url()
    cluster.bring_up(name)
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase(name, "Running")


@pytest.mark.slow
def test_a_queued_run_waits_for_admission_then_runs_on_its_flavour(cluster, learner, progress_urls):
    cluster.client.create(RESOURCE_FLAVORS, None, FLAVOR)
    run = _queued(cluster, "kq")
    workload = cluster.wait_for(lambda: _workload(cluster, "kq"), what="the Workload")
    assert workload["metadata"]["ownerReferences"] == [_owner(run)]
    status = cluster.wait_phase("kq", "Suspended")
    assert cluster.condition("kq", "Suspended")["reason"] == "WaitingForAdmission"
    assert "startTime" not in status
    time.sleep(1.0)  # several operator passes (0.2 s apart): still no pod
    assert cluster.pods_ever_created("kq") == []
    # Scaled while queued: the Workload, which holds no quota yet, asks Kueue for the new size.
    cluster.patch_spec("kq", {"rollout": {"replicas": 2}})
    cluster.wait_for(lambda: kueue.pod_set_counts(_workload(cluster, "kq")) == {"rollout": 2, "learner": 1},
                     what="the Workload resized to the run's new size")

    _kueue_writes(cluster, "kq", admitted_status(rollout=2))
    cluster.wait_for(lambda: len(cluster.pods("kq")) == 3, what="pods once admitted")
    for pod in cluster.pods("kq"):
        assert pod["spec"]["nodeSelector"] == {"gpu.example.com/type": "h100"}, pod["metadata"]["name"]
        assert pod["spec"]["tolerations"] == [TAINT]
    progress_urls["kq-learner-0"] = learner.url()
    cluster.bring_up("kq", pods=3)
    learner.update(groups_consumed=4, groups_trained=4)
    cluster.wait_phase("kq", "Running")
    cluster.wait_event("kq", "WaitingForAdmission", "Resumed")


@pytest.mark.slow
def test_eviction_suspends_without_counting_a_restart_and_readmission_resumes(cluster, learner, progress_urls):
    _admitted_and_running(cluster, learner, progress_urls, "ke")

    _kueue_writes(cluster, "ke", evicted_status())
    cluster.wait_phase("ke", "Suspended")
    cluster.wait_for(lambda: cluster.pods("ke") == [], what="pods deleted on eviction")
    suspended = cluster.condition("ke", "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "Evicted")
    assert "Preempted to accommodate" in suspended["message"]
    # Once the pods are gone the quota goes back to Kueue, which queues the Workload again.
    cluster.wait_for(lambda: "admission" not in _workload(cluster, "ke")["status"], what="quota released")
    assert cluster.status("ke").get("restarts", 0) == 0
    assert cluster.status("ke")["progressClock"]["pausedSince"]  # the stall clock stops while evicted

    _kueue_writes(cluster, "ke", admitted_status())
    cluster.wait_for(lambda: len(cluster.pods("ke")) == 2, what="pods on re-admission")
    cluster.bring_up("ke")
    learner.update(groups_consumed=8, groups_trained=8)
    cluster.wait_phase("ke", "Running")
    assert cluster.status("ke").get("restarts", 0) == 0
    cluster.wait_event("ke", "Evicted", "Resumed")

    cluster.kubelet.exit("ke-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("ke", "Succeeded")
    finished = cluster.wait_for(lambda: next((c for c in _workload(cluster, "ke")["status"]["conditions"]
                                              if c["type"] == "Finished"), None), what="Workload Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")


def _workload_finished(cluster, name: str) -> dict[str, Any] | None:
    return next((c for c in (_workload(cluster, name) or {}).get("status", {}).get("conditions", [])
                 if c["type"] == "Finished" and c["status"] == "True"), None)


@pytest.mark.slow
def test_an_admitted_run_whose_pods_the_api_server_rejects_gives_its_quota_back(cluster):
    body = grporun("kr", {**queued_spec(), "checkpoint": {
        "volume": {"persistentVolumeClaim": {"claimNmae": "typo"}}}})
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-q"}
    cluster.apply(body)
    cluster.wait_for(lambda: _workload(cluster, "kr"), what="the Workload")
    _kueue_writes(cluster, "kr", admitted_status())
    cluster.wait_phase("kr", "Failed")
    assert cluster.condition("kr", "Failed")["reason"] == "InvalidSpec"
    finished = cluster.wait_for(lambda: _workload_finished(cluster, "kr"), what="the Workload marked Finished")
    assert finished["reason"] == "Failed" and "rejected by the API server" in finished["message"]


@pytest.mark.slow
def test_an_admitted_run_whose_spec_the_operator_cannot_run_gives_its_quota_back(cluster, learner, progress_urls):
    _admitted_and_running(cluster, learner, progress_urls, "ks")
    # A spec this operator cannot run (an older operator behind a newer CRD; the emulator checks no CRD rules).
    cluster.patch_spec("ks", {"training": {"epochs": 0}})
    cluster.wait_phase("ks", "Failed")
    assert cluster.condition("ks", "Failed")["message"].startswith("spec.training.epochs:")
    cluster.wait_for(lambda: cluster.pods("ks") == [], what="the pods deleted, as for any permanent failure")
    assert cluster.wait_for(lambda: _workload_finished(cluster, "ks"), what="the Workload marked Finished")


@pytest.mark.slow
def test_a_run_whose_workload_kueue_refuses_as_invalid_fails_instead_of_waiting(cluster):
    """Kueue validates the Workload's pod templates, which are the run's own pods: a 422 is the run's spec, not a
    missing Kueue, and no retry can change it."""
    refusal = ('Workload.kueue.x-k8s.io "grporun-kw" is invalid: spec.podSets[0].template.spec.volumes[4]'
               '.persistentVolumeClaim.claimName: Required value')
    cluster.emulator_thread.call(lambda: cluster.emulator.inject_fault("POST", "workloads", 422, "Invalid", refusal,
                                                                       times=1_000_000))
    _queued(cluster, "kw")
    status = cluster.wait_phase("kw", "Failed")
    assert status["failure"]["reason"] == "InvalidSpec"
    assert cluster.condition("kw", "Failed")["message"] == f"the Kueue Workload grporun-kw was rejected: {refusal}"
    assert cluster.pods_ever_created("kw") == []


def _scaled_queued_spec() -> dict[str, Any]:
    spec = queued_spec()
    spec["rollout"]["weightSync"] = {"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}
    return spec


def _sizes(cluster, name: str) -> tuple[list[str], list[str], int, int]:
    """The run's rollout and learner pods, and the rollout URLs and learner nodes its run config lists."""
    config = run_config_map.run_config_of(cluster.config_maps(name)[0])
    return (cluster.pod_names(name, "rollout"), cluster.pod_names(name, "learner"), len(config["rollout"]["urls"]),
            config["learner"]["nodes"])


@pytest.mark.slow
def test_a_run_never_has_more_pods_than_kueue_admitted_and_a_refused_size_waits_for_readmission(
        cluster, learner, progress_urls):
    """Kueue counts the pods in the Workload it admitted and resizes no pod set while it holds quota: a larger size
    is refused, whether it comes live or while the run is suspended, and the run keeps the admitted counts, saying
    so once; it takes effect when Kueue admits the run again, the Workload resized once its quota is given back
    (docs/kueue.md, "Scaling")."""
    _admitted_and_running(cluster, learner, progress_urls, "ks", _scaled_queued_spec())
    # The run config as the running pods leave it: their images recorded (RecordImages patches it once they report
    # them, which may come after Running: the comparison below saw it on a loaded machine).
    cluster.wait_for(lambda: set(run_config_map.images_of(cluster.config_maps("ks")[0]) or {}) == {"rollout",
                                                                                                   "learner"},
                     what="the pods' images recorded in the run config")
    config = cluster.config_maps("ks")[0]["data"]["run.json"]

    cluster.patch_spec("ks", {"rollout": {"replicas": 3}})
    refused = cluster.wait_for(lambda: cluster.status("ks")["rollout"].get("scaleRefused"), what="the refusal")
    assert refused.startswith("spec.rollout.replicas: 3 is more than the 1 rollout pod(s) Kueue admitted (Workload "
                              "grporun-ks); the run keeps the admitted count"), refused
    cluster.wait_event("ks", "ScaleRefused")
    time.sleep(1.0)  # several passes: still one server, the run config unchanged, the refusal posted once
    assert cluster.pod_names("ks", "rollout") == ["ks-rollout-0"]
    assert cluster.config_maps("ks")[0]["data"]["run.json"] == config
    assert cluster.event_reasons("ks").count("ScaleRefused") == 1
    assert cluster.status("ks")["phase"] == "Running"

    # Evicted: once the pods are gone the quota goes back, and the Workload then asks for the size refused.
    _kueue_writes(cluster, "ks", evicted_status())
    cluster.wait_for(lambda: cluster.pods("ks") == [], what="pods deleted on eviction")
    cluster.wait_for(lambda: kueue.pod_set_counts(_workload(cluster, "ks")) == {"rollout": 3, "learner": 1},
                     what="the Workload resized once its quota is given back")
    _kueue_writes(cluster, "ks", admitted_status(rollout=3))
    cluster.bring_up("ks", pods=4)
    cluster.wait_phase("ks", "Running")
    cluster.wait_for(lambda: "scaleRefused" not in cluster.status("ks")["rollout"], what="the refusal cleared")
    assert _sizes(cluster, "ks") == (["ks-rollout-0", "ks-rollout-1", "ks-rollout-2"], ["ks-learner-0"], 3, 1)

    # Suspended, sized up, resumed while the Workload still holds quota for 3 and 1: both roles are held to those.
    cluster.patch_spec("ks", {"runPolicy": {"suspend": True}})
    cluster.wait_for(lambda: cluster.pods("ks") == [], what="the pods deleted on suspend")
    cluster.patch_spec("ks", {"rollout": {"replicas": 4}, "learner": {"nodes": 2}})
    cluster.patch_spec("ks", {"runPolicy": {"suspend": False}})
    refused = cluster.wait_for(lambda: cluster.status("ks")["rollout"].get("scaleRefused"), what="the refusal")
    assert refused.startswith("spec.rollout.replicas: 4 is more than the 3 rollout pod(s) Kueue admitted; "
                              "spec.learner.nodes: 2 is more than the 1 learner pod(s) Kueue admitted"), refused
    cluster.bring_up("ks", pods=4)
    time.sleep(1.0)  # several passes: no fifth or sixth pod
    assert _sizes(cluster, "ks") == (["ks-rollout-0", "ks-rollout-1", "ks-rollout-2"], ["ks-learner-0"], 3, 1)
    assert kueue.pod_set_counts(_workload(cluster, "ks")) == {"rollout": 3, "learner": 1}, "admitted: not resized"

    cluster.patch_spec("ks", {"rollout": {"replicas": 3}, "learner": {"nodes": 1}})
    cluster.wait_for(lambda: "scaleRefused" not in cluster.status("ks")["rollout"], what="the refusal cleared")
