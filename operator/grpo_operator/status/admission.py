"""Kueue admission as part of the pass: what to do with the run's Workload, from what the pass saw of it.

The port observes the Workload (only reads); these rules decide the writes, as actions carried out after the status
is written like any other: create it for a queued run that has none, give back the quota of an evicted one once its
pods are gone (so Kueue queues it again), write the spec's pod counts into one that holds no quota (so Kueue admits
the size the run now asks for), and mark it Finished when the run ends (so Kueue frees the quota). docs/kueue.md has
the design.
"""

from __future__ import annotations

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
