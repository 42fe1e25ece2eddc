"""Gang scheduling (`spec.scheduling.gang`): one PodGroup for all pods of a run, so a run never holds some GPUs while
waiting for the rest. Pure builders: the PodGroup object, and the label or annotation plus scheduler name that put a
pod in it.

Two schedulers are supported, each with its own PodGroup kind:
- `coscheduling`: the Coscheduling plugin of kubernetes-sigs/scheduler-plugins (`scheduling.x-k8s.io/v1alpha1`).
  Pods join with the label `scheduling.x-k8s.io/pod-group`. The second scheduler is usually deployed as
  `scheduler-plugins-scheduler`.
- `volcano`: Volcano (`scheduling.volcano.sh/v1beta1`). Pods join with the annotation `scheduling.k8s.io/group-name`
  and are scheduled by `volcano`; `queue` names the Volcano queue.

`minMember` is every pod of the run (rollout servers + learner nodes): the learner waits for the rollout servers
itself, so all pods start together.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo_trainer.contract.wire import WireModel

COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
DEFAULT_SCHEDULER_NAMES = {"coscheduling": "scheduler-plugins-scheduler", "volcano": "volcano"}


class GangSpec(WireModel):
    scheduler: Literal["coscheduling", "volcano"]
    scheduler_name: str | None = None
    schedule_timeout_seconds: int | None = Field(None, ge=1)
    queue: str | None = None


class SchedulingSpec(WireModel):
    gang: GangSpec | None = None


def pod_group_name(run: str) -> str:
    return run


def build_pod_group(metadata: dict[str, Any], gang: GangSpec, min_member: int) -> dict[str, Any]:
    """The PodGroup of a run; `metadata` (the builders make it) carries its name (`pod_group_name`), namespace,
    the run's labels and ownerReference."""
    spec: dict[str, Any] = {"minMember": min_member}
    if gang.scheduler == "coscheduling":
        if gang.schedule_timeout_seconds is not None:
            spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
        api_version = COSCHEDULING_API
    else:
        if gang.queue is not None:
            spec["queue"] = gang.queue
        api_version = VOLCANO_API
    return {"apiVersion": api_version, "kind": "PodGroup", "metadata": metadata, "spec": spec}


def join(pod: dict[str, Any], run: str, gang: GangSpec | None) -> dict[str, Any]:
    """The pod as a member of the run's PodGroup, scheduled by the gang scheduler (a new dict)."""
    if gang is None:
        return pod
    metadata = {**pod["metadata"]}
    if gang.scheduler == "coscheduling":
        metadata["labels"] = {**metadata.get("labels", {}), COSCHEDULING_LABEL: pod_group_name(run)}
    else:
        metadata["annotations"] = {**metadata.get("annotations", {}), VOLCANO_ANNOTATION: pod_group_name(run)}
    spec = {**pod["spec"], "schedulerName": gang.scheduler_name or DEFAULT_SCHEDULER_NAMES[gang.scheduler]}
    return {**pod, "metadata": metadata, "spec": spec}
