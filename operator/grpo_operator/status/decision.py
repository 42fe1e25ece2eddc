"""What the pure derivation reads (Observation, of PodObservations) and returns (Decision: status, events, actions)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_trainer.contract.report import ProgressReport

from .revision import HubPins

Role = Literal["rollout", "learner", "environment"]


@dataclass(frozen=True)
class ProbeFailure:
    """The kubelet's latest probe failure of a pod, as its `Unhealthy` Event tells it (the Event counts repeats)."""

    probe: str  # readiness | liveness | startup
    cause: str  # what the kubelet said after `Readiness probe failed: ` (`Get "http://...": dial tcp ...: ...`)
    count: int  # how many times it failed so
    seconds: float  # from the first of those failures to the latest


@dataclass(frozen=True)
class PodObservation:
    """What the operator needs to know about one pod (the kopf layer and `grporun local` both produce these)."""

    name: str
    role: Role
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None  # the container's termination message
    waiting_reason: str | None = None
    terminating: bool = False  # being deleted: it still holds its name (and its slot) until it is gone
    disruption: str | None = None  # the reason of a True DisruptionTarget condition (eviction, preemption, ...)
    attempt: int | None = None  # the restart count the pod was created at (its attempt annotation)
    rollout_restarts: int | None = None  # a rollout pod: its server's restart count when it was created
    conditions: frozenset[str] = frozenset()  # the types of its True conditions (for runPolicy.podFailurePolicy)
    container: str | None = None  # the main container's name (the role's)
    memory_limit: str | None = None  # the main container's resources.limits.memory, as written (`16Gi`)
    container_restarts: int = 0  # the kubelet's in-place restarts of the main container (restartPolicy Always)
    not_ready: str | None = None  # why its Ready condition is False, as the condition says (`reason: message`)
    #: A running pod that is not ready: its latest probe failure, when the cluster's Events were read for it.
    probe_failure: ProbeFailure | None = None
    #: The main container's image by digest, as the kubelet reports it once the container started (`imageID`).
    image_id: str | None = None


@dataclass(frozen=True)
class WorkloadObservation:
    """What the pass saw of a queued run's Kueue Workload (a run with no queue has none: Observation.workload None)."""

    exists: bool
    reserved: bool = False  # it holds quota (QuotaReserved)
    evicted: bool = False
    finished: bool = False  # marked Finished
    resizable: bool = False  # it holds no quota and its pod sets' counts differ from the spec's


@dataclass(frozen=True)
class CreateRejection:
    """The API server refused an object of the run as invalid (HTTP 400/422, or a PodSecurity refusal)."""

    message: str
    #: The pods the refused pass had created before the refusal: they may not be among the observed pods yet.
    created_pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observation:
    """What the operator saw of a run in one pass, besides its spec and last status."""

    #: The run's own pods; those being deleted (the ones the operator just deleted included) marked `terminating`.
    pods: list[PodObservation]
    #: The learner's last `/progress`, None when there is none to read.
    progress: ProgressReport | None
    now: datetime.datetime
    #: False when the ConfigMap and Services may be missing (right after an operator restart, say): creating
    #: children is idempotent, so the pass asks for it.
    children_exist: bool = True
    #: Why the running learner's `/progress` could not be read this time; `progress_lost`: several times in a row.
    progress_error: str | None = None
    progress_lost: bool = False
    #: Why creating children failed last time (a transient API error, retried).
    create_error: str | None = None
    #: (reason, message) that keeps the run suspended for a reason outside its spec: Kueue has not admitted it, or
    #: evicted it.
    hold: tuple[str, str] | None = None
    #: Why a live change of spec.rollout.replicas is not applied (the run's admission counts its pods); the spec
    #: handed to the derivation then has the replica count in effect.
    scale_refused: str | None = None
    #: By environment name: why a live change of its replicas is not applied (Kueue admitted fewer of its servers);
    #: the spec handed to the derivation then has the count in effect.
    environment_scale_refused: Mapping[str, str] = field(default_factory=dict)
    #: How many servers the run config's `rollout.urls` lists (as last read or written); None when not known (no
    #: live pods, or no ConfigMap yet). A live run's config is rewritten while it differs from the spec's count.
    configured_servers: int | None = None
    #: The image digests the run config's `images` records, by role (status/images.py); None when not known.
    configured_images: Mapping[str, Sequence[str]] | None = None
    #: grporun local: checkpoints and the model stay in the run's folder on this machine, whatever the spec's
    #: volumes say (the run's start warns of no lost work).
    work_kept_locally: bool = False
    #: The run's Kueue Workload as read this pass; None for a run that names no queue.
    workload: WorkloadObservation | None = None
    #: Why the run's spec cannot be run, the field named: a stored spec the operator cannot parse (the derivation
    #: then gets no spec), or one the fit check finds past its GPU's memory. The run fails as InvalidSpec.
    spec_error: str | None = None
    #: An object made from the spec that the API server refused as invalid (a child, the Kueue Workload) when an
    #: earlier pass created it: the same object would be refused again, so the run fails as InvalidSpec.
    create_rejected: CreateRejection | None = None
    #: The fit check's warnings (a likely misfit), on the pass that ran it: posted as events.
    fit_warnings: tuple[str, ...] = ()
    #: The commits the hub named for the spec's unpinned revisions, or why it named none (status/revision.py); None
    #: when it was not asked this pass.
    pins: HubPins | None = None


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


class Action:
    """Something the I/O layer must do after writing the status."""


@dataclass(frozen=True)
class CreateChildren(Action):
    """Create the ConfigMap, Services and every missing pod (idempotent: 409 means it is there already). On a run
    whose pods exist, the run config's `rollout.urls` first list spec.rollout.replicas servers (a scale-up)."""


@dataclass(frozen=True)
class ConfigureRollout(Action):
    """Make the run config's `rollout.urls` (in the run's ConfigMap) list these servers, first of this pass's
    actions: after a scale-down, a removed server's URL leaves it before its pod may go; after a scale back up, a
    server still draining joins it again (idempotent; a missing ConfigMap is left to CreateChildren)."""

    replicas: int


@dataclass(frozen=True)
class RecordImages(Action):
    """Write these image digests, by role, to the run config's `images` (for the export's provenance)."""

    images: Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class DeletePods(Action):
    pods: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class RecreatePods(Action):
    """Delete these pods; the next pass finds them missing and creates them again (the learner resumes)."""

    pods: tuple[str, ...]


@dataclass(frozen=True)
class DeleteRun(Action):
    """ttlSecondsAfterFinished has elapsed: delete the GRPORun (its children go with it by ownerReference)."""


@dataclass(frozen=True)
class CreateWorkload(Action):
    """Create the run's Workload, its pod sets the run's own pods (Kueue counts their real requests)."""


@dataclass(frozen=True)
class ReleaseQuota(Action):
    """Give back an evicted Workload's quota reservation: its pods are gone, so Kueue may queue it again."""


@dataclass(frozen=True)
class ResizeWorkload(Action):
    """Write the spec's pod counts into the Workload's pod sets (it holds no quota, so Kueue admits the new size)."""


@dataclass(frozen=True)
class FinishWorkload(Action):
    """Mark the Workload Finished: the run has ended, and Kueue frees the quota it holds."""


@dataclass(frozen=True)
class Decision:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)


def rank(pod_name: str) -> int:
    """The replica index or learner rank a pod name ends in (`run-learner-1` -> 1)."""
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
