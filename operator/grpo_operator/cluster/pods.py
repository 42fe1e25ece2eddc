"""Pure reading of a Pod object into what the operator decides on (status.PodObservation) and acts on (PodFacts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api import ATTEMPT_ANNOTATION, ROLE_LABEL, ROLLOUT_RESTARTS_ANNOTATION
from ..status import PodObservation


@dataclass(frozen=True)
class PodFacts:
    """What the I/O layer needs beyond the observation: identity (to know pods it deleted), the address, and the
    uid of the run that controls the pod (a run re-created under the same name must not adopt the old run's pods)."""

    uid: str
    ip: str | None
    owner_uid: str | None


def _main_container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    role = (pod.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL)
    return next((s for s in statuses if s.get("name") == role), statuses[0] if statuses else {})


def _main_container_spec(pod: dict[str, Any]) -> dict[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    role = (pod.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL)
    return next((c for c in containers if c.get("name") == role), {})


def observe_pod(pod: dict[str, Any]) -> PodObservation:
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    container = _main_container_status(pod)
    limits = (_main_container_spec(pod).get("resources") or {}).get("limits") or {}
    state = container.get("state") or {}
    terminated, waiting = state.get("terminated") or {}, state.get("waiting") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    reason = status.get("reason") or terminated.get("reason")
    message = terminated.get("message") or waiting.get("message") or status.get("message")
    if scheduled.get("status") == "False":
        reason, message = scheduled.get("reason") or reason, scheduled.get("message") or message
    role = (metadata.get("labels") or {}).get(ROLE_LABEL)
    return PodObservation(
        name=metadata.get("name", ""),
        role=role if role in ("learner", "environment") else "rollout",
        phase=status.get("phase") or "Pending",
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        exit_code=terminated.get("exitCode"),
        reason=reason,
        message=message,
        waiting_reason=waiting.get("reason"),
        terminating=bool(metadata.get("deletionTimestamp")),
        disruption=_disruption(conditions.get("DisruptionTarget")),
        attempt=_annotated_count(metadata, ATTEMPT_ANNOTATION),
        rollout_restarts=_annotated_count(metadata, ROLLOUT_RESTARTS_ANNOTATION),
        conditions=frozenset(kind for kind, c in conditions.items() if kind and c.get("status") == "True"),
        container=container.get("name"),
        memory_limit=str(limits["memory"]) if limits.get("memory") is not None else None,
        container_restarts=_count(container.get("restartCount")),
        not_ready=_not_ready(conditions.get("Ready")),
        image_id=str(container["imageID"]) if container.get("imageID") else None,
    )


def _not_ready(condition: dict[str, Any] | None) -> str | None:
    """The Ready condition's reason and message while it is False (the kubelet's: `ContainersNotReady: containers
    with unready status: [environment]`); None while Ready, or when the pod has no such condition yet."""
    if not condition or condition.get("status") != "False":
        return None
    return ": ".join(part for part in (condition.get("reason"), condition.get("message")) if part) or None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _disruption(condition: dict[str, Any] | None) -> str | None:
    if not condition or condition.get("status") != "True":
        return None
    return condition.get("reason") or "DisruptionTarget"


def _annotated_count(metadata: dict[str, Any], annotation: str) -> int | None:
    value = str((metadata.get("annotations") or {}).get(annotation, ""))
    return int(value) if value.isdigit() else None


def pod_facts(pod: dict[str, Any]) -> PodFacts:
    metadata = pod.get("metadata") or {}
    owner = next((ref for ref in metadata.get("ownerReferences") or [] if ref.get("controller")), {})
    return PodFacts(uid=metadata.get("uid", ""), ip=(pod.get("status") or {}).get("podIP"),
                    owner_uid=owner.get("uid"))
