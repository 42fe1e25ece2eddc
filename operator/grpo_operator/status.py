"""Pure status derivation: (spec, last status, pods, learner progress, now) -> new status, events, actions.

Everything the operator decides lives here, with no I/O and no clock of its own (`now` is an input), so the kopf
handlers and `grporun local` share one state machine and the tests can replay any lifecycle step by step.

Rules worth knowing (issue 4 and OPERATOR.md):
- Phases: Pending -> Starting -> Running -> Succeeded | Failed, and Suspended. `status.phase` is the real state, not
  the last condition (Kubeflow's `State=conditions[-1]` column shows stale states, kubeflow/trainer#3666).
- Exit codes are the learner <-> operator contract: 0 succeeds, EXIT_STALLED and EXIT_INVALID_CONFIG fail at once
  (a retry cannot help), anything else restarts the pods within `runPolicy.backoffLimit` (the learner resumes from
  its last checkpoint), then fails with the termination message in `status.failure`.
- The stall clock measures inactivity, not age: it runs only while Running, pauses while Pending/Starting/Suspended
  (queued, pulling, loading and suspended runs are not stalled), restarts on every trained group, and its anchors
  live in `status.progressClock` so an operator restart neither resets nor skips it.
- A finished run never gets CreateChildren (kubeflow#2991 recreated children of finished jobs in a loop); it only
  cleans pods per `cleanPodPolicy` and, past `ttlSecondsAfterFinished`, asks for its own deletion.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from grpo_trainer.contract import (
    EXIT_STALLED,
    EXIT_SUCCEEDED,
    PERMANENT_EXIT_CODES,
    ProgressReport,
    parse_progress,
)

from .eta import update_estimate
from .spec import (
    FINISHED_PHASES,
    Condition,
    ConditionType,
    FailureStatus,
    GRPORunSpec,
    GRPORunStatus,
    LearnerStatus,
    Phase,
    ProgressClock,
    ProgressStatus,
    RolloutStatus,
    parse_status,
)

Role = Literal["rollout", "learner"]

#: Waiting reasons that mean a pod will not start by itself; surfaced on the run (KubeRay #1990: a job stuck in
#: Initializing forever on an image-pull error).
STUCK_WAITING_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError",
})
FAILURE_MESSAGE_MAX_CHARS = 1024


class Reason:
    """Stable condition and event reasons (alerts, `kubectl wait` and the docs rely on these strings)."""

    CREATED = "Created"
    PODS_PENDING = "PodsPending"
    STARTING = "Starting"
    TRAINING = "Training"
    ALL_REPLICAS_READY = "AllReplicasReady"
    REPLICAS_NOT_READY = "ReplicasNotReady"
    STALL_LIMIT_REACHED = "StallLimitReached"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    PROGRESS_RESUMED = "ProgressResumed"
    NOT_STALLED = "NotStalled"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    NOT_SUSPENDED = "NotSuspended"
    RESTARTING = "Restarting"
    EPOCH_BOUND_REACHED = "EpochBoundReached"
    STALLED = "Stalled"
    INVALID_CONFIG = "InvalidConfig"
    INVALID_SPEC = "InvalidSpec"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    STARTUP_DEADLINE_EXCEEDED = "StartupDeadlineExceeded"
    UNSCHEDULABLE = "Unschedulable"
    RUNNING = "Running"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"  # Kueue has not admitted the run's Workload (yet, or again)
    EVICTED = "Evicted"  # Kueue evicted or preempted the run's Workload
    NOT_FINISHED = "NotFinished"
    FINISHED = "Finished"


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
    restarts: int = 0
    waiting_reason: str | None = None


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


class Action:
    """Something the I/O layer must do after writing the status."""


@dataclass(frozen=True)
class CreateChildren(Action):
    """Create the ConfigMap, Services and every missing pod (idempotent: 409 means it is there already)."""


@dataclass(frozen=True)
class DeletePods(Action):
    pods: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class RecreatePods(Action):
    """Delete these pods; the next pass finds them missing and creates them again (the learner resumes)."""

    pods: tuple[str, ...]
    attempt: int


@dataclass(frozen=True)
class DeleteRun(Action):
    """ttlSecondsAfterFinished has elapsed: delete the GRPORun (its children go with it by ownerReference)."""


@dataclass(frozen=True)
class Decision:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------------
# Time helpers: RFC 3339 with second precision, as the API server writes them.
# ---------------------------------------------------------------------------------------------------------------------
def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _seconds(later: datetime.datetime, earlier: str | None) -> float:
    return 0.0 if earlier is None else (later - parse_time(earlier)).total_seconds()


def progress_status(report: ProgressReport) -> ProgressStatus:
    return ProgressStatus(
        epoch=report.epochs_done, epochs=report.epochs, groups_consumed=report.groups_consumed,
        groups_total=report.groups_total, groups_trained=report.groups_trained, groups_dropped=report.dropped_total,
        dropped=dict(report.dropped), stall_streak=report.stall_streak, stall_limit=report.stall_limit,
        global_step=report.global_step, percent=round(report.percent, 1), reward_mean=report.reward_mean)


def report_from_termination_message(message: str | None) -> ProgressReport | None:
    """The learner writes its final ProgressReport as its termination message; anything else is a log tail."""
    if not message:
        return None
    try:
        return parse_progress(message)
    except (ValidationError, ValueError):
        return None


def failure_text(pod: PodObservation) -> str:
    report = report_from_termination_message(pod.message)
    text = report.message if report is not None and report.message else (pod.message or pod.reason or "")
    return text.strip()[-FAILURE_MESSAGE_MAX_CHARS:]


# ---------------------------------------------------------------------------------------------------------------------
# The derivation
# ---------------------------------------------------------------------------------------------------------------------
def derive_status(spec: GRPORunSpec, status: dict[str, Any] | None, pods: list[PodObservation],
                  progress: ProgressReport | None, now: datetime.datetime, *, generation: int,
                  children_exist: bool = True, hold: tuple[str, str] | None = None) -> Decision:
    """The next status of a run, the events its transitions emit and the actions the I/O layer must take.

    `pods` are the run's pods as observed (pods the operator deleted itself should be left out), `progress` the
    learner's last `/progress` (None when it could not be read), `children_exist` False when the ConfigMap and
    Services may be missing (e.g. right after an operator restart: CreateChildren is idempotent). `hold` (reason,
    message) keeps the run suspended for a reason outside its spec: Kueue has not admitted it, or evicted it.
    """
    derivation = _Derivation(spec, parse_status(status), pods, progress, now, generation)
    derivation.hold = hold
    derivation.decide(children_exist)
    return derivation.decision()


def invalid_spec_status(status: dict[str, Any] | None, error: Exception, now: datetime.datetime, *,
                        generation: int) -> Decision:
    """A spec the operator cannot run: Failed at once, with the field named (never an endless retry)."""
    old = parse_status(status)
    new = old.model_copy(deep=True)
    message = str(error)
    new.observed_generation = generation
    events = []
    if old.phase != Phase.FAILED or old.message != message:
        events.append(Event("Warning", Reason.INVALID_SPEC, message))
    new.phase = Phase.FAILED
    new.completion_time = old.completion_time or format_time(now)
    new.message = message
    new.failure = FailureStatus(role="operator", reason=Reason.INVALID_SPEC, message=message)
    conditions = _Conditions(new, now, generation)
    conditions.set(ConditionType.FAILED, "True", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.SUCCEEDED, "False", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.PROGRESSING, "False", Reason.INVALID_SPEC, message)
    return Decision(_wire(new), events, [])


_CONDITION_ORDER = [c.value for c in ConditionType]


class _Conditions:
    """metav1.Condition bookkeeping: lastTransitionTime moves only when the status value changes."""

    def __init__(self, status: GRPORunStatus, now: datetime.datetime, generation: int):
        self.status, self.now, self.generation = status, now, generation

    def get(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.status.conditions if c.type == kind.value), None)

    def is_true(self, kind: ConditionType) -> bool:
        condition = self.get(kind)
        return condition is not None and condition.status == "True"

    def set(self, kind: ConditionType, value: str, reason: str, message: str) -> bool:
        """Set a condition; True when its status value changed (a transition)."""
        current = self.get(kind)
        changed = current is None or current.status != value
        updated = Condition(
            type=kind.value, status=value, reason=reason, message=message, observed_generation=self.generation,
            last_transition_time=format_time(self.now) if changed else current.last_transition_time)
        others = [c for c in self.status.conditions if c.type != kind.value]
        self.status.conditions = sorted(
            others + [updated], key=lambda c: _CONDITION_ORDER.index(c.type) if c.type in _CONDITION_ORDER else 99)
        return changed


class _Derivation:
    def __init__(self, spec: GRPORunSpec, old: GRPORunStatus, pods: list[PodObservation],
                 progress: ProgressReport | None, now: datetime.datetime, generation: int):
        self.spec, self.old, self.now, self.generation = spec, old, now, generation
        self.new = old.model_copy(deep=True)
        self.new.observed_generation = generation
        self.conditions = _Conditions(self.new, now, generation)
        self.events: list[Event] = []
        self.actions: list[Action] = []
        self.pods = pods
        self.rollout_pods = sorted((p for p in pods if p.role == "rollout"), key=lambda p: p.name)
        self.learner_pods = sorted((p for p in pods if p.role == "learner"), key=lambda p: _rank(p.name))
        self.progress = progress
        self.hold: tuple[str, str] | None = None

    def decision(self) -> Decision:
        if self.new.progress is not None:
            self.new.progress_rate = update_estimate(
                self.new.progress, self.new.progress_rate, self.old.progress, self.now,
                running=self.new.phase == Phase.RUNNING, stalled=self.conditions.is_true(ConditionType.STALLED),
                succeeded=self.new.phase == Phase.SUCCEEDED)
        return Decision(_wire(self.new), self.events, self.actions)

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(kind, reason, message))

    # --- top level ---------------------------------------------------------------------------------------------
    def decide(self, children_exist: bool) -> None:
        if self.old.phase in FINISHED_PHASES:
            self._after_finish()
            return
        if not self.new.conditions:
            self._initial_conditions()
        self._count_pods()
        if self.spec.run_policy.suspend or self.hold is not None:
            self._suspend()
            return
        if self.old.phase == Phase.SUSPENDED:
            self._resume()
        if self.new.start_time is None:
            self.new.start_time = format_time(self.now)
        self._take_progress()
        if self._decide_on_exits():
            return
        missing = self._missing_pods()
        if missing or not children_exist:
            self.actions.append(CreateChildren())
        phase = self._running_phase(missing)
        self._tick_clock(running=phase == Phase.RUNNING)
        if self._check_deadlines() or self._check_stall(running=phase == Phase.RUNNING):
            return
        self._set_phase(phase)

    def _initial_conditions(self) -> None:
        set_ = self.conditions.set
        set_(ConditionType.ROLLOUT_READY, "False", Reason.REPLICAS_NOT_READY, "no rollout server is ready yet")
        set_(ConditionType.PROGRESSING, "False", Reason.PODS_PENDING, "creating pods")
        set_(ConditionType.STALLED, "False", Reason.NOT_STALLED, "")
        set_(ConditionType.SUSPENDED, "False", Reason.NOT_SUSPENDED, "")
        set_(ConditionType.SUCCEEDED, "False", Reason.NOT_FINISHED, "")
        set_(ConditionType.FAILED, "False", Reason.NOT_FINISHED, "")

    def _set_phase(self, phase: Phase) -> None:
        previous = self.new.phase
        self.new.phase = phase
        if previous == phase:
            return
        messages = {
            Phase.PENDING: f"creating {self.spec.rollout.replicas} rollout and {self.spec.learner.nodes} learner pods",
            Phase.STARTING: "pods are running; waiting for the rollout servers and the learner",
            Phase.RUNNING: "rollout servers ready, learner training",
            Phase.SUSPENDED: "spec.runPolicy.suspend is true: pods deleted, the run is kept",
        }
        reason = Reason.CREATED if previous is None else phase.value
        self.event("Normal", reason, messages.get(phase, phase.value))

    # --- observations ------------------------------------------------------------------------------------------
    def _count_pods(self) -> None:
        replicas = self.spec.rollout.replicas
        ready = sum(1 for p in self.rollout_pods if p.phase == "Running" and p.ready)
        self.new.rollout = RolloutStatus(replicas=replicas, ready=ready)
        learner_ready = sum(1 for p in self.learner_pods if p.phase == "Running")
        self.new.learner = LearnerStatus(nodes=self.spec.learner.nodes, ready=learner_ready, restarts=self.new.restarts)
        if ready == replicas:
            changed = self.conditions.set(ConditionType.ROLLOUT_READY, "True", Reason.ALL_REPLICAS_READY,
                                          f"{ready}/{replicas} rollout servers ready")
            if changed:
                self.event("Normal", "RolloutReady", f"{ready}/{replicas} rollout servers ready")
        else:
            self.conditions.set(ConditionType.ROLLOUT_READY, "False", Reason.REPLICAS_NOT_READY,
                                f"{ready}/{replicas} rollout servers ready")

    def _take_progress(self) -> None:
        report = self.progress
        if report is None:  # the learner is gone: its termination message carries the final report
            for pod in self.learner_pods:
                report = report or report_from_termination_message(pod.message)
        if report is None:
            return
        previous_trained = self.old.progress.groups_trained if self.old.progress else 0
        self.new.progress = progress_status(report)
        if report.groups_trained > previous_trained:
            self.new.last_progress_time = format_time(self.now)
            clock = self.new.progress_clock or ProgressClock()
            clock.anchor_time, clock.paused_seconds = format_time(self.now), 0.0
            clock.paused_since = None if clock.paused_since is None else format_time(self.now)
            self.new.progress_clock = clock

    def _missing_pods(self) -> list[tuple[str, int]]:
        present = {(p.role, _rank(p.name)) for p in self.pods}
        expected = [("rollout", i) for i in range(self.spec.rollout.replicas)]
        expected += [("learner", r) for r in range(self.spec.learner.nodes)]
        return [slot for slot in expected if slot not in present]

    def _running_phase(self, missing: list[tuple[str, int]]) -> Phase:
        if missing or any(p.phase in ("Pending", "Unknown") for p in self.pods):
            self._surface_waiting(default=(Reason.PODS_PENDING, "waiting for pods to be created and scheduled"))
            return Phase.PENDING
        all_ready = self.conditions.is_true(ConditionType.ROLLOUT_READY)
        learners_running = all(p.phase == "Running" for p in self.learner_pods)
        if all_ready and learners_running:
            return Phase.RUNNING
        self._surface_waiting(default=(Reason.STARTING, "pods running; waiting for the rollout servers to be ready"))
        return Phase.STARTING

    def _surface_waiting(self, default: tuple[str, str]) -> None:
        reason, message = default
        for pod in self.pods:
            if pod.waiting_reason in STUCK_WAITING_REASONS:
                reason, message = pod.waiting_reason, f"pod {pod.name}: {pod.waiting_reason}: {pod.message or ''}".strip()
                break
            if pod.phase == "Pending" and pod.reason == Reason.UNSCHEDULABLE:
                reason, message = Reason.UNSCHEDULABLE, f"pod {pod.name}: {pod.message or 'unschedulable'}"
                break
        previous = self.conditions.get(ConditionType.PROGRESSING)
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        if reason not in (Reason.PODS_PENDING, Reason.STARTING) and (previous is None or previous.reason != reason):
            self.event("Warning", reason, message)
        self.new.message = message if reason not in (Reason.PODS_PENDING, Reason.STARTING) else None

    # --- exits -------------------------------------------------------------------------------------------------
    def _decide_on_exits(self) -> bool:
        leader = next((p for p in self.learner_pods if _rank(p.name) == 0), None)
        if leader is not None and leader.phase == "Succeeded" and leader.exit_code in (EXIT_SUCCEEDED, None):
            self._finish(Phase.SUCCEEDED, Reason.EPOCH_BOUND_REACHED,
                         "the learner reached the epoch bound and exited 0")
            return True
        failed = [p for p in self.learner_pods if p.phase == "Failed"]
        failed += [p for p in self.rollout_pods if p.phase in ("Failed", "Succeeded")]  # a server never exits
        if not failed:
            return False
        first = failed[0]
        code = first.exit_code
        what = f"{first.role} pod {first.name} exited with code {code}" if code is not None else \
            f"{first.role} pod {first.name} failed ({first.reason or 'no exit code'})"
        detail = failure_text(first)
        failure = FailureStatus(role=first.role, pod=first.name, exit_code=code, reason=first.reason,
                                message=detail or None)
        if code in PERMANENT_EXIT_CODES:
            reason = Reason.STALLED if code == EXIT_STALLED else Reason.INVALID_CONFIG
            failure.reason = reason
            if reason == Reason.STALLED:
                self.conditions.set(ConditionType.STALLED, "True", Reason.STALLED, detail or what)
            self._finish(Phase.FAILED, reason, f"{what}: {detail}" if detail else what, failure)
            return True
        limit = self.spec.run_policy.backoff_limit
        if self.new.restarts >= limit:
            failure.reason = failure.reason or Reason.BACKOFF_LIMIT_EXCEEDED
            self._finish(Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED,
                         f"{what} after {self.new.restarts} restarts (backoffLimit {limit})"
                         + (f": {detail}" if detail else ""), failure)
            return True
        self.new.restarts += 1
        self.new.learner.restarts = self.new.restarts
        # accelerate's ranks rendezvous once: when one learner pod dies, the whole learner gang restarts.
        restart = {p.name for p in failed}
        if any(p.role == "learner" for p in failed):
            restart |= {p.name for p in self.learner_pods}
        self.actions.append(RecreatePods(tuple(sorted(restart)), attempt=self.new.restarts))
        self.event("Warning", Reason.RESTARTING,
                   f"{what}; restart {self.new.restarts}/{limit}, resuming from the last checkpoint"
                   + (f": {detail}" if detail else ""))
        self._tick_clock(running=False)
        self.conditions.set(ConditionType.PROGRESSING, "False", Reason.RESTARTING, what)
        self._set_phase(Phase.PENDING)
        return True

    def _finish(self, phase: Phase, reason: str, message: str, failure: FailureStatus | None = None) -> None:
        self.new.completion_time = format_time(self.now)
        self.new.message = message
        self.new.failure = failure
        succeeded = phase == Phase.SUCCEEDED
        self.conditions.set(ConditionType.SUCCEEDED, "True" if succeeded else "False",
                            reason if succeeded else Reason.FINISHED, message if succeeded else "")
        self.conditions.set(ConditionType.FAILED, "False" if succeeded else "True",
                            Reason.FINISHED if succeeded else reason, "" if succeeded else message)
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        self._tick_clock(running=False)
        self.new.phase = phase
        self.event("Normal" if succeeded else "Warning", reason if not succeeded else phase.value, message)
        self._clean_pods()

    # --- finished runs -----------------------------------------------------------------------------------------
    def _after_finish(self) -> None:
        self._clean_pods()
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        if ttl is not None and self.new.completion_time and _seconds(self.now, self.new.completion_time) >= ttl:
            self.actions.append(DeleteRun())

    def _clean_pods(self) -> None:
        policy = self.spec.run_policy.clean_pod_policy
        if policy == "None":
            return
        doomed = [p.name for p in self.pods if policy == "All" or p.phase in ("Pending", "Running", "Unknown")]
        if doomed:
            self.actions.append(DeletePods(tuple(sorted(doomed)), reason=f"cleanPodPolicy {policy}"))

    # --- suspend -----------------------------------------------------------------------------------------------
    def _suspend(self) -> None:
        if self.pods:
            self.actions.append(DeletePods(tuple(sorted(p.name for p in self.pods)), reason="suspended"))
        self._tick_clock(running=False)
        reason, message = Reason.SUSPENDED, "spec.runPolicy.suspend is true: pods deleted, the run is kept"
        if not self.spec.run_policy.suspend and self.hold is not None:
            reason, message = self.hold
        previous = self.conditions.get(ConditionType.SUSPENDED)
        changed = self.conditions.set(ConditionType.SUSPENDED, "True", reason, message)
        if changed or previous is None or previous.reason != reason:
            self.event("Warning" if reason == Reason.EVICTED else "Normal", reason, message)
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        self.new.phase = Phase.SUSPENDED
        self.new.message = None

    def _resume(self) -> None:
        message = "resumed: recreating pods, the learner resumes from its last checkpoint"
        if self.conditions.set(ConditionType.SUSPENDED, "False", Reason.RESUMED, message):
            self.event("Normal", Reason.RESUMED, message)
        self.new.start_time = None  # Job semantics: the active deadline counts again from the resume

    # --- clocks ------------------------------------------------------------------------------------------------
    def _tick_clock(self, *, running: bool) -> None:
        clock = self.new.progress_clock or ProgressClock()
        now = format_time(self.now)
        if running:
            if clock.anchor_time is None:
                clock.anchor_time = now
            if clock.paused_since is not None:
                clock.paused_seconds += _seconds(self.now, clock.paused_since)
                clock.paused_since = None
        elif clock.anchor_time is not None and clock.paused_since is None:
            clock.paused_since = now
        self.new.progress_clock = clock if clock.anchor_time is not None else self.new.progress_clock

    def idle_seconds(self) -> float:
        clock = self.new.progress_clock
        if clock is None or clock.anchor_time is None:
            return 0.0
        paused = clock.paused_seconds + (_seconds(self.now, clock.paused_since) if clock.paused_since else 0.0)
        return max(0.0, _seconds(self.now, clock.anchor_time) - paused)

    def _check_deadlines(self) -> bool:
        policy, progress = self.spec.run_policy, self.spec.progress
        active = _seconds(self.now, self.new.start_time)
        if policy.active_deadline_seconds is not None and active >= policy.active_deadline_seconds:
            self._finish(Phase.FAILED, Reason.DEADLINE_EXCEEDED,
                         f"the run was active for {int(active)} s (activeDeadlineSeconds {policy.active_deadline_seconds})",
                         FailureStatus(role="operator", reason=Reason.DEADLINE_EXCEEDED))
            return True
        startup = progress.startup_deadline_seconds
        if startup is not None and self.new.last_progress_time is None and active >= startup:
            waiting = self.new.message
            message = f"no group trained {int(active)} s after the pods were created (startupDeadlineSeconds {startup})"
            self._finish(Phase.FAILED, Reason.STARTUP_DEADLINE_EXCEEDED, message + (f"; {waiting}" if waiting else ""),
                         FailureStatus(role="operator", reason=Reason.STARTUP_DEADLINE_EXCEEDED, message=waiting))
            return True
        return False

    def _check_stall(self, *, running: bool) -> bool:
        """Set or clear the Stalled condition; True when the stall policy finished the run."""
        progress, deadline = self.new.progress, self.spec.progress.progress_deadline_seconds
        idle = self.idle_seconds()
        cause = None
        if progress is not None and progress.stall_limit > 0 and progress.stall_streak >= progress.stall_limit:
            cause = (Reason.STALL_LIMIT_REACHED,
                     f"{progress.stall_streak} groups consumed in a row without one training (limit {progress.stall_limit})")
        elif running and idle >= deadline:
            cause = (Reason.PROGRESS_DEADLINE_EXCEEDED,
                     f"no group trained for {int(idle)} s (progressDeadlineSeconds {deadline})")
        was_stalled = self.conditions.is_true(ConditionType.STALLED)
        if cause is None:
            if was_stalled:
                self.conditions.set(ConditionType.STALLED, "False", Reason.PROGRESS_RESUMED, "groups are training again")
                self.event("Normal", Reason.PROGRESS_RESUMED, "groups are training again")
            if running:
                self.conditions.set(ConditionType.PROGRESSING, "True", Reason.TRAINING,
                                    "the learner is training" + (f" ({self.new.progress.percent}% consumed)"
                                                                 if self.new.progress else ""))
                self.new.message = None
            return False
        reason, message = cause
        if self.conditions.set(ConditionType.STALLED, "True", reason, message):
            self.event("Warning", Reason.STALLED, message)
        # The learner's own stall streak ends the learner: it exits EXIT_STALLED with its final report in the
        # termination message, which is what status.failure should carry. Failing the run here as well raced that
        # exit and left the failure without exit code or message. The operator acts itself only on its own clock.
        if self.spec.progress.stall_policy == "Fail" and reason == Reason.PROGRESS_DEADLINE_EXCEEDED:
            leader = next((p.name for p in self.learner_pods if _rank(p.name) == 0), None)
            self._finish(Phase.FAILED, Reason.STALLED, message,
                         FailureStatus(role="learner", pod=leader, reason=Reason.STALLED, message=message))
            return True
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        self.new.message = message
        return False


def _rank(pod_name: str) -> int:
    tail = pod_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _wire(status: GRPORunStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
