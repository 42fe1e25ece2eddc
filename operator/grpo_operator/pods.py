"""Pure reading of a Pod object into what the operator decides on (status.PodObservation) and acts on (PodFacts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .api import ROLE_LABEL
from .status import PodObservation


@dataclass(frozen=True)
class PodFacts:
    """What the I/O layer needs beyond the observation: identity (to skip pods it deleted), the address, deletion."""

    uid: str
    ip: str | None
    terminating: bool


def _main_container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    role = (pod.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL)
    return next((s for s in statuses if s.get("name") == role), statuses[0] if statuses else {})


def observe_pod(pod: dict[str, Any]) -> PodObservation:
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    container = _main_container_status(pod)
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
        role="learner" if role == "learner" else "rollout",
        phase=status.get("phase") or "Pending",
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        exit_code=terminated.get("exitCode"),
        reason=reason,
        message=message,
        waiting_reason=waiting.get("reason"),
    )


def pod_facts(pod: dict[str, Any]) -> PodFacts:
    metadata = pod.get("metadata") or {}
    return PodFacts(uid=metadata.get("uid", ""), ip=(pod.get("status") or {}).get("podIP"),
                    terminating=bool(metadata.get("deletionTimestamp")))
