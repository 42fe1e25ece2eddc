"""`status.environments`: each environment server pool of spec.environments, as its pods show it; EnvironmentsReady,
which names each server that is not ready and why; and the live change of a pool's size
(spec.environments[].replicas, which a running run takes without a suspend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grpo_trainer.contract.report import ProgressReport

from ..api import EnvironmentSpec
from ..builders import environment_pod_name, environment_pod_prefix, environment_readiness_probe
from ..run_status import ConditionType, EnvironmentStatus, Reason
from .conditions import Conditions
from .decision import Event, PodObservation
from .messages import probe_failure_words


def environment_wait(report: ProgressReport | None) -> str | None:
    """What the learner says it waits for (an environment with no ready server), from its report read this pass."""
    return report.environment_wait if report is not None else None


def server_index(run: str, environment: str, pod: str) -> int | None:
    """The index of environment `environment`'s server whose pod is named `pod` (`<run>-env-<name>-<i>`), or None
    for another pod. The index must be all the rest of the name, so that one environment's name that prefixes
    another's (`a` and `a-b`) does not mix their servers."""
    prefix = environment_pod_prefix(run, environment)
    index = pod.removeprefix(prefix)
    if not pod.startswith(prefix) or not (index.isascii() and index.isdigit()):
        return None
    return int(index)


def environments_status(run: str, environments: Sequence[EnvironmentSpec] | None, pods: Sequence[PodObservation],
                        refused: Mapping[str, str]) -> list[EnvironmentStatus] | None:
    """One entry per environment, in spec order; None for a run without environments. `replicas` counts every
    server pod that exists, those past `wanted` too (left by a scale-down until they are deleted): the two meet
    once a change of spec.environments[].replicas is carried out. `refused`: by name, why a larger count than
    `wanted` (the count in effect) is not applied."""
    if not environments:
        return None
    servers = [pod for pod in pods if pod.role == "environment"]
    entries = []
    for environment in environments:
        mine = [pod for pod in servers if server_index(run, environment.name, pod.name) is not None]
        entries.append(EnvironmentStatus(
            name=environment.name, wanted=environment.replicas, replicas=len(mine),
            ready=sum(1 for pod in mine if pod.ready),
            restarts=sum(pod.container_restarts for pod in mine), scale_refused=refused.get(environment.name)))
    return entries


#: EnvironmentsReady's message names at most this many servers that are not ready, then says how many more.
NAMED_SERVERS = 5


def environments_readiness(run: str, environments: Sequence[EnvironmentSpec] | None, pods: Sequence[PodObservation],
                           *, finished: bool) -> tuple[bool, str, str] | None:
    """EnvironmentsReady as (true, reason, message); None for a run without environments. The message names each
    server of the spec's count that is not ready and why, as far as its pod says: a probe that does not pass (the
    spec's probe, and the kubelet's latest probe failure, or else the pod's Ready condition), a container waiting
    (CrashLoopBackOff, an image pull) with its restarts, a pod that is pending or gone. A finished run's servers
    are gone with its pods: reason Finished."""
    if not environments:
        return None
    servers = {pod.name: pod for pod in pods if pod.role == "environment"}
    wanted, ready, details = 0, 0, []
    for environment in environments:
        for index in range(environment.replicas):
            wanted += 1
            name = environment_pod_name(run, environment.name, index)
            pod = servers.get(name)
            if pod is not None and pod.phase == "Running" and pod.ready:
                ready += 1
            else:
                details.append(f"{name} is not ready: {_why_not_ready(pod, environment)}")
    message = f"{ready}/{wanted} environment servers ready"
    if ready == wanted:
        return True, Reason.ALL_ENVIRONMENTS_READY, message
    if finished:
        return False, Reason.FINISHED, f"the run has finished: {message}"
    if len(details) > NAMED_SERVERS:
        details = [*details[:NAMED_SERVERS], f"and {len(details) - NAMED_SERVERS} more"]
    return False, Reason.ENVIRONMENTS_NOT_READY, "; ".join([message, *details])


def environments_ready(conditions: Conditions, run: str, environments: Sequence[EnvironmentSpec] | None,
                       pods: Sequence[PodObservation], *, finished: bool, running: bool) -> list[Event]:
    """Set EnvironmentsReady (dropped for a run without environments); its event: when it turns True, and when it
    turns False on a `running` run (a server a new run waits for is named in Progressing, then in the startup
    deadline's failure). A finished run's turn is not announced: its end was."""
    verdict = environments_readiness(run, environments, pods, finished=finished)
    if verdict is None:
        conditions.remove(ConditionType.ENVIRONMENTS_READY)
        return []
    ready, reason, message = verdict
    if not conditions.set(ConditionType.ENVIRONMENTS_READY, str(ready), reason, message) or finished:
        return []
    if ready:
        return [Event("Normal", Reason.ENVIRONMENTS_READY, message)]
    return [Event("Warning", reason, message)] if running else []


def unready_environments(conditions: Conditions) -> str | None:
    """EnvironmentsReady's message while it is False: the servers that are not ready, and why."""
    condition = conditions.get(ConditionType.ENVIRONMENTS_READY)
    return condition.message if condition is not None and condition.status == "False" else None


def _why_not_ready(pod: PodObservation | None, environment: EnvironmentSpec) -> str:
    if pod is None:
        return "it has no pod yet"
    if pod.phase in ("Failed", "Succeeded"):
        return f"its pod ended ({pod.reason or pod.phase}) and is created again"
    if pod.waiting_reason:
        why = f"{pod.waiting_reason}: {pod.message}" if pod.message else pod.waiting_reason
    elif pod.phase != "Running":
        why = f"its pod is {pod.phase}" + (f" ({pod.reason}: {pod.message})" if pod.reason and pod.message else "")
    else:
        why = f"its readiness probe ({describe_probe(environment)}) does not pass"
        if pod.probe_failure is not None:  # the kubelet's words, from the pod's Events
            why += f": {probe_failure_words(pod.probe_failure)}"
        elif pod.not_ready:
            why += f" ({pod.not_ready})"
    return why + (f", restarted {pod.container_restarts} times" if pod.container_restarts else "")


def describe_probe(environment: EnvironmentSpec) -> str:
    """The environment's readiness probe in words (the spec's, or the default TCP connect)."""
    probe = environment_readiness_probe(environment)
    if (tcp := probe.get("tcpSocket")) is not None:
        return f"TCP connect to port {tcp.get('port')}"
    if (http := probe.get("httpGet")) is not None:
        scheme = "HTTPS" if str(http.get("scheme", "")).upper() == "HTTPS" else "HTTP"
        return f"{scheme} GET {http.get('path', '/')} on port {http.get('port')}"
    if (command := (probe.get("exec") or {}).get("command")) is not None:
        return f"exec {' '.join(map(str, command))}"
    if (grpc := probe.get("grpc")) is not None:
        return f"gRPC on port {grpc.get('port')}"
    return "its probe"


def surplus_servers(run: str, environments: Sequence[EnvironmentSpec] | None,
                    pods: Sequence[PodObservation]) -> list[str]:
    """The server pods past their environment's replicas (the highest indexes, left by a scale-down), by name."""
    surplus = []
    for environment in environments or []:
        for pod in pods:
            index = server_index(run, environment.name, pod.name) if pod.role == "environment" else None
            if index is not None and index >= environment.replicas:
                surplus.append(pod.name)
    return sorted(surplus)


def scale_message(environment: str, before: int, after: int, deleted: Sequence[str]) -> str:
    """The Scaled event of a live change of spec.environments[].replicas."""
    message = f"environment {environment} scaled from {before} to {after} servers"
    if after > before:
        return f"{message}: creating {after - before} server pod(s)"
    if not deleted:
        return message
    return (f"{message}: deleting {', '.join(deleted)}; the episodes they hold fail and count as environment "
            "failures")
