"""`status.environments`: each environment server pool of spec.environments, as its pods show it, and the live
change of a pool's size (spec.environments[].replicas, which a running run takes without a suspend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..api import EnvironmentSpec, EnvironmentStatus
from ..builders import environment_pod_prefix
from .decision import PodObservation


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
