"""A live change of `spec.rollout.replicas`: which removed rollout servers may go now.

Scaling up needs no rule of its own: the new ordinals are missing pods (created as any missing pod is) and their URLs
join the run config's `rollout.urls` (ConfigureRollout), where the learner finds them. Scaling down takes the highest
ordinals out of `rollout.urls` first; the learner then drains each (no new requests, in no weight sync, its requests
in flight finish or move) and drops it from its `/progress` report. Only then is its pod deleted, or once the drain
deadline has passed since its URL left the config, whatever the learner still says (docs/rollout.md, "Scaling a
running run").
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from grpo_trainer.contract.report import ProgressReport

from ..api import GRPORunSpec, Reason, RolloutServerStatus
from .conditions import seconds_since
from .decision import PodObservation, rank


@dataclass(frozen=True)
class Removal:
    """A surplus rollout pod to delete now, and the event that says why."""

    pod: str
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


class DrainEnd(enum.Enum):
    """Why a removed rollout server may stop now (the same rule for pods and for `grporun local`'s processes)."""

    EXITED = "exited"            # it is gone by itself
    NO_LEARNER = "no-learner"    # nothing to drain it: a learner that starts reads the new set
    DRAINED = "drained"          # the learner's report no longer lists it
    DEADLINE = "deadline"        # past the drain deadline, whatever the learner says


def drain_end(*, exited: bool, learner_running: bool, still_reported: bool | None,
              past_deadline: bool) -> DrainEnd | None:
    """Whether a draining server may go, and why; None while it drains. `still_reported` is None when the learner's
    report could not be read: unknown, so only the deadline ends the drain then."""
    if exited:
        return DrainEnd.EXITED
    if not learner_running:
        return DrainEnd.NO_LEARNER
    if still_reported is False:
        return DrainEnd.DRAINED
    if past_deadline:
        return DrainEnd.DEADLINE
    return None


def removals(surplus: Sequence[PodObservation], servers: Sequence[RolloutServerStatus],
             report: ProgressReport | None, *, learner_running: bool, now: datetime.datetime,
             deadline_s: int) -> list[Removal]:
    """The surplus pods (ordinals past spec.rollout.replicas) that may be deleted this pass.

    `report` is the learner's latest `/progress` (None when it could not be read); `learner_running`: a learner pod
    is running, so a missing report means "unknown", not "no learner"; `deadline_s` the drain deadline."""
    by_replica = {server.replica: server for server in servers}
    reported = {seen.replica: seen for seen in report.rollout} if report is not None else None
    out = []
    for pod in surplus:
        replica = rank(pod.name)
        server = by_replica.get(replica)
        started = server.drain_start_time if server is not None else None
        end = drain_end(exited=pod.phase in ("Succeeded", "Failed"), learner_running=learner_running,
                        still_reported=None if reported is None else replica in reported,
                        past_deadline=started is not None and seconds_since(now, started) >= deadline_s)
        if end is DrainEnd.EXITED:
            out.append(Removal(pod.name, "Normal", Reason.DRAINED, f"{pod.name} left the rollout set and has exited"))
        elif end is DrainEnd.NO_LEARNER:
            out.append(Removal(pod.name, "Normal", Reason.DRAINED,
                               f"{pod.name} left the rollout set; no learner is running to drain it"))
        elif end is DrainEnd.DRAINED:
            out.append(Removal(pod.name, "Normal", Reason.DRAINED,
                               f"{pod.name} left the rollout set and the learner has drained it"))
        elif end is DrainEnd.DEADLINE:
            seen = reported.get(replica) if reported is not None else None
            still = (f"the learner still reports it {getattr(seen.state, 'value', seen.state)}" if seen is not None
                     else "the learner's progress cannot be read")
            out.append(Removal(pod.name, "Warning", Reason.DRAIN_DEADLINE_EXCEEDED,
                               f"{pod.name} left the rollout set {deadline_s} s ago (the drain deadline) and {still}: "
                               "deleting it anyway; its requests in flight are sent again to the other servers"))
    return out


def scale_message(before: int, after: int) -> str:
    if after > before:
        return f"rollout scaled from {before} to {after} servers: creating {after - before} rollout pod(s)"
    return (f"rollout scaled from {before} to {after} servers: the learner drains {before - after} server(s), "
            "then their pods are deleted")



def gang_scale_in_effect(spec: GRPORunSpec, configured_servers: int | None) -> tuple[GRPORunSpec, str | None]:
    """The spec to run a live run by, and why its replica change is refused. A gang (its PodGroup's minMember counts
    every pod) keeps the `configured_servers` it started with (the count its run config lists; None when unread).
    A Kueue run's rule is admission.within_admission."""
    if not (spec.scheduling and spec.scheduling.gang):
        return spec, None
    if configured_servers is None or configured_servers == spec.rollout.replicas:
        return spec, None
    message = (f"spec.rollout.replicas: {spec.rollout.replicas} is not applied to the running run, which keeps "
               f"{configured_servers} rollout servers: its pods are one gang (spec.scheduling.gang) whose PodGroup "
               f"counts them; set it back to {configured_servers}, or create a new run with the count you need")
    in_effect = spec.rollout.model_copy(update={"replicas": configured_servers})
    return spec.model_copy(update={"rollout": in_effect}), message
