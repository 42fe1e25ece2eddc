"""The words of a run's status: the messages of its phases and events, the conditions a new run starts with, and a
pod's waiting reason that will not clear by itself."""

from __future__ import annotations

import datetime
import re

from grpo_trainer.contract.report import ExportReport, TrackerLossReport

from ..api import GRPORunSpec
from ..run_status import ConditionType, Phase, Reason
from .conditions import Conditions, format_time
from .decision import PodObservation, ProbeFailure

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



#: A probe failure's cause is cut to this many characters (an exec probe's output can be long).
PROBE_CAUSE_CHARS = 200
#: Go's url.Error before an HTTP probe's cause: `Get "http://10.0.0.5:8765/health": `.
_HTTP_REQUEST_PREFIX = re.compile(r'^[A-Z][a-z]* "[^"]*": ')
#: The kubelet's event correlator rewords similar events of one object into one.
_COMBINED_PREFIX = "(combined from similar events): "


def probe_failure_words(failure: ProbeFailure) -> str:
    """`readiness probe failed: connection refused (5 times in 40 s)`: the kubelet's cause without the request and
    address Go names first (`Get "http://...": dial tcp 10.0.0.5:8765: connect: `), how often, over how long."""
    cause = " ".join(failure.cause.removeprefix(_COMBINED_PREFIX).split())
    cause = _HTTP_REQUEST_PREFIX.sub("", cause)
    if cause.startswith("dial "):  # a net.OpError: `dial tcp ADDRESS: connect: connection refused`
        cause = cause.rsplit(": ", 1)[-1]
    if len(cause) > PROBE_CAUSE_CHARS:
        cause = cause[:PROBE_CAUSE_CHARS - 3] + "..."
    times = "once" if failure.count <= 1 else f"{failure.count} times in {round(failure.seconds)} s"
    return f"{failure.probe} probe failed: {cause or 'no cause given'} ({times})"
