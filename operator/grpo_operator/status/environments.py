"""`status.environments`: each environment server pool of spec.environments, as its pods show it."""

from __future__ import annotations

from collections.abc import Sequence

from ..api import EnvironmentSpec, EnvironmentStatus
from ..builders import environment_pod_name
from .decision import PodObservation


def environments_status(run: str, environments: Sequence[EnvironmentSpec] | None,
                        pods: Sequence[PodObservation]) -> list[EnvironmentStatus] | None:
    """One entry per environment, in spec order; None for a run without environments. A pod counts for the
    environment whose server name it has (`<run>-env-<name>-<i>`, i below the spec's replicas), so one environment's
    name that prefixes another's (`a` and `a-b`) does not mix their counts."""
    if not environments:
        return None
    by_name = {pod.name: pod for pod in pods if pod.role == "environment"}
    entries = []
    for environment in environments:
        mine = [by_name[name] for index in range(environment.replicas)
                if (name := environment_pod_name(run, environment.name, index)) in by_name]
        entries.append(EnvironmentStatus(
            name=environment.name, wanted=environment.replicas, replicas=len(mine),
            ready=sum(1 for pod in mine if pod.ready),
            restarts=sum(pod.container_restarts for pod in mine)))
    return entries
