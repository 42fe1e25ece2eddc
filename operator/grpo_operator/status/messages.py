"""The words of a run's status: the messages of its phases and events, the conditions a new run starts with, and a
pod's waiting reason that will not clear by itself."""

from __future__ import annotations

import datetime

from grpo_trainer.contract.report import ExportReport, TrackerLossReport

from ..api import GRPORunSpec
from ..run_status import ConditionType, Phase, Reason
from .conditions import Conditions, format_time
from .decision import PodObservation

#: Waiting reasons that mean a pod will not start by itself; surfaced on the run (KubeRay #1990: a job stuck in
#: Initializing forever on an image-pull error).
STUCK_WAITING_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError",
})


def exported_message(report: ExportReport) -> str:
    return (f"model exported to {report.uri}: step {report.step}, {report.bytes} bytes, manifest sha256 "
            f"{report.sha256}")


def metrics_lost_message(losses: list[TrackerLossReport]) -> str:
    """TrackingDegraded's message (reason MetricsLost): each tracker the learner dropped mid-run, since when, why."""
    def since(loss: TrackerLossReport) -> str:
        return format_time(datetime.datetime.fromtimestamp(loss.since, datetime.UTC))

    return "; ".join(f"{loss.tracker} lost the run's metrics since {since(loss)}: {loss.reason}" for loss in losses)


def initial_conditions(conditions: Conditions) -> None:
    set_ = conditions.set
    set_(ConditionType.ROLLOUT_READY, "False", Reason.REPLICAS_NOT_READY, "no rollout server is ready yet")
    set_(ConditionType.PROGRESSING, "False", Reason.PODS_PENDING, "creating pods")
    set_(ConditionType.STALLED, "False", Reason.NOT_STALLED, "")
    set_(ConditionType.SUSPENDED, "False", Reason.NOT_SUSPENDED, "")
    set_(ConditionType.SUCCEEDED, "False", Reason.NOT_FINISHED, "")
    set_(ConditionType.FAILED, "False", Reason.NOT_FINISHED, "")


def phase_message(spec: GRPORunSpec, phase: Phase) -> str:
    messages = {
        Phase.PENDING: _creating_message(spec),
        Phase.STARTING: "pods are running; waiting for the rollout servers and the learner",
        Phase.RUNNING: "rollout servers ready, learner training",
        Phase.SUSPENDED: "spec.runPolicy.suspend is true: pods deleted, the run is kept",
    }
    return messages.get(phase, phase.value)


def _creating_message(spec: GRPORunSpec) -> str:
    environment_pods = sum(environment.replicas for environment in spec.environments or [])
    if not environment_pods:
        return f"creating {spec.rollout.replicas} rollout and {spec.learner.nodes} learner pods"
    return (f"creating {spec.rollout.replicas} rollout, {spec.learner.nodes} learner and {environment_pods} "
            "environment pods")


def waiting_reason(pods: list[PodObservation], terminating: list[PodObservation]) -> tuple[str, str] | None:
    """A pod that will not start by itself (image pull, crash loop, unschedulable), or one being deleted that must
    be gone before it can be created again, as (reason, message)."""
    for pod in terminating:
        return Reason.POD_TERMINATING, (f"pod {pod.name} is being deleted; it is created again once it is gone "
                                        "(a pod on an unreachable node stays Terminating until the node is removed)")
    for pod in pods:
        if pod.waiting_reason in STUCK_WAITING_REASONS:
            return pod.waiting_reason, f"pod {pod.name}: {pod.waiting_reason}: {pod.message or ''}".strip()
        if pod.phase == "Pending" and pod.reason == Reason.UNSCHEDULABLE:
            return Reason.UNSCHEDULABLE, f"pod {pod.name}: {pod.message or 'unschedulable'}"
    return None

