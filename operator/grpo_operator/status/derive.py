"""derive_status(run, spec, last status, observation) -> Decision(new status, events, actions).

The orchestration of one pass: a PassRecord holds what the pass reads and what it has decided so far, and the rules
are plain functions over it, grouped by concern below. The failure policy is in exits.py, the progress clock in
clock.py, condition bookkeeping in conditions.py.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from grpo_trainer.contract.codes import DROP_REASONS
from grpo_trainer.contract.report import CheckpointReport, ExportReport, ProgressReport, TrackedRunReport

from ..api import GRPORunSpec
from ..builders import drain_deadline_seconds, environment_pod_name, learner_pod_name, rollout_selector
from ..eta import trainer_status, update_estimate
from ..run_ref import RunRef
from ..run_status import (
    FINISHED_PHASES,
    CheckpointStatus,
    ConditionType,
    EpisodeStatus,
    FailureStatus,
    GRPORunStatus,
    LearnerStatus,
    OutputStatus,
    Phase,
    ProgressStatus,
    Reason,
    TrackedRunStatus,
    dump_status,
    parse_status,
)
from . import admission, clock, revision, scaling
from .conditions import Conditions, format_time, seconds_since
from .deadlines import deadline_exceeded, stall_cause
from .decision import (
    Action,
    ConfigureRollout,
    CreateChildren,
    Decision,
    DeletePods,
    DeleteRun,
    Event,
    Observation,
    PodObservation,
    RecreatePods,
    rank,
)
from .durability import unkept_work
from .environments import (
    environment_wait,
    environments_ready,
    environments_status,
    scale_message,
    server_index,
    surplus_servers,
    unready_environments,
)
from .exits import Fail, Restart, Succeed, classify_failure, report_from_termination_message
from .images import images_action
from .invalid import fail_invalid_spec, invalid_spec
from .messages import (
    exported_message,
    initial_conditions,
    metrics_lost_message,
    phase_message,
    probe_failure_words,
    waiting_reason,
)
from .rollout_exits import classify_rollout_exits
from .servers import count_restart, readiness, rollout_status, take_learner_view, wanted_servers


def progress_status(report: ProgressReport) -> ProgressStatus:
    """status.progress from a report. `dropped` lists the reasons the CRD declares (the API server prunes others); a
    reason only a newer learner knows still counts in `groupsDropped`."""
    return ProgressStatus(
        epoch=report.epochs_done, epochs=report.epochs, groups_consumed=report.groups_consumed,
        groups_total=report.groups_total, groups_trained=report.groups_trained, groups_dropped=report.dropped_total,
        groups_regenerated=report.regenerated, groups_regenerated_environment=report.regenerated_environment,
        dropped={reason: report.dropped[reason] for reason in DROP_REASONS}, stall_streak=report.stall_streak,
        stall_limit=report.stall_limit, stalled=report.stall_verdict,
        stall_cause=getattr(report.stall_cause, "value", report.stall_cause) if report.stall_verdict else None,
        global_step=report.global_step, percent=round(report.percent, 1),
        reward_mean=report.reward_mean,
        masked_fraction=None if report.masked_fraction is None else round(report.masked_fraction, 4),
        episodes=None if report.episodes is None else EpisodeStatus.model_validate(report.episodes.model_dump()))


def tracking_status(report: TrackedRunReport) -> TrackedRunStatus:
    return TrackedRunStatus(tracker=report.tracker, run_id=report.run_id, uri=report.uri)


def output_status(report: ExportReport) -> OutputStatus:
    exported = datetime.datetime.fromtimestamp(report.time, datetime.UTC)
    return OutputStatus(uri=report.uri, step=report.step, bytes=report.bytes, sha256=report.sha256,
                        time=format_time(exported))


def checkpoint_status(report: CheckpointReport) -> CheckpointStatus:
    uploaded = datetime.datetime.fromtimestamp(report.time, datetime.UTC)
    return CheckpointStatus(step=report.step, uri=report.uri, time=format_time(uploaded))


def derive_status(run: RunRef, spec: GRPORunSpec | None, status: dict[str, Any] | None,
                  seen: Observation) -> Decision:
    """The next status of a run, the events its transitions emit and the actions the I/O layer must take, from its
    spec, its last status and what the operator saw of it this pass (status.observedGeneration: `run.generation`).
    `spec` is None when the stored spec cannot be parsed (`seen.spec_error` says why)."""
    old = parse_status(status)
    error = invalid_spec(seen)
    if spec is None or (error is not None and old.phase not in FINISHED_PHASES):
        if error is None:
            raise ValueError("a pass with no spec must say why in its observation's spec_error")
        return fail_invalid_spec(run, old, seen, error)
    record = _start_pass(run, spec, old, seen)
    _decide(record)
    return _decision(record)


@dataclass
class PassRecord:
    """What one pass reads (the run, its spec, its last status, the observation) and what it has decided so far (the
    new status, its conditions, events and actions). The rules below read and extend it; it is the only state."""

    run: RunRef
    spec: GRPORunSpec
    old: GRPORunStatus
    seen: Observation
    new: GRPORunStatus
    conditions: Conditions
    #: The pods not being deleted, and those being deleted (their names are not free yet).
    pods: list[PodObservation]
    terminating: list[PodObservation]
    #: The servers spec.rollout.replicas asks for; the surplus ones (the highest ordinals, left by a scale-down) drain.
    rollout_pods: list[PodObservation]
    surplus_pods: list[PodObservation]
    learner_pods: list[PodObservation]
    events: list[Event] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    #: This pass's report has more trained groups than the last one.
    trained_now: bool = False


def _start_pass(run: RunRef, spec: GRPORunSpec, old: GRPORunStatus, seen: Observation) -> PassRecord:
    new = old.model_copy(deep=True)
    new.observed_generation = run.generation
    pods = [p for p in seen.pods if not p.terminating]
    rollout_pods = sorted((p for p in pods if p.role == "rollout"), key=lambda p: rank(p.name))
    return PassRecord(
        run=run, spec=spec, old=old, seen=seen, new=new, conditions=Conditions(new, seen.now, run.generation),
        pods=pods, terminating=[p for p in seen.pods if p.terminating],
        rollout_pods=[p for p in rollout_pods if rank(p.name) < spec.rollout.replicas],
        surplus_pods=[p for p in rollout_pods if rank(p.name) >= spec.rollout.replicas],
        learner_pods=sorted((p for p in pods if p.role == "learner"), key=lambda p: rank(p.name)))


# --- one pass of the state machine ------------------------------------------------------------------------------------

def _decide(record: PassRecord) -> None:
    """The rules of one pass, in order; a rule that decides the pass (the run finished, suspended, restarting, failed
    on a deadline or a stall) ends it."""
    if record.old.phase in FINISHED_PHASES:
        _after_finish(record)
        return
    if not record.new.conditions:
        initial_conditions(record.conditions)
        if not record.seen.work_kept_locally:
            for warning in unkept_work(record.spec):
                _event(record, "Warning", Reason.WORK_NOT_KEPT, warning)
    for warning in record.seen.fit_warnings:
        _event(record, "Warning", Reason.FIT_WARNING, warning)
    _count_pods(record)
    if record.spec.run_policy.suspend or record.seen.hold is not None:
        _suspend(record)
        return
    if record.old.phase == Phase.SUSPENDED:
        _resume(record)
    if record.new.start_time is None:
        record.new.start_time = format_time(record.seen.now)
    if _wait_for_revisions(record):
        return
    _take_progress(record)
    if _decide_on_exits(record):
        return
    _scale(record)
    if (recorded := images_action(record.run.name, record.spec, record.pods, record.seen.configured_images)):
        record.actions.append(recorded)
    surplus = _scale_environments(record)
    _replace_environment_servers(record, surplus)
    # A pod being deleted still holds its name: its slot is not free until it is gone (a create would be a 409).
    missing = _missing_pods(record.run, record.spec, record.pods + record.terminating)
    if missing or not record.seen.children_exist:
        record.actions.append(CreateChildren())
    phase = _running_phase(record, missing)
    _surface_create_error(record)
    # A learner waiting for an environment's server trains nothing and burns nothing: its clock pauses (the learner
    # bounds the wait by spec.environments[].unavailableSeconds).
    _tick_clock(record, running=phase == Phase.RUNNING and environment_wait(record.seen.progress) is None)
    if _check_deadlines(record, waiting=phase != Phase.RUNNING) or _check_stall(record, running=phase == Phase.RUNNING):
        return
    _set_phase(record, phase)


def _decision(record: PassRecord) -> Decision:
    """The pass's Decision, with what follows from its final phase: the Workload's actions and the progress estimate."""
    record.actions += admission.workload_actions(record.seen.workload, finished=record.new.phase in FINISHED_PHASES,
                                                 pods_exist=bool(record.pods))
    if record.new.progress is not None:
        record.new.progress_rate = update_estimate(
            record.new.progress, record.new.progress_rate, record.old.progress, record.seen.now,
            running=record.new.phase == Phase.RUNNING, stalled=record.conditions.is_true(ConditionType.STALLED),
            succeeded=record.new.phase == Phase.SUCCEEDED)
        record.new.trainer_status = trainer_status(record.new.progress)
    return Decision(dump_status(record.new), record.events, record.actions)


# --- what a pass records: events, the phase, the end of a run ---------------------------------------------------------

def _event(record: PassRecord, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
    record.events.append(Event(kind, reason, message))


def _set_phase(record: PassRecord, phase: Phase) -> None:
    previous = record.new.phase
    record.new.phase = phase
    if previous != phase:
        reason = Reason.CREATED if previous is None else phase.value
        _event(record, "Normal", reason, phase_message(record.spec, phase))


def _finish(record: PassRecord, phase: Phase, reason: str, message: str, failure: FailureStatus | None = None) -> None:
    record.new.completion_time = format_time(record.seen.now)
    record.new.message = message
    record.new.failure = failure
    succeeded = phase == Phase.SUCCEEDED
    record.conditions.set(ConditionType.SUCCEEDED, "True" if succeeded else "False",
                          reason if succeeded else Reason.FINISHED, message if succeeded else "")
    record.conditions.set(ConditionType.FAILED, "False" if succeeded else "True",
                          Reason.FINISHED if succeeded else reason, "" if succeeded else message)
    record.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
    _tick_clock(record, running=False)
    record.new.phase = phase
    _event(record, "Normal" if succeeded else "Warning", reason if not succeeded else phase.value, message)
    _clean_pods(record)


def _clean_pods(record: PassRecord) -> None:
    policy = record.spec.run_policy.clean_pod_policy
    if policy == "None":
        return
    doomed = [p.name for p in record.pods if policy == "All" or p.phase in ("Pending", "Running", "Unknown")]
    if doomed:
        record.actions.append(DeletePods(tuple(sorted(doomed)), reason=f"cleanPodPolicy {policy}"))


def _tick_clock(record: PassRecord, *, running: bool) -> None:
    record.new.progress_clock = clock.tick(record.new.progress_clock, record.seen.now, running=running)


# --- the learner's progress, the progress clock, the deadlines and the stall rules ------------------------------------

def _take_progress(record: PassRecord) -> None:
    report = record.seen.progress
    if report is None:  # the learner is gone: its termination message carries the final report
        for pod in record.learner_pods:
            report = report or report_from_termination_message(pod.message)
    if report is None:
        return
    take_learner_view(record.new.rollout, report)
    revision.take_model_digest(record.spec, record.new, report.model_digest)
    if report.output is not None:  # from /progress or a termination message: an export that happened stays
        _take_output(record, report.output)
    if report.checkpoint is not None:  # a restarted learner reports none until its first upload: the last one stays
        record.new.checkpoint = checkpoint_status(report.checkpoint)
    previous_trained = record.old.progress.groups_trained if record.old.progress else 0
    record.new.progress = progress_status(report)
    if report.tracking:  # a learner starting (again) reports none until its trackers' runs began
        record.new.tracking = [tracking_status(run) for run in report.tracking]
    _take_tracking_degraded(record, report)
    if report.groups_trained > previous_trained:
        record.trained_now = True
        record.new.last_progress_time = format_time(record.seen.now)
        record.new.progress_clock = clock.restart(record.new.progress_clock, record.seen.now)
    elif report.groups_trained < previous_trained:  # a restarted learner, back at its checkpoint: not idleness
        record.new.progress_clock = clock.restart(record.new.progress_clock, record.seen.now)


def _take_output(record: PassRecord, report: ExportReport) -> None:
    """status.output from the learner's report of its export, with an Exported event when it is new. Whatever
    comes after (a kill, a crash past the backoff limit), the model was written: the status keeps saying where."""
    output = output_status(report)
    if output != record.new.output:
        record.new.output = output
        _event(record, "Normal", Reason.EXPORTED, exported_message(report))


def _take_tracking_degraded(record: PassRecord, report: ProgressReport) -> None:
    """TrackingDegraded, only once a learner reported a tracker that does not get the run's metrics: dropped mid-run
    (MetricsLost) or left out at start (TrackersUnavailable: spec.tracking.onUnavailable: continue), with a Warning
    event when it turns True or to the other reason; False again when a later start's trackers all began their runs."""
    if report.tracking_lost:
        reason, message = Reason.METRICS_LOST, metrics_lost_message(report.tracking_lost)
    elif report.tracking_degraded:
        reason, message = Reason.TRACKERS_UNAVAILABLE, "; ".join(report.tracking_degraded)
    else:
        if report.tracking and record.conditions.get(ConditionType.TRACKING_DEGRADED) is not None:
            record.conditions.set(ConditionType.TRACKING_DEGRADED, "False", Reason.TRACKERS_REPORTING,
                                  "every tracker of spec.tracking began its run")
        return
    before = record.conditions.get(ConditionType.TRACKING_DEGRADED)
    record.conditions.set(ConditionType.TRACKING_DEGRADED, "True", reason, message)
    if before is None or (before.status, before.reason) != ("True", reason):
        _event(record, "Warning", reason, message)


def _progress_unknown(record: PassRecord) -> bool:
    """The learner's progress cannot be read: Stalled is Unknown, and missing data alone never fails a run."""
    message = f"the learner's progress cannot be read: {record.seen.progress_error}"
    if record.conditions.set(ConditionType.STALLED, "Unknown", Reason.PROGRESS_UNKNOWN, message):
        _event(record, "Warning", Reason.PROGRESS_UNKNOWN, message)
    record.conditions.set(ConditionType.PROGRESSING, "Unknown", Reason.PROGRESS_UNKNOWN, message)
    record.new.message = message
    return False


def _check_deadlines(record: PassRecord, *, waiting: bool) -> bool:
    exceeded = deadline_exceeded(record.spec, record.new, record.seen.now, pending=waiting)
    unready = unready_environments(record.conditions)
    if exceeded is not None and exceeded.reason == Reason.STARTUP_DEADLINE_EXCEEDED and unready:
        exceeded = replace(exceeded, message=f"{exceeded.message}; {unready}", waiting=exceeded.waiting or unready)
    if exceeded is not None:
        _finish(record, Phase.FAILED, exceeded.reason, exceeded.message,
                FailureStatus(role="operator", reason=exceeded.reason, message=exceeded.waiting))
    return exceeded is not None


def _check_stall(record: PassRecord, *, running: bool) -> bool:
    """Set or clear the Stalled condition; True when the stall policy finished the run."""
    idle = clock.idle_seconds(record.new.progress_clock, record.seen.now)
    cause = stall_cause(record.spec, record.new, idle, running=running)
    deadline = cause is not None and cause.reason == Reason.PROGRESS_DEADLINE_EXCEEDED
    if running and record.seen.progress_error is not None and (record.seen.progress_lost or deadline):
        return _progress_unknown(record)
    if cause is None:
        # Stalled clears from True (groups train again) and from Unknown (the learner's reports can be read
        # again): `kubectl wait --for=condition=Stalled=False` and alerts must see the end of either. A stuck
        # weight sync restarted under `stallPolicy: Report` is over only once a group trains again.
        stalled = record.conditions.get(ConditionType.STALLED)
        waits_for_training = (stalled is not None and stalled.status == "True"
                              and stalled.reason == Reason.WEIGHT_SYNC_STUCK and not record.trained_now)
        if stalled is not None and stalled.status != "False" and not waits_for_training:
            resumed = ("groups are training again" if stalled.status == "True"
                       else "the learner's progress can be read again")
            record.conditions.set(ConditionType.STALLED, "False", Reason.PROGRESS_RESUMED, resumed)
            _event(record, "Normal", Reason.PROGRESS_RESUMED, resumed)
        if running and (waiting := environment_wait(record.seen.progress)) is not None:
            if record.conditions.set(ConditionType.PROGRESSING, "False", Reason.WAITING_FOR_ENVIRONMENT, waiting):
                _event(record, "Warning", Reason.WAITING_FOR_ENVIRONMENT, waiting)
            record.new.message = waiting
        elif running:
            percent = f" ({record.new.progress.percent}% consumed)" if record.new.progress else ""
            record.conditions.set(ConditionType.PROGRESSING, "True", Reason.TRAINING,
                                  f"the learner is training{percent}")
            record.new.message = None
        return False
    if record.conditions.set(ConditionType.STALLED, "True", cause.reason, cause.message):
        _event(record, "Warning", Reason.STALLED, cause.message)
    # The learner's stall verdict ends the learner: it exits EXIT_STALLED with its final report in the
    # termination message, which is what status.failure should carry. Failing the run here as well raced that
    # exit and left the failure without exit code or message. The operator acts itself only on its own clock.
    if record.spec.progress.stall_policy == "Fail" and cause.reason == Reason.PROGRESS_DEADLINE_EXCEEDED:
        leader = next((p.name for p in record.learner_pods if rank(p.name) == 0), None)
        _finish(record, Phase.FAILED, Reason.STALLED, cause.message,
                FailureStatus(role="learner", pod=leader, reason=Reason.STALLED, message=cause.message))
        return True
    record.conditions.set(ConditionType.PROGRESSING, "False", cause.reason, cause.message)
    record.new.message = cause.message
    return False


# --- pods and readiness -----------------------------------------------------------------------------------------------

def _count_pods(record: PassRecord, *, finished: bool = False) -> None:
    """status.rollout and status.learner from the pods that exist. A finished run is counted too: once
    cleanPodPolicy has deleted its servers it claims none (the scale subresource and `kubectl get` read these)."""
    record.new.rollout = rollout_status(record.spec.rollout.replicas, record.rollout_pods + record.surplus_pods,
                                        record.old.rollout, selector=rollout_selector(record.run.name),
                                        now=format_time(record.seen.now))
    learner_ready = sum(1 for p in record.learner_pods if p.phase == "Running")
    record.new.learner = LearnerStatus(nodes=record.spec.learner.nodes, ready=learner_ready,
                                       restarts=record.new.restarts)
    record.new.environments = environments_status(record.run.name, record.spec.environments, record.pods,
                                                  {} if finished else record.seen.environment_scale_refused)
    if finished:
        _finished_rollout_ready(record)
    else:
        _rollout_ready(record)
    record.events += environments_ready(record.conditions, record.run.name, record.spec.environments, record.pods,
                                        finished=finished, running=record.old.phase == Phase.RUNNING)


def _finished_rollout_ready(record: PassRecord) -> None:
    """RolloutReady of a finished run: what its remaining pods show, False with reason Finished once its servers
    are gone; no event (the run's end was announced)."""
    ready, reason, message = readiness(record.new.rollout, record.spec.run_policy.rollout_restart_limit)
    if not ready:
        wanted = len(wanted_servers(record.new.rollout))
        reason, message = (Reason.FINISHED,
                           f"the run has finished: {record.new.rollout.ready}/{wanted} rollout servers ready")
    record.conditions.set(ConditionType.ROLLOUT_READY, "True" if ready else "False", reason, message)


def _rollout_ready(record: PassRecord) -> None:
    stuck = {}  # by replica: `ImagePullBackOff: ...`, `Unschedulable: 0/4 nodes are available: ...`
    for pod in record.rollout_pods:
        if (waiting := waiting_reason([pod], [])) is not None:
            reason, text = waiting[0], waiting[1].removeprefix(f"pod {pod.name}: ")
            stuck[rank(pod.name)] = f"{reason}: {text.removeprefix(f'{reason}: ')}"
        elif pod.phase == "Running" and not pod.ready and pod.probe_failure is not None:
            stuck[rank(pod.name)] = probe_failure_words(pod.probe_failure)  # the kubelet's, from the pod's Events
    ready, reason, message = readiness(record.new.rollout, record.spec.run_policy.rollout_restart_limit, stuck)
    if not ready:
        changed = record.conditions.set(ConditionType.ROLLOUT_READY, "False", reason, message)
        if changed and record.old.phase == Phase.RUNNING:
            _event(record, "Warning", reason, message)
    elif record.conditions.set(ConditionType.ROLLOUT_READY, "True", reason, message):
        _event(record, "Normal", Reason.ROLLOUT_READY, message)


def _missing_pods(run: RunRef, spec: GRPORunSpec, pods: list[PodObservation]) -> list[tuple[str, int | str]]:
    """The (role, rank) slots the spec asks for that none of `pods` holds; an environment server's slot is its pod's
    name (each environment numbers its servers from 0)."""
    present = {(p.role, p.name if p.role == "environment" else rank(p.name)) for p in pods}
    expected: list[tuple[str, int | str]] = [("rollout", i) for i in range(spec.rollout.replicas)]
    expected += [("learner", r) for r in range(spec.learner.nodes)]
    expected += [("environment", environment_pod_name(run.name, environment.name, i))
                 for environment in spec.environments or [] for i in range(environment.replicas)]
    return [slot for slot in expected if slot not in present]


def _replace_environment_servers(record: PassRecord, surplus: list[str]) -> None:
    """An environment server restarts in place (restartPolicy Always); one whose pod ended anyway (evicted, its node
    lost) is deleted, and created again once it is gone. The run goes on meanwhile: its episodes on that server fail
    and are counted as environment failures (docs/agentic.md). A surplus server is deleted by the scale-down."""
    ended = tuple(sorted(p.name for p in record.pods if p.role == "environment" and p.name not in surplus
                         and p.phase in ("Failed", "Succeeded")))
    if ended:
        record.actions.append(RecreatePods(ended))


def _running_phase(record: PassRecord, missing: list[tuple[str, int | str]]) -> Phase:
    # A running learner goes on while rollout servers are replaced (it waits when none is left): the run stays
    # Running and its progress clock counts, so progressDeadlineSeconds bounds the wait.
    learner_whole = not any(role == "learner" for role, _ in missing + [(p.role, 0) for p in record.terminating])
    if (record.old.phase == Phase.RUNNING and learner_whole and record.learner_pods
            and all(p.phase == "Running" for p in record.learner_pods)):
        return Phase.RUNNING
    if missing or record.terminating or any(p.phase in ("Pending", "Unknown") for p in record.pods):
        _surface_waiting(record, default=(Reason.PODS_PENDING, "waiting for pods to be created and scheduled"))
        return Phase.PENDING
    unready = unready_environments(record.conditions)
    rollout_ready = record.conditions.is_true(ConditionType.ROLLOUT_READY)
    all_ready = rollout_ready and unready is None
    learners_running = all(p.phase == "Running" for p in record.learner_pods)
    # Once running, an unready rollout server does not stop the run (or its clock): RolloutReady says it.
    if learners_running and (all_ready or record.old.phase == Phase.RUNNING):
        return Phase.RUNNING
    servers = "the environment servers" if rollout_ready else "the rollout and environment servers"
    waiting = (f"pods running; waiting for {servers} to be ready: {unready}" if unready
               else "pods running; waiting for the rollout servers to be ready")
    _surface_waiting(record, default=(Reason.STARTING, waiting))
    return Phase.STARTING


def _reported(old: GRPORunStatus, reason: str) -> bool:
    """The last pass's status already showed `reason` on Progressing: its event was emitted then. (The condition
    of this pass may have been overwritten by an earlier step of the same pass: not the one to compare with.)"""
    previous = next((c for c in old.conditions if c.type == ConditionType.PROGRESSING.value), None)
    return previous is not None and previous.reason == reason


def _surface_waiting(record: PassRecord, default: tuple[str, str]) -> None:
    reason, message = waiting_reason(record.pods, record.terminating) or default
    record.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
    # Pods being deleted are routine on every restart: no event, but the message says who is waited for. While a
    # create fails, CreateFailed takes the condition (below), so a stuck pod is reported once that clears (else
    # it would be "new" again on every pass).
    quiet = reason in (Reason.PODS_PENDING, Reason.STARTING, Reason.POD_TERMINATING)
    if not quiet and record.seen.create_error is None and not _reported(record.old, reason):
        _event(record, "Warning", reason, message)
    record.new.message = None if reason in (Reason.PODS_PENDING, Reason.STARTING) else message


def _wait_for_revisions(record: PassRecord) -> bool:
    """Pin the hub model's and dataset's commits the pass learned (status/revision.py); True when the run waits for
    one before its first pod: Pending, with why, within the startup deadline."""
    waiting = revision.take_pins(record.spec, record.new, record.seen.pins,
                                 pods_exist=bool(record.pods or record.terminating))
    if waiting is None:
        return False
    record.conditions.set(ConditionType.PROGRESSING, "False", Reason.RESOLVING_REVISION, waiting)
    if not _reported(record.old, Reason.RESOLVING_REVISION):
        _event(record, "Warning", Reason.RESOLVING_REVISION, waiting)
    record.new.message = waiting
    _tick_clock(record, running=False)
    if not _check_deadlines(record, waiting=True):
        _set_phase(record, Phase.PENDING)
    return True


def _surface_create_error(record: PassRecord) -> None:
    error = record.seen.create_error
    if error is None:
        return
    record.conditions.set(ConditionType.PROGRESSING, "False", Reason.CREATE_FAILED, error)
    if not _reported(record.old, Reason.CREATE_FAILED):
        _event(record, "Warning", Reason.CREATE_FAILED, error)
    record.new.message = error


# --- a live replica change --------------------------------------------------------------------------------------------

def _scale(record: PassRecord) -> None:
    """Keep the run config's `rollout.urls` at the spec's servers and delete the removed servers the learner has
    let go. While removed servers' pods remain, or the config lists another count (a scale back up while servers
    drain: no pod is missing, but their URLs must join again), ConfigureRollout comes first of the pass's
    actions: a server leaves the config before its pod may go, and joins it before the learner is expected to
    use it. (A scale-up's new servers are missing pods: CreateChildren adds their URLs before it creates them.)"""
    configured = record.seen.configured_servers
    if record.surplus_pods or (configured is not None and configured != record.spec.rollout.replicas):
        record.actions.insert(0, ConfigureRollout(record.spec.rollout.replicas))
    rollout = record.new.rollout
    refused = record.seen.scale_refused
    if refused is not None and refused != (record.old.rollout.scale_refused if record.old.rollout else None):
        _event(record, "Warning", Reason.SCALE_REFUSED, refused)
    rollout.scale_refused = refused
    before = len(wanted_servers(record.old.rollout)) if record.old.rollout else None
    if before is not None and before != record.spec.rollout.replicas and record.old.phase is not None:
        _event(record, "Normal", Reason.SCALED, scaling.scale_message(before, record.spec.rollout.replicas))
    learner_running = any(p.phase == "Running" for p in record.learner_pods)
    gone = scaling.removals(record.surplus_pods, rollout.servers, record.seen.progress, learner_running=learner_running,
                            now=record.seen.now, deadline_s=drain_deadline_seconds(record.spec))
    if gone:
        record.actions.append(DeletePods(tuple(removal.pod for removal in gone), reason="drained"))
    for removal in gone:
        _event(record, removal.type, removal.reason, removal.message)


def _scale_environments(record: PassRecord) -> list[str]:
    """A live change of spec.environments[].replicas: a scale-up's servers are missing pods (CreateChildren creates
    them; the Service takes them in once Ready); a scale-down deletes the servers past the new count at once, the
    highest indexes. An environment server holds no state the run keeps, so there is no drain: the episodes in
    flight on a deleted server fail and are counted as environment failures, as when a server is lost. Returns
    the surplus servers' pods."""
    surplus = surplus_servers(record.run.name, record.spec.environments, record.pods)
    if surplus:
        record.actions.append(DeletePods(tuple(surplus), reason="environment scaled down"))
    before = {entry.name: entry.wanted for entry in record.old.environments or []}
    refused_before = {entry.name: entry.scale_refused for entry in record.old.environments or []}
    for environment in record.spec.environments or []:
        refused = record.seen.environment_scale_refused.get(environment.name)
        if refused is not None and refused != refused_before.get(environment.name):
            _event(record, "Warning", Reason.SCALE_REFUSED, refused)
        wanted = before.get(environment.name)
        if record.old.phase is not None and wanted is not None and wanted != environment.replicas:
            deleted = [name for name in surplus if server_index(record.run.name, environment.name, name) is not None]
            _event(record, "Normal", Reason.SCALED, scale_message(environment.name, wanted, environment.replicas,
                                                                  deleted))
    return surplus


# --- exits and the end of a run ---------------------------------------------------------------------------------------

def _decide_on_exits(record: PassRecord) -> bool:
    verdict = classify_failure(record.learner_pods, record.rollout_pods, record.spec, restarts=record.new.restarts,
                               disruptions=record.new.disruptions, removed_learners=_removed_learners(record))
    if verdict is None:
        return _replace_servers(record)
    if isinstance(verdict, Succeed):
        if verdict.output is not None:
            _take_output(record, verdict.output)
        _finish(record, Phase.SUCCEEDED, verdict.reason, verdict.message)
    elif isinstance(verdict, Fail):
        if verdict.stall is not None:
            record.conditions.set(ConditionType.STALLED, "True", verdict.stall.reason, verdict.stall.message)
        _finish(record, Phase.FAILED, verdict.reason, verdict.message, verdict.failure)
    elif isinstance(verdict, Restart):
        if verdict.stall is not None and record.conditions.set(ConditionType.STALLED, "True", verdict.stall.reason,
                                                               verdict.stall.message):
            _event(record, "Warning", verdict.stall.reason, f"{verdict.stall.message} (stallPolicy Report: "
                   "the pods restart under backoffLimit)")
        return _restart(record, verdict)
    return True


def _replace_servers(record: PassRecord) -> bool:
    """Rollout servers that exited are replaced one by one while the learner goes on; True when the run failed."""
    limit = record.spec.run_policy.rollout_restart_limit
    used = {server.replica: server.restarts for server in record.new.rollout.servers}
    outcome = classify_rollout_exits(record.rollout_pods, used, limit=limit,
                                     rules=record.spec.run_policy.pod_failure_policy or ())
    if isinstance(outcome, Fail):
        _finish(record, Phase.FAILED, outcome.reason, outcome.message, outcome.failure)
        return True
    for restart in outcome:
        record.actions.append(RecreatePods((restart.pod,)))
        if not restart.counted:
            count = count_restart(record.new.rollout, restart)
            error = f": {restart.error}" if restart.error else ""
            _event(record, "Warning", Reason.ROLLOUT_RESTARTED, f"{restart.what}; restart {count}/{limit}, the "
                   f"learner goes on with the other servers or waits for this one{error}")
    if outcome:
        _rollout_ready(record)
    return False


def _restart(record: PassRecord, verdict: Restart) -> bool:
    """Recreate the verdict's pods; True when the pass ends here (the learner restarts: the run is Pending)."""
    if verdict.pods:  # none when every pod to restart is going already (a drain)
        record.actions.append(RecreatePods(verdict.pods))
    # Rollout servers alone (a disrupted one, one a podFailurePolicy rule restarts): a running learner goes on.
    learners = {p.name for p in record.learner_pods} & set(verdict.pods) or _removed_learners(record)
    servers_only = record.old.phase == Phase.RUNNING and not learners
    resume = "the learner goes on" if servers_only else "resuming from the last checkpoint"
    if not verdict.counted:
        detail = f": {verdict.detail}" if verdict.detail else ""
        if verdict.disruption is not None:
            record.new.disruptions += 1
            limit = record.spec.run_policy.max_disruptions
            _event(record, "Warning", Reason.DISRUPTED, f"{verdict.what}; disruption {record.new.disruptions}"
                   + (f"/{limit}" if limit is not None else "")
                   + f", not counted against backoffLimit; {resume}")
        else:
            record.new.restarts += 1
            _event(record, "Warning", Reason.RESTARTING, f"{verdict.what}; restart {record.new.restarts}/"
                   f"{record.spec.run_policy.backoff_limit}, {resume}{detail}")
    record.new.learner.restarts = record.new.restarts
    if servers_only:
        return False
    if record.new.progress is not None:  # the ended learner's verdict: the one that starts reports its own
        record.new.progress.stalled, record.new.progress.stall_cause = False, None
    _tick_clock(record, running=False)
    reason = Reason.DISRUPTED if verdict.disruption is not None else Reason.RESTARTING
    record.conditions.set(ConditionType.PROGRESSING, "False", reason, verdict.what)
    _set_phase(record, Phase.PENDING)
    return True


def _removed_learners(record: PassRecord) -> list[str]:
    """Learner pods that vanished from a running gang, or are going (the Eviction API, a manual delete). One seen
    while Terminating counts: the operator's own deletes leave the run Pending, so in a Running or Starting run
    someone else deleted it, and waiting until it is gone would leave the rest of the gang on an ended rendezvous
    (by then the run is Pending and the gap looks like a pod still to create)."""
    if record.old.phase not in (Phase.RUNNING, Phase.STARTING):
        return []
    present = {rank(p.name) for p in record.learner_pods}
    return [learner_pod_name(record.run.name, r) for r in range(record.spec.learner.nodes) if r not in present]


def _after_finish(record: PassRecord) -> None:
    _count_pods(record, finished=True)
    _clean_pods(record)
    ttl = record.spec.run_policy.ttl_seconds_after_finished
    completed = record.new.completion_time
    if ttl is not None and completed and seconds_since(record.seen.now, completed) >= ttl:
        record.actions.append(DeleteRun())


# --- suspend ----------------------------------------------------------------------------------------------------------

def _suspend(record: PassRecord) -> None:
    if record.pods:
        record.actions.append(DeletePods(tuple(sorted(p.name for p in record.pods)), reason="suspended"))
    _tick_clock(record, running=False)
    reason, message = Reason.SUSPENDED, phase_message(record.spec, Phase.SUSPENDED)
    if not record.spec.run_policy.suspend and record.seen.hold is not None:
        reason, message = record.seen.hold
    previous = record.conditions.get(ConditionType.SUSPENDED)
    changed = record.conditions.set(ConditionType.SUSPENDED, "True", reason, message)
    if changed or previous is None or previous.reason != reason:
        _event(record, "Warning" if reason == Reason.EVICTED else "Normal", reason, message)
    record.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
    record.new.phase = Phase.SUSPENDED
    record.new.message = None


def _resume(record: PassRecord) -> None:
    message = "resumed: recreating pods, the learner resumes from its last checkpoint"
    if record.conditions.set(ConditionType.SUSPENDED, "False", Reason.RESUMED, message):
        _event(record, "Normal", Reason.RESUMED, message)
    record.new.start_time = None  # Job semantics: the active deadline counts again from the resume
    # Waiting to run again is timed from the resume, not from the suspension.
    record.new.progress_clock = clock.restart_pause(record.new.progress_clock, record.seen.now)
