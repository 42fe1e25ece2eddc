"""Kueue admission of a GRPORun as one unit, through a Workload the operator manages (Kueue's integration for job
kinds it does not know: docs/kueue.md says why this and not plain-pod groups).

A run labelled `kueue.x-k8s.io/queue-name` gets a Workload with two pod sets, `rollout` and `learner`, whose
templates are the run's own pods (so Kueue counts their real requests); no pod exists until Kueue admits it. Admitted:
the pods are created with the node labels and tolerations of the ResourceFlavors Kueue assigned to their pod set.
Evicted (preempted, deactivated, ...): the run is held suspended, its pods deleted by the operator (so nothing counts
against `backoffLimit`), and once they are gone the Workload's quota reservation is released so Kueue requeues it;
re-admitted, the pods come back and the learner resumes from its checkpoint. Finished: the Workload is marked
Finished and Kueue frees the quota.

A run never has more pods of a role than Kueue admitted for its pod set (status.admission.within_admission): a size
changed while the Workload holds no quota (queued, or evicted and given back) is written into its pod sets, so Kueue
admits the new size; one changed while it holds quota is refused, and the run keeps the admitted count until Kueue
admits it again.

The functions here are pure except the I/O at the end: `observe` only reads (the pass's observation); `create`,
`release`, `resize` and `finish` carry out the actions status.admission decides; `placements` reads flavours.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from .. import builders
from ..api import ENVIRONMENT_LABEL, ROLE_LABEL, GRPORunSpec, Reason, TopologySpec
from ..apitime import format_time
from ..run_ref import RunRef
from ..status import WorkloadObservation
from ..status.admission import environment_pod_set, spec_counts
from .kube import PERMANENT_REJECTIONS, APIClientError, Kube

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta1"
WORKLOAD = "Workload"
RESOURCE_FLAVOR = "ResourceFlavor"
#: Kueue's limit on a Workload's pod sets: the rollout's, the learner's, and one per environment with servers.
MAX_POD_SETS = 8
#: Topology-aware scheduling (Kueue's TopologyUngater): a pod carrying the gate, the Workload annotation, its pod set
#: label and its pod set's topology annotation is held until Kueue gives it the node labels of its assigned domain.
TOPOLOGY_GATE = f"{GROUP}/topology"
WORKLOAD_ANNOTATION = f"{GROUP}/workload"
PODSET_LABEL = f"{GROUP}/podset"
TOPOLOGY_ANNOTATIONS = {"required": f"{GROUP}/podset-required-topology",
                        "preferred": f"{GROUP}/podset-preferred-topology"}
#: The condition types and the reason Kueue's own job integrations use.
ADMITTED, QUOTA_RESERVED, EVICTED, FINISHED = "Admitted", "QuotaReserved", "Evicted", "Finished"


def queue_name(metadata: dict[str, Any]) -> str | None:
    return (metadata.get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(run: str) -> str:
    return f"grporun-{run}"


def role_topologies(spec: GRPORunSpec) -> dict[str, TopologySpec]:
    """Role -> its `topology` (spec.rollout.topology, spec.learner.topology), for the roles that set one."""
    return {role: topology for role, topology in (("rollout", spec.rollout.topology),
                                                   ("learner", spec.learner.topology)) if topology is not None}


def topology_request(topology: TopologySpec) -> dict[str, str]:
    """A pod set's `topologyRequest`, as Kueue's own integrations derive it from the podset-*-topology annotations."""
    return topology.model_dump(exclude_none=True)


def pod_set_of(pod: dict[str, Any]) -> str:
    """The pod set a pod of the run belongs to: its role's, or its environment's (status.admission)."""
    labels = pod["metadata"]["labels"]
    if labels.get(ROLE_LABEL) == builders.ENVIRONMENT_ROLE:
        return environment_pod_set(labels[ENVIRONMENT_LABEL])
    return labels[ROLE_LABEL]


class TooManyPodSets(ValueError):
    """The run asks for more pod sets than a Workload holds."""


def build_workload(run: RunRef, queue: str, pods: list[dict[str, Any]],
                   topologies: dict[str, TopologySpec] | None = None) -> dict[str, Any]:
    """The run's Workload: one pod set per role and per environment, in the order of `pods`, the set's first pod
    as its template, its pod count, and the role's topology request if it has one. Environment servers take quota
    like the run's other pods: a run Kueue admits never runs pods it holds no quota for."""
    members: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        members.setdefault(pod_set_of(pod), []).append(pod)
    if len(members) > MAX_POD_SETS:
        raise TooManyPodSets(
            f"spec.environments: a run queued in Kueue has at most {MAX_POD_SETS - 2} environments with servers, "
            f"not {len(members) - 2} (a Kueue Workload holds at most {MAX_POD_SETS} pod sets: the rollout's, the "
            "learner's and one per environment)")
    pod_sets = []
    for name, mine in members.items():
        template = {"metadata": {"labels": dict(mine[0]["metadata"]["labels"])}, "spec": mine[0]["spec"]}
        pod_set: dict[str, Any] = {"name": name, "count": len(mine), "template": template}
        if name in (topologies or {}):
            pod_set["topologyRequest"] = topology_request(topologies[name])
        pod_sets.append(pod_set)
    spec: dict[str, Any] = {"queueName": queue, "podSets": pod_sets}
    priority_class = next((p["spec"]["priorityClassName"] for p in pods if p["spec"].get("priorityClassName")), None)
    if priority_class:
        spec["priorityClassName"] = priority_class
        spec["priorityClassSource"] = "scheduling.k8s.io/priorityclass"
    return {"apiVersion": API_VERSION, "kind": WORKLOAD,
            "metadata": builders.child_metadata(run, workload_name(run.name)), "spec": spec}


def pod_set_counts(workload: dict[str, Any]) -> dict[str, int]:
    """Pod set -> the count in the Workload's spec (what Kueue reserves quota for when it admits it)."""
    pod_sets = (workload.get("spec") or {}).get("podSets") or []
    return {pod_set["name"]: int(pod_set.get("count", 1)) for pod_set in pod_sets}


def admitted_counts(workload: dict[str, Any]) -> dict[str, int]:
    """Pod set -> the pods Kueue's admission holds quota for: the assignment's count (partial admission may give
    fewer than the pod set asks), else the pod set's own count. Empty when no quota is reserved."""
    admission = (workload.get("status") or {}).get("admission")
    if admission is None:
        return {}
    counts = pod_set_counts(workload)
    for assignment in admission.get("podSetAssignments") or []:
        if isinstance(assignment.get("count"), int):
            counts[assignment["name"]] = assignment["count"]
    return counts


def resized_pod_sets(workload: dict[str, Any], spec: GRPORunSpec) -> bool:
    """Whether the spec asks for other pod counts than the Workload's pod sets hold."""
    current = pod_set_counts(workload)
    return any(current.get(role) != count for role, count in spec_counts(spec).items())


def _condition(workload: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def _is_true(workload: dict[str, Any], kind: str) -> bool:
    return (_condition(workload, kind) or {}).get("status") == "True"


@dataclass(frozen=True)
class Admission:
    state: str  # pending | admitted | evicted
    message: str = ""
    flavors: dict[str, list[str]] = field(default_factory=dict)  # pod set -> ResourceFlavor names
    reserved: bool = False  # quota still reserved (status.admission set)


def admission_of(workload: dict[str, Any]) -> Admission:
    status = workload.get("status") or {}
    admission = status.get("admission")
    if _is_true(workload, EVICTED):
        return Admission("evicted", (_condition(workload, EVICTED) or {}).get("message", ""),
                         reserved=admission is not None)
    if admission is not None and _is_true(workload, ADMITTED):
        flavors = {assignment["name"]: sorted(set((assignment.get("flavors") or {}).values()))
                   for assignment in admission.get("podSetAssignments") or []}
        return Admission("admitted", flavors=flavors, reserved=True)
    return Admission("pending", (_condition(workload, QUOTA_RESERVED) or {}).get("message", ""),
                     reserved=admission is not None)


def hold_of(admission: Admission, queue: str) -> tuple[str, str] | None:
    """The (reason, message) that keeps the run suspended, or None when it may run."""
    if admission.state == "evicted":
        detail = f": {admission.message}" if admission.message else ""
        return (Reason.EVICTED, f"evicted by Kueue{detail}; pods deleted, the run resumes from its checkpoint when "
                                "Kueue admits it again")
    if admission.state == "pending":
        return (Reason.WAITING_FOR_ADMISSION, f"waiting for Kueue to admit the run (LocalQueue {queue})")
    return None


def placement(flavors: list[dict[str, Any]]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Node labels and tolerations of the ResourceFlavors assigned to one pod set."""
    labels: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for flavor in flavors:
        spec = flavor.get("spec") or {}
        labels.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
    return labels, tolerations


def place(pod: dict[str, Any], labels: dict[str, str], tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod with its flavour's node labels and tolerations added (the flavour's labels win on a clash)."""
    if not labels and not tolerations:
        return pod
    spec = {**pod["spec"]}
    if labels:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **labels}
    if tolerations:
        spec["tolerations"] = list(spec.get("tolerations", [])) + [t for t in tolerations
                                                                    if t not in spec.get("tolerations", [])]
    return {**pod, "spec": spec}


def topology_gated(pod: dict[str, Any], run: str, role: str, topology: TopologySpec) -> dict[str, Any]:
    """The pod held by Kueue's topology gate until Kueue's TopologyUngater puts its assigned domain's node labels in
    its nodeSelector (what Kueue does for the pods of the job kinds it knows)."""
    metadata = pod["metadata"]
    (kind, level), = topology_request(topology).items()
    annotations = {**metadata.get("annotations", {}), WORKLOAD_ANNOTATION: workload_name(run),
                   TOPOLOGY_ANNOTATIONS[kind]: level}
    labels = {**metadata.get("labels", {}), PODSET_LABEL: role}
    gates = [g for g in pod["spec"].get("schedulingGates", []) if g.get("name") != TOPOLOGY_GATE]
    return {**pod, "metadata": {**metadata, "annotations": annotations, "labels": labels},
            "spec": {**pod["spec"], "schedulingGates": [*gates, {"name": TOPOLOGY_GATE}]}}


def _set_condition(conditions: list[dict[str, Any]], kind: str, status: str, reason: str, message: str,
                   now: datetime.datetime) -> list[dict[str, Any]]:
    current = next((c for c in conditions if c.get("type") == kind), None)
    moved = current is None or current.get("status") != status
    updated = {"type": kind, "status": status, "reason": reason, "message": message,
               "lastTransitionTime": format_time(now) if moved else current["lastTransitionTime"]}
    return [c for c in conditions if c.get("type") != kind] + [updated]


def released_status(workload: dict[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """Status patch that gives back the quota of an evicted Workload once its pods are gone (what Kueue's own job
    integrations do), so Kueue queues it again."""
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    message = "the run's pods are deleted; waiting to be admitted again"
    conditions = _set_condition(conditions, QUOTA_RESERVED, "False", "Pending", message, now)
    conditions = _set_condition(conditions, ADMITTED, "False", "NoReservation", message, now)
    return {"admission": None, "conditions": conditions}


def status_api_version(group: dict[str, Any] | None) -> str:
    """The version to write a Workload's status in: the group's preferred one. Kueue v0.15+ stores v1beta2, and
    refuses (422) a v1beta1 status write to a Workload that holds quota and has no priority class: v1beta1's CEL rule
    reads spec.priorityClassSource, which the conversion from v1beta2 leaves out (seen with Kueue v0.17.0). The
    status fields written here (admission, conditions) have one shape in both versions."""
    preferred = ((group or {}).get("preferredVersion") or {}).get("groupVersion")
    return preferred if preferred and preferred.startswith(f"{GROUP}/") else API_VERSION


def finished_status(workload: dict[str, Any], succeeded: bool, message: str,
                    now: datetime.datetime) -> dict[str, Any]:
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    reason = "Succeeded" if succeeded else "Failed"
    return {"conditions": _set_condition(conditions, FINISHED, "True", reason, message or reason, now)}


# ---------------------------------------------------------------------------------------------------------------------
# I/O
# ---------------------------------------------------------------------------------------------------------------------
class WorkloadRejected(Exception):
    """The API server (Kueue's webhook) refused the run's Workload as invalid: its pod templates are the run's own
    pods, so no retry can change the answer."""


@dataclass(frozen=True)
class Gate:
    hold: tuple[str, str] | None
    flavors: dict[str, list[str]] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)  # pod set -> pods admitted (admitted runs only)
    workload: dict[str, Any] | None = None  # as read this pass (what releasing or resizing it starts from)


async def observe(kube: Kube, run: RunRef, queue: str, spec: GRPORunSpec | None, *,
                  create_error: str | None = None) -> tuple[Gate, WorkloadObservation]:
    """Read the run's Workload (one GET, no write): whether the run may have pods, and what status.admission needs
    to decide what to do with the Workload. `create_error`: why creating it failed last time (shown while it is
    missing); `spec` None: the run's spec cannot be parsed (its Workload is only finished, never resized)."""
    workload = await kube.read(API_VERSION, WORKLOAD, run.namespace, workload_name(run.name))
    if workload is None:
        hold = hold_of(Admission("pending"), queue)
        if create_error is not None:
            hold = (Reason.WAITING_FOR_ADMISSION, f"{create_error} (is Kueue installed?)")
        return Gate(hold), WorkloadObservation(exists=False)
    admission = admission_of(workload)
    admitted = admitted_counts(workload) if admission.state == "admitted" else {}
    seen = WorkloadObservation(exists=True, reserved=admission.reserved, evicted=admission.state == "evicted",
                               finished=_is_true(workload, FINISHED),
                               resizable=spec is not None and not admission.reserved
                               and resized_pod_sets(workload, spec))
    return Gate(hold_of(admission, queue), admission.flavors, admitted, workload), seen


async def create(kube: Kube, run: RunRef, queue: str, spec: GRPORunSpec, *, trainer_image: str) -> str | None:
    """CreateWorkload. Returns why it failed when another try may pass (no Kueue on the cluster, its webhook not
    answering yet); raises WorkloadRejected when the API server refuses it as invalid."""
    pods = builders.build_pods(run, spec, trainer_image=trainer_image) + builders.build_environment_pods(run, spec)
    try:
        await kube.create(build_workload(run, queue, pods, role_topologies(spec)))
    except TooManyPodSets as error:
        raise WorkloadRejected(str(error)) from None
    except APIClientError as error:
        refusal = f"the Kueue Workload {workload_name(run.name)} was rejected: {error.message or error}"
        if error.status in PERMANENT_REJECTIONS:
            raise WorkloadRejected(refusal) from None
        return refusal
    return None


async def release(kube: Kube, run: RunRef, workload: dict[str, Any], now: datetime.datetime) -> None:
    """ReleaseQuota: give back an evicted Workload's quota reservation, its pods being gone."""
    version = status_api_version(await kube.api_group(GROUP))
    await kube.patch_status(version, WORKLOAD, run.namespace, workload_name(run.name), released_status(workload, now))


async def resize(kube: Kube, run: RunRef, queue: str, spec: GRPORunSpec, workload: dict[str, Any], *,
                 trainer_image: str) -> None:
    """ResizeWorkload: write the spec's pod sets into a Workload that holds no quota, so Kueue admits the size the
    run now asks for. Conditional on the version read: Kueue may reserve quota in between, and then its webhook
    refuses a change to the pod sets; either refusal is tried again on the next pass."""
    pods = builders.build_pods(run, spec, trainer_image=trainer_image) + builders.build_environment_pods(run, spec)
    pod_sets = build_workload(run, queue, pods, role_topologies(spec))["spec"]["podSets"]
    before = pod_set_counts(workload)
    version = (workload.get("metadata") or {}).get("resourceVersion")
    patch = {**({"metadata": {"resourceVersion": version}} if version else {}), "spec": {"podSets": pod_sets}}
    try:
        await kube.patch(API_VERSION, WORKLOAD, run.namespace, workload_name(run.name), patch)
    except APIClientError as error:
        kube.logger.info(f"the Kueue Workload {workload_name(run.name)} was not resized (HTTP {error.status}): "
                         f"{error.message or error}; trying again")
        return
    kube.logger.info(f"the Kueue Workload {workload_name(run.name)} resized from {before} to {spec_counts(spec)} "
                     "pods per pod set: Kueue admits the run at its new size")


async def placements(kube: Kube, flavors: dict[str, list[str]]) -> dict[str, tuple[dict, list]]:
    """Pod set (role) -> the node labels and tolerations of its assigned flavours."""
    result = {}
    for pod_set, names in flavors.items():
        objects = [await kube.read(API_VERSION, RESOURCE_FLAVOR, None, name) for name in names]
        result[pod_set] = placement([obj for obj in objects if obj is not None])
    return result


async def finish(kube: Kube, run: str, namespace: str, status: dict[str, Any], now: datetime.datetime) -> None:
    """Mark the Workload of a finished run Finished (once), so Kueue frees its quota."""
    workload = await kube.read(API_VERSION, WORKLOAD, namespace, workload_name(run))
    if workload is None or _is_true(workload, FINISHED):
        return
    succeeded = status.get("phase") == "Succeeded"
    version = status_api_version(await kube.api_group(GROUP))
    await kube.patch_status(version, WORKLOAD, namespace, workload_name(run),
                            finished_status(workload, succeeded, status.get("message") or "", now))
