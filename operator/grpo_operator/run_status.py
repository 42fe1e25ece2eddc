"""The GRPORun's status subresource: phases, conditions and their reasons, and the models of what the operator
writes. Every field here is declared in the CRD's status schema (tests/crds/test_grporun_schema.py walks both): the API
server silently prunes undeclared status fields."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import ConfigDict, Field

from grpo_trainer.contract.codes import ReplicaState
from grpo_trainer.contract.wire import WireModel

from .eta import ProgressRate, TrainerStatus


class Phase(str, Enum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINISHED_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(str, Enum):
    ROLLOUT_READY = "RolloutReady"
    ENVIRONMENTS_READY = "EnvironmentsReady"  # a run with spec.environments only
    PROGRESSING = "Progressing"
    STALLED = "Stalled"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    TRACKING_DEGRADED = "TrackingDegraded"


class Reason:
    """Stable condition and event reasons (alerts, `kubectl wait` and docs/operator.md rely on these strings)."""

    CREATED = "Created"
    PODS_PENDING = "PodsPending"
    STARTING = "Starting"
    TRAINING = "Training"
    # Progressing=False while the learner waits for an environment with no ready server (its /progress says which):
    # the progress clock pauses, and the learner itself ends the run past spec.environments[].unavailableSeconds.
    WAITING_FOR_ENVIRONMENT = "WaitingForEnvironment"
    ROLLOUT_READY = ConditionType.ROLLOUT_READY.value  # the event when every rollout server turns ready
    ALL_REPLICAS_READY = "AllReplicasReady"
    REPLICAS_NOT_READY = "ReplicasNotReady"
    ENVIRONMENTS_READY = ConditionType.ENVIRONMENTS_READY.value  # the event when every environment server turns ready
    ALL_ENVIRONMENTS_READY = "AllEnvironmentsReady"
    ENVIRONMENTS_NOT_READY = "EnvironmentsNotReady"
    SCALED = "Scaled"  # the event when spec.rollout.replicas or an environment's replicas changes on a live run
    DRAINED = "Drained"  # the event when a removed rollout server's pod is deleted after the learner let it go
    DRAIN_DEADLINE_EXCEEDED = "DrainDeadlineExceeded"  # ... deleted while the learner still reported it
    SCALE_REFUSED = "ScaleRefused"  # a live replica change the run's admission (Kueue, a gang) cannot take
    ROLLOUT_RESTARTED = "RolloutRestarted"  # the event when a rollout server that exited is replaced
    ROLLOUT_RESTARTING = "RolloutRestarting"  # RolloutReady=False while a replaced server is not ready yet
    ROLLOUT_RESTART_LIMIT_EXCEEDED = "RolloutRestartLimitExceeded"
    TRACKERS_UNAVAILABLE = "TrackersUnavailable"  # TrackingDegraded: a tracker does not get the run's metrics
    TRACKERS_REPORTING = "TrackersReporting"  # TrackingDegraded=False: a later learner start reached every tracker
    METRICS_LOST = "MetricsLost"  # TrackingDegraded, and its event: a tracker dropped mid-run lost the run's metrics
    STALL_LIMIT_REACHED = "StallLimitReached"
    WEIGHT_SYNC_STUCK = "WeightSyncStuck"  # a weight sync outlived rollout.weightSync.deadlineSeconds
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    PROGRESS_RESUMED = "ProgressResumed"
    NOT_STALLED = "NotStalled"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    NOT_SUSPENDED = "NotSuspended"
    RESTARTING = "Restarting"
    EPOCH_BOUND_REACHED = "EpochBoundReached"
    MAX_STEPS_REACHED = "MaxStepsReached"
    STALLED = "Stalled"
    INVALID_CONFIG = "InvalidConfig"
    INVALID_SPEC = "InvalidSpec"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DISRUPTED = "Disrupted"  # the event when a disruption restarts pods
    DISRUPTION_LIMIT_EXCEEDED = "DisruptionLimitExceeded"
    POD_FAILURE_POLICY = "PodFailurePolicy"
    POD_TERMINATING = "PodTerminating"
    PROGRESS_UNKNOWN = "ProgressUnknown"
    CREATE_FAILED = "CreateFailed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    STARTUP_DEADLINE_EXCEEDED = "StartupDeadlineExceeded"
    UNSCHEDULABLE = "Unschedulable"
    RESOLVING_REVISION = "ResolvingRevision"  # the run waits for the hub to name the commit of its model or dataset
    FIT_WARNING = "LikelyOutOfMemory"  # the event when the fit check estimates the learner past its GPU's memory
    OOM_KILLED = "OOMKilled"  # the kubelet's reason for a container the kernel killed for its memory
    WAITING_FOR_ADMISSION = "WaitingForAdmission"  # Kueue has not admitted the run's Workload (yet, or again)
    EVICTED = "Evicted"  # Kueue evicted or preempted the run's Workload
    NOT_FINISHED = "NotFinished"
    FINISHED = "Finished"
    EXPORTED = "Exported"  # the event when the learner wrote the trained model to spec.output
    EXPORT_FAILED = "ExportFailed"  # the model could not be written to spec.output: the run fails
    WORK_NOT_KEPT = "WorkNotKept"  # the Warning events a run starts with when a pod's end loses checkpoints or model


class _StatusModel(WireModel):
    # Reading status must survive a field written by a newer operator version; writing still uses these fields only.
    model_config = ConfigDict(extra="ignore")


class Condition(_StatusModel):
    """metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class ProgressClock(_StatusModel):
    """Anchors of the stall clock, kept in status so an operator restart does not reset it."""

    anchor_time: str | None = None  # when the clock last restarted: a trained group, or the start of running
    paused_seconds: float = 0.0  # seconds since anchor_time spent suspended or pending, not counted as stalled
    paused_since: str | None = None  # set while the clock is paused


class EpisodeStatus(_StatusModel):
    """ProgressReport.episodes (a run with tools or environments), counted by the learner process now running."""

    episodes: int = 0
    rows: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    forked: int = 0
    environment_failures: dict[str, int] = Field(default_factory=dict)  # by environment


class ProgressStatus(_StatusModel):
    epoch: int = 0
    epochs: float = 1
    groups_consumed: int = 0
    groups_total: int = 0
    groups_trained: int = 0
    groups_dropped: int = 0
    groups_regenerated: int = 0  # ProgressReport.regenerated: neither trained nor dropped
    groups_regenerated_environment: int = 0  # of those, left untrained by an environment's failure
    # Keys are grpo_trainer.contract.codes.DROP_REASONS (snake_case on the wire, like the learner's /progress).
    dropped: dict[str, int] = Field(default_factory=dict)
    stall_streak: int = 0
    stall_limit: int = 0
    # The learner's stall verdict and its cause (ProgressReport.stall_verdict): the operator has no stall rule of its
    # own, only its clock (progressDeadlineSeconds).
    stalled: bool = False
    stall_cause: str | None = None
    global_step: int = 0
    percent: float = 0.0
    reward_mean: float | None = None
    masked_fraction: float | None = None  # ProgressReport.masked_fraction: the training step's scoring
    episodes: EpisodeStatus | None = None  # None for a run without tools or environments
    # KEP-2779's names (Kubeflow TrainJob progress); filled by grpo_operator.eta.
    progress_percentage: int | None = None
    estimated_remaining_seconds: int | None = None
    last_updated_time: str | None = None


class RolloutServerStatus(_StatusModel):
    """One rollout server: its pod as the operator sees it, and the learner's view of it (its `/progress`)."""

    replica: int
    pod: str | None = None
    ready: bool = False  # the pod's Ready condition
    serving: bool | None = None  # the learner sends it generation requests
    weight_version: str | None = None
    samples: int | None = None
    restarts: int = 0  # counted against runPolicy.rolloutRestartLimit
    last_error: str | None = None  # the engine's error line at its last exit
    state: ReplicaState | None = None  # the learner's: joining, serving or draining
    drain_start_time: str | None = None  # when its URL left the run config (scaled down); its pod goes once drained


class RemovedServerStatus(_StatusModel):
    """A server a scale-down removed that had restarted: its count holds again if a scale-up brings it back."""

    replica: int
    restarts: int = 0
    last_error: str | None = None


class RolloutStatus(_StatusModel):
    replicas: int = 0  # rollout pods that exist (the scale subresource's status replicas)
    ready: int = 0  # of the servers wanted (spec.rollout.replicas), those whose pod is Ready
    restarts: int = 0  # all servers', removed ones' included
    selector: str | None = None  # the rollout pods' label selector (the scale subresource's)
    scale_refused: str | None = None  # why a live change of spec.rollout.replicas is not applied
    servers: list[RolloutServerStatus] = Field(default_factory=list)
    removed_servers: list[RemovedServerStatus] | None = None  # None when no removed server had restarted


class LearnerStatus(_StatusModel):
    nodes: int = 0
    ready: int = 0
    restarts: int = 0


class EnvironmentStatus(_StatusModel):
    """One environment of spec.environments: its server pods as the operator sees them."""

    name: str
    wanted: int = 0  # spec.environments[].replicas in effect (within what Kueue admitted)
    replicas: int = 0  # server pods that exist
    ready: int = 0  # of those, the Ready ones
    restarts: int = 0  # the kubelet's in-place restarts of the servers that exist
    scale_refused: str | None = None  # why a larger spec.environments[].replicas is not applied


class FailureStatus(_StatusModel):
    role: Literal["rollout", "learner", "operator"] | None = None
    pod: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None


class OutputStatus(_StatusModel):
    """The trained model the learner exported to spec.output (its report, grpo_trainer.contract.report.ExportReport)."""

    uri: str
    step: int
    bytes: int
    sha256: str  # of the export's manifest, which lists every file's sha256
    time: str


class CheckpointStatus(_StatusModel):
    """The newest checkpoint in the object store (spec.checkpoint.uri), as the learner reported it
    (grpo_trainer.contract.report.CheckpointReport)."""

    step: int
    uri: str
    time: str


class PinnedRevision(_StatusModel):
    """A hub model's or dataset's commit, resolved once from the revision the spec asked for: what every pod loads;
    or the content digest of a model off the hub as its learner first loaded it (status/revision.py)."""

    name: str  # the hub id (spec.model, spec.dataset.name), or the model's s3:// URI or path
    requested: str  # the branch, tag or commit the spec asked for (main when it named none); `digest`
    revision: str  # the commit, or the content digest


class TrackedRunStatus(_StatusModel):
    """An experiment tracker's run the learner reports to (its report,
    grpo_trainer.contract.report.TrackedRunReport)."""

    tracker: str
    run_id: str
    uri: str


class GRPORunStatus(_StatusModel):
    phase: Phase | None = None
    observed_generation: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    last_progress_time: str | None = None
    progress_clock: ProgressClock | None = None
    progress_rate: ProgressRate | None = None
    restarts: int = 0
    disruptions: int = 0
    conditions: list[Condition] = Field(default_factory=list)
    progress: ProgressStatus | None = None
    trainer_status: TrainerStatus | None = None  # Kubeflow Trainer's view of `progress` (grpo_operator.eta)
    rollout: RolloutStatus | None = None
    learner: LearnerStatus | None = None
    environments: list[EnvironmentStatus] | None = None  # None for a run without spec.environments
    failure: FailureStatus | None = None
    output: OutputStatus | None = None
    checkpoint: CheckpointStatus | None = None  # None until a checkpoint is up in spec.checkpoint.uri
    tracking: list[TrackedRunStatus] | None = None
    model: PinnedRevision | None = None  # None: unpinned, not resolved or reported yet, or a folder without a manifest
    dataset: PinnedRevision | None = None  # likewise for spec.dataset.name
    message: str | None = None


def parse_status(status: dict[str, Any] | None) -> GRPORunStatus:
    return GRPORunStatus.model_validate(status or {})


def dump_status(status: GRPORunStatus) -> dict[str, Any]:
    """A status as the API server stores it (camelCase, unset fields left out): parse_status's inverse."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
