"""Kueue admission as part of the pass: what to do with the run's Workload, from what the pass saw of it.

The port observes the Workload (only reads); these rules decide the writes, as actions carried out after the status
is written like any other: create it for a queued run that has none, give back the quota of an evicted one once its
pods are gone (so Kueue queues it again), write the spec's pod counts into one that holds no quota (so Kueue admits
the size the run now asks for), and mark it Finished when the run ends (so Kueue frees the quota). docs/kueue.md has
the design.

A run never has more pods of a role than Kueue admitted for its pod set (`within_admission`): the pass runs the spec
within the admission and says why the rest is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api import GRPORunSpec
from .decision import Action, CreateWorkload, FinishWorkload, ReleaseQuota, ResizeWorkload, WorkloadObservation


def workload_actions(workload: WorkloadObservation | None, *, finished: bool, pods_exist: bool) -> list[Action]:
    """The action on the run's Workload this pass, if any. `finished`: the run's new phase is final; `pods_exist`:
    pods of the run remain that are not being deleted."""
    if workload is None:
        return []
    if finished:
        return [FinishWorkload()] if workload.exists and not workload.finished else []
    if not workload.exists:
        return [CreateWorkload()]
    if workload.evicted and workload.reserved and not pods_exist:
        return [ReleaseQuota()]
    if workload.resizable and not workload.reserved:
        return [ResizeWorkload()]
    return []


def environment_pod_set(environment: str) -> str:
    """The pod set of an environment's servers (spec.environments[].name): they take quota as the run's other pods."""
    return f"env-{environment}"


def spec_counts(spec: GRPORunSpec) -> dict[str, int]:
    """Pod set -> how many pods the spec asks for: a pod set per role, and one per environment that has servers."""
    counts = {"rollout": spec.rollout.replicas, "learner": spec.learner.nodes}
    counts.update({environment_pod_set(environment.name): environment.replicas
                   for environment in spec.environments or [] if environment.replicas > 0})
    return counts


def count_fields(spec: GRPORunSpec) -> dict[str, str]:
    """Pod set -> the spec field that sizes it."""
    fields = {"rollout": "spec.rollout.replicas", "learner": "spec.learner.nodes"}
    fields.update({environment_pod_set(environment.name): f"spec.environments[{position}].replicas"
                   for position, environment in enumerate(spec.environments or [])})
    return fields


@dataclass(frozen=True)
class InEffect:
    """The spec an admitted run runs by, and why what it asks beyond its admission is not applied."""

    spec: GRPORunSpec
    #: spec.rollout.replicas and spec.learner.nodes past their pod sets' admission (status.rollout.scaleRefused).
    refused: str | None = None
    #: By environment name: its replicas past its pod set's admission (status.environments[].scaleRefused).
    environments_refused: Mapping[str, str] = field(default_factory=dict)


def _refusal(lines: list[str], workload: str, who: str) -> str:
    return (f"{'; '.join(lines)} (Workload {workload}); {who} keeps the admitted count: Kueue does not resize a "
            "Workload that holds quota (docs/kueue.md, \"Scaling\"). Set it back, or have Kueue admit the run again "
            "(an eviction, or `kueuectl stop workload` then `resume`): the Workload is resized once its quota is "
            "given back")


def within_admission(spec: GRPORunSpec, admitted: dict[str, int], workload: str) -> InEffect:
    """The spec to run an admitted run by, and why part of it is not applied: no role runs more pods than Kueue
    admitted for its pod set (fewer is fine: the quota stays reserved). Kueue resizes no pod set of a Workload that
    holds quota; a larger count takes effect when Kueue admits the run again, the Workload resized meanwhile."""
    in_effect: dict[str, int] = {}
    refusals: dict[str, str] = {}
    fields = count_fields(spec)
    environments = {environment_pod_set(environment.name) for environment in spec.environments or []}
    for pod_set, wanted in spec_counts(spec).items():
        # An environment admitted with 0 servers has no pod set in the Workload: Kueue admitted none of its pods.
        allowed = admitted.get(pod_set, 0 if pod_set in environments else None)
        if allowed is not None and wanted > allowed:
            in_effect[pod_set] = allowed
            refusals[pod_set] = (f"{fields[pod_set]}: {wanted} is more than the {allowed} {pod_set} pod(s) Kueue "
                                 "admitted")
    if not refusals:
        return InEffect(spec)
    roles = [refusals[pod_set] for pod_set in ("rollout", "learner") if pod_set in refusals]
    update: dict[str, Any] = {}
    if "rollout" in in_effect:
        update["rollout"] = spec.rollout.model_copy(update={"replicas": in_effect["rollout"]})
    if "learner" in in_effect:
        update["learner"] = spec.learner.model_copy(update={"nodes": in_effect["learner"]})
    environments_refused = {}
    if spec.environments and any(environment_pod_set(e.name) in in_effect for e in spec.environments):
        update["environments"] = [e.model_copy(update={"replicas": in_effect.get(environment_pod_set(e.name),
                                                                                  e.replicas)})
                                  for e in spec.environments]
        environments_refused = {e.name: _refusal([refusals[environment_pod_set(e.name)]], workload, "the environment")
                                for e in spec.environments if environment_pod_set(e.name) in refusals}
    return InEffect(spec.model_copy(update=update), _refusal(roles, workload, "the run") if roles else None,
                    environments_refused)
