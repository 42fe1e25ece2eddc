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


def spec_counts(spec: GRPORunSpec) -> dict[str, int]:
    """Pod set (role) -> how many pods the spec asks for."""
    return {"rollout": spec.rollout.replicas, "learner": spec.learner.nodes}


#: The spec field that sizes each role's pod set.
COUNT_FIELDS = {"rollout": "spec.rollout.replicas", "learner": "spec.learner.nodes"}


def within_admission(spec: GRPORunSpec, admitted: dict[str, int], workload: str) -> tuple[GRPORunSpec, str | None]:
    """The spec to run an admitted run by, and why part of it is not applied: no role runs more pods than Kueue
    admitted for its pod set (fewer is fine: the quota stays reserved). Kueue resizes no pod set of a Workload that
    holds quota; a larger count takes effect when Kueue admits the run again, the Workload resized meanwhile."""
    in_effect: dict[str, int] = {}
    refusals = []
    for role, wanted in spec_counts(spec).items():
        allowed = admitted.get(role)
        if allowed is not None and wanted > allowed:
            in_effect[role] = allowed
            refusals.append(f"{COUNT_FIELDS[role]}: {wanted} is more than the {allowed} {role} pod(s) Kueue admitted")
    if not refusals:
        return spec, None
    message = (f"{'; '.join(refusals)} (Workload {workload}); the run keeps the admitted count: Kueue does not resize "
               "a Workload that holds quota (docs/kueue.md, \"Scaling\"). Set it back, or have Kueue admit the run "
               "again (an eviction, or `kueuectl stop workload` then `resume`): the Workload is resized once its "
               "quota is given back")
    update = {}
    if "rollout" in in_effect:
        update["rollout"] = spec.rollout.model_copy(update={"replicas": in_effect["rollout"]})
    if "learner" in in_effect:
        update["learner"] = spec.learner.model_copy(update={"nodes": in_effect["learner"]})
    return spec.model_copy(update=update), message
