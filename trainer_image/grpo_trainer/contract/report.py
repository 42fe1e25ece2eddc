"""What the learner reports: `GET /progress` while it runs, and the same `ProgressReport` as its termination message
when it ends. The operator reads it from a tenant's pod and copies it into the run's status."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError, field_validator

from .codes import (
    DROP_REASONS,
    EXPORT_MANIFEST_FILE,
    MASK_REASONS,
    TERMINATION_MESSAGE_MAX_BYTES,
    AttentionKernel,
    LearnerPhase,
    ReplicaState,
    StallCause,
)
from .wire import Count, ReportModel, error_message, field_path, known_or_text, reason_counts


class RolloutReplicaReport(ReportModel):
    """One rollout server as the learner sees it (its route, the router's tallies and the weight sync's version)."""

    replica: Count = Field(description="The rollout pod's ordinal (its index in rollout.urls while it is in it).")
    url: str
    ready: bool = False
    state: known_or_text(ReplicaState) = ReplicaState.SERVING
    # `vN`; bounded because it is copied into status.rollout.servers[].weightVersion.
    weight_version: str | None = Field(None, max_length=64, description="The weight version directory it serves.")
    samples: Count = Field(0, description="Completions it produced for the learner.")
    failures: Count = Field(0, description="Requests that failed on it (each retried on another server).")
    retried: Count = 0
    request_seconds: float = Field(0.0, ge=0, description="Requests in flight on it, integrated over time: its share "
                                   "of the concurrent work, which least outstanding requests keeps equal.")
    last_error: str = ""


class ExportReport(ReportModel):
    """The model the learner exported at the end of the run; the operator copies it into `status.output`."""

    uri: str = Field(min_length=1, max_length=1024, description="Where users find the model (OutputConfig.uri).")
    path: str = Field(min_length=1, max_length=1024, description="The model's folder, as the learner sees it.")
    step: Count = Field(description="The optimizer step the exported weights are from.")
    bytes: Count = Field(description="The exported files' total size, the manifest included.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description=f"The sha256 of {EXPORT_MANIFEST_FILE}.")
    time: float = Field(ge=0, le=253402300799, description="Unix time the export completed (before year 10000).")


class CheckpointReport(ReportModel):
    """The newest checkpoint up in the object store (checkpoint.uri); the operator copies it into
    `status.checkpoint`."""

    step: Count = Field(description="The optimizer step it was saved at.")
    uri: str = Field(min_length=1, max_length=1024, description="Where it is: s3://BUCKET/PREFIX/checkpoint-STEP.")
    time: float = Field(ge=0, le=253402300799, description="Unix time its upload completed (before year 10000).")


class EpisodeReport(ReportModel):
    """The episodes of a run with tools or environments (grpo_trainer.agentic.episodes), counted as they reach the
    learner by this learner process (from 0 after a resume): every conversation of every group, whatever became of
    it."""

    episodes: Count = Field(0, description="Conversations the rollout worker finished.")
    rows: Count = Field(0, description="Training rows they became (more than one: re-tokenization forked).")
    turns: Count = Field(0, description="Model turns, summed.")
    tool_calls: Count = 0
    tool_failures: Count = Field(0, description="Tool calls that raised or named no tool (TRL's count).")
    forked: Count = Field(0, description="Episodes that became more than one training row.")
    environment_failures: dict[str, Count] = Field(
        default_factory=dict, description="Episodes whose environment failed (unscorable), by environment.")

    @field_validator("environment_failures")
    @classmethod
    def _environments(cls, value: dict[str, int]) -> dict[str, int]:
        return reason_counts((), "environments", value)

    @property
    def turns_per_episode(self) -> float | None:
        return self.turns / self.episodes if self.episodes else None

    @property
    def fork_fraction(self) -> float | None:
        return self.forked / self.episodes if self.episodes else None


#: A line of `ProgressReport.tracking_degraded` (the learner clips longer ones: a tracking URI has no bound).
TRACKING_DEGRADED_LINE_MAX_CHARS = 512


class TrackedRunReport(ReportModel):
    """The experiment tracker's run the learner reports to (spec.tracking); the operator copies it into
    `status.tracking`, so users find the run's curves from the GRPORun."""

    tracker: str = Field(min_length=1, max_length=32, description="The tracker, by its spec.tracking name.")
    run_id: str = Field(min_length=1, max_length=128, description="The run's id in the tracker.")
    uri: str = Field(min_length=1, max_length=1024, description="Where a user opens the run (MLflow, W&B online: "
                     "its page; TensorBoard: the event files' directory; W&B offline: the run's directory).")


class TrackerLossReport(ReportModel):
    """A tracker dropped mid-run: a call to it failed or did not finish in time, and the run went on without it
    (grpo_trainer.learner.tracking.guard); the run's metrics from `since` on are not in it."""

    tracker: str = Field(min_length=1, max_length=32, description="The tracker, by its spec.tracking name.")
    since: float = Field(ge=0, le=253402300799, description="Unix time the learner dropped it (before year 10000).")
    reason: str = Field(max_length=TRACKING_DEGRADED_LINE_MAX_CHARS, description="What failed, and where it "
                        "reports (the tracking URI, the directory).")


class ProgressReport(ReportModel):
    phase: known_or_text(LearnerPhase) = LearnerPhase.STARTING
    groups_total: Count = Field(0, description="Groups the run must consume: prompts x epochs.")
    groups_consumed: Count = 0
    groups_trained: Count = 0
    groups_collated: Count = Field(0, description="Groups counted at collation by this learner process (from 0 "
                                   "after a resume); never decreases.")
    groups_returned: Count = Field(
        0, description="Collated groups a stop returned before their optimizer step, in this learner process; "
        "never decreases."
    )
    dropped: dict[str, Count] = Field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    epochs_done: Count = 0
    epochs: float = Field(1, gt=0)
    stall_streak: Count = Field(0, description="Groups consumed in a row without one training.")
    stall_limit: Count = 0
    global_step: Count = 0
    last_trained_time: float | None = Field(None, description="Unix time of the last trained group.")
    reward_mean: float | None = None
    weight_syncs: Count = 0
    samples_scored: Count = Field(0, description="Samples the training step's scoring saw (every rank).")
    samples_masked: dict[str, Count] = Field(
        default_factory=lambda: dict.fromkeys(MASK_REASONS, 0),
        description="Samples it took out of the loss, by reason.")
    weight_sync_seconds: float = Field(0.0, ge=0, description="Time spent in weight syncs, summed.")
    weight_sync_last_seconds: float | None = Field(None, ge=0, description="How long the last finished sync took.")
    weight_sync_running_seconds: float = Field(0.0, ge=0, description="How long the sync now running has run.")
    weight_sync_deadline_seconds: float | None = Field(None, gt=0)
    weight_version: Count = Field(0, description="N of the vN the learner last pushed (0: the initial weights).")
    stalled: bool | None = Field(None, description="The learner's stall verdict (its rules, which the operator "
                                 "shows as they are); None from a learner older than the field.")
    stall_cause: known_or_text(StallCause) | None = Field(None, description="Set when stalled: what stalled.")
    regenerated: Count = Field(0, description="Groups regenerated (stale, or left untrained by an environment's "
                               "failure): neither trained nor dropped; a later group took each one's place.")
    regenerated_environment: Count = Field(
        0, description="Of `regenerated`, the groups regenerated because an environment failed their episodes.")
    rollout_wait_seconds: float = Field(0.0, ge=0, description="Seconds this learner process waited for a sample "
                                        "from the rollout queue, the wait in progress included; never decreases.")
    rollout_queue_samples: Count | None = Field(None, description="Scored samples waiting in the rollout queue "
                                                "(None before the queue exists).")
    rollout: list[RolloutReplicaReport] = Field(default_factory=list)
    output: ExportReport | None = Field(None, description="The exported model, once written (spec.output).")
    model_digest: str | None = Field(None, max_length=128, description="The content digest of the model this "
                                     "learner loaded, for an s3:// model or a path holding an export manifest "
                                     "(the operator pins the run to it: status.model.revision); None otherwise.")
    checkpoint: CheckpointReport | None = Field(
        None, description="The newest checkpoint this learner process uploaded to checkpoint.uri; None before one.")
    tracking: list[TrackedRunReport] = Field(default_factory=list, max_length=3, description="The trackers' runs, "
                                             "once they started (spec.tracking).")
    tracking_degraded: list[Annotated[str, Field(max_length=TRACKING_DEGRADED_LINE_MAX_CHARS)]] = Field(
        default_factory=list, max_length=3, description="A line for each tracker that does not get the run's "
        "metrics: left out at start, not answering (spec.tracking.onUnavailable: continue).")
    tracking_lost: list[TrackerLossReport] = Field(default_factory=list, max_length=3, description="The trackers "
                                                   "dropped mid-run, which lost the run's metrics from then on.")
    attention_kernel: known_or_text(AttentionKernel) | None = Field(
        None, description="The kernel answering the tree attention; None before the learner chose one.")
    episodes: EpisodeReport | None = Field(None, description="Tool calls and environments; None without them.")
    environment_wait: str | None = Field(
        None, max_length=1024, description="Set while an environment has no ready server and no episode starts: "
        "'waiting for environment guess: 0/2 ready'.")
    message: str = ""

    @field_validator("dropped")
    @classmethod
    def _drop_reasons(cls, value: dict[str, int]) -> dict[str, int]:
        return reason_counts(DROP_REASONS, "drop reasons", value)  # status.progress.groupsDropped is their sum

    @field_validator("samples_masked")
    @classmethod
    def _mask_reasons(cls, value: dict[str, int]) -> dict[str, int]:
        return reason_counts(MASK_REASONS, "mask reasons", value)

    @property
    def masked_fraction(self) -> float | None:
        """Of the samples the training step scored, the fraction it took out of the loss."""
        return sum(self.samples_masked.values()) / self.samples_scored if self.samples_scored else None

    @property
    def stall_verdict(self) -> bool:
        """Whether the learner says it stalled: `stalled`, or from a learner older than it, its phase."""
        return self.stalled if self.stalled is not None else self.phase == LearnerPhase.STALLED

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def ended_short(self) -> bool:
        """A run that succeeded before its epoch bound: TRL's `max_steps` (the user's, or its ceiling) ended it."""
        return self.phase == LearnerPhase.SUCCEEDED and self.groups_consumed < self.groups_total

    @property
    def percent(self) -> float:
        return 100.0 * min(self.groups_consumed, self.groups_total) / self.groups_total if self.groups_total else 0.0

    def termination_message(self) -> str:
        """The report as JSON that fits Kubernetes' 4096-byte termination message, message shortened first."""
        text = self.model_dump_json(by_alias=True)
        overflow = len(text.encode()) - TERMINATION_MESSAGE_MAX_BYTES
        if overflow > 0 and self.rollout:  # per-server detail goes first: the operator polls it while running
            return self.model_copy(update={"rollout": []}).termination_message()
        if overflow > 0 and self.tracking:  # then the trackers' runs, which the status keeps from /progress
            return self.model_copy(update={"tracking": []}).termination_message()
        if overflow > 0:
            kept = max(0, len(self.message) - overflow - 3)
            short = self.model_copy(update={"message": self.message[:kept] + "..."})
            text = short.model_dump_json(by_alias=True)
        return text


class InvalidReport(ValueError):
    """A progress report that is not valid, as one line naming each field that is wrong (`globalStep: ...`)."""


def parse_progress(text: str | bytes) -> ProgressReport:
    """A /progress body or termination message. Strict types (`"5"` or `true` is no count): it comes from a pod.
    Raises InvalidReport naming the fields."""
    try:
        return ProgressReport.model_validate_json(text, strict=True)
    except ValidationError as error:
        errors = error.errors()
        problems = [f"{field_path('', e['loc']) or 'report'}: {error_message(e)}" for e in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""  # it ends up in a condition message
        raise InvalidReport("; ".join(problems) + more) from None

