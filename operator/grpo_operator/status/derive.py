"""derive_status(run, spec, last status, observation) -> Decision(new status, events, actions).

The orchestration of one pass; the failure policy is in exits.py, the progress clock in clock.py, condition
bookkeeping in conditions.py.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from grpo_trainer.contract import DROP_REASONS, ExportReport, ProgressReport, TrackedRunReport

from ..api import (
    FINISHED_PHASES,
    ConditionType,
    EpisodeStatus,
    FailureStatus,
    GRPORunSpec,
    GRPORunStatus,
    LearnerStatus,
    OutputStatus,
    Phase,
    ProgressStatus,
    Reason,
    TrackedRunStatus,
    parse_status,
)
from ..builders import drain_deadline_seconds, learner_pod_name, rollout_selector
from ..eta import trainer_status, update_estimate
from ..run_ref import RunRef
from . import admission, clock, scaling
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
from .exits import Fail, Restart, Succeed, classify_failure, report_from_termination_message
from .rollout_exits import classify_rollout_exits
from .servers import count_restart, readiness, rollout_status, take_learner_view, wanted_servers

#: Waiting reasons that mean a pod will not start by itself; surfaced on the run (KubeRay #1990: a job stuck in
#: Initializing forever on an image-pull error).
STUCK_WAITING_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError",
})


def progress_status(report: ProgressReport) -> ProgressStatus:
    """status.progress from a report. `dropped` lists the reasons the CRD declares (the API server prunes others); a
    reason only a newer learner knows still counts in `groupsDropped`."""
    return ProgressStatus(
        epoch=report.epochs_done, epochs=report.epochs, groups_consumed=report.groups_consumed,
        groups_total=report.groups_total, groups_trained=report.groups_trained, groups_dropped=report.dropped_total,
        dropped={reason: report.dropped[reason] for reason in DROP_REASONS}, stall_streak=report.stall_streak,
        stall_limit=report.stall_limit, global_step=report.global_step, percent=round(report.percent, 1),
        reward_mean=report.reward_mean,
        masked_fraction=None if report.masked_fraction is None else round(report.masked_fraction, 4),
        episodes=None if report.episodes is None else EpisodeStatus.model_validate(report.episodes.model_dump()))


def tracking_status(report: TrackedRunReport) -> TrackedRunStatus:
    return TrackedRunStatus(tracker=report.tracker, run_id=report.run_id, uri=report.uri)


def output_status(report: ExportReport) -> OutputStatus:
    exported = datetime.datetime.fromtimestamp(report.time, datetime.UTC)
    return OutputStatus(uri=report.uri, step=report.step, bytes=report.bytes, sha256=report.sha256,
                        time=format_time(exported))


def derive_status(run: RunRef, spec: GRPORunSpec, status: dict[str, Any] | None, seen: Observation) -> Decision:
    """The next status of a run, the events its transitions emit and the actions the I/O layer must take, from its
    spec, its last status and what the operator saw of it this pass (status.observedGeneration: `run.generation`)."""
    derivation = _Derivation(run, spec, parse_status(status), seen)
    derivation.decide()
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
    conditions = Conditions(new, now, generation)
    conditions.set(ConditionType.FAILED, "True", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.SUCCEEDED, "False", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.PROGRESSING, "False", Reason.INVALID_SPEC, message)
    return Decision(_wire(new), events, [])


class RunRecord:
    """The pass's inputs and what it has decided so far: the new status, its conditions, events and actions."""

    def __init__(self, run: RunRef, spec: GRPORunSpec, old: GRPORunStatus, seen: Observation):
        self.run, self.spec, self.old, self.seen = run, spec, old, seen
        self.now, self.progress = seen.now, seen.progress
        self.new = old.model_copy(deep=True)
        self.new.observed_generation = run.generation
        self.conditions = Conditions(self.new, seen.now, run.generation)
        self.events: list[Event] = []
        self.actions: list[Action] = []
        self.terminating = [p for p in seen.pods if p.terminating]
        self.pods = [p for p in seen.pods if not p.terminating]
        self.trained_now = False  # this pass's report has more trained groups than the last one
        rollout_pods = sorted((p for p in self.pods if p.role == "rollout"), key=lambda p: rank(p.name))
        # The servers spec.rollout.replicas asks for; the others (the highest ordinals, left by a scale-down) drain.
        self.rollout_pods = [p for p in rollout_pods if rank(p.name) < spec.rollout.replicas]
        self.surplus_pods = [p for p in rollout_pods if rank(p.name) >= spec.rollout.replicas]
        self.learner_pods = sorted((p for p in self.pods if p.role == "learner"), key=lambda p: rank(p.name))

    def decision(self) -> Decision:
        self.actions += admission.workload_actions(self.seen.workload, finished=self.new.phase in FINISHED_PHASES,
                                                   pods_exist=bool(self.pods))
        if self.new.progress is not None:
            self.new.progress_rate = update_estimate(
                self.new.progress, self.new.progress_rate, self.old.progress, self.now,
                running=self.new.phase == Phase.RUNNING, stalled=self.conditions.is_true(ConditionType.STALLED),
                succeeded=self.new.phase == Phase.SUCCEEDED)
            self.new.trainer_status = trainer_status(self.new.progress)
        return Decision(_wire(self.new), self.events, self.actions)

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(kind, reason, message))

    def set_phase(self, phase: Phase) -> None:
        previous = self.new.phase
        self.new.phase = phase
        if previous != phase:
            reason = Reason.CREATED if previous is None else phase.value
            self.event("Normal", reason, _phase_message(self.spec, phase))

    def finish(self, phase: Phase, reason: str, message: str, failure: FailureStatus | None = None) -> None:
        self.new.completion_time = format_time(self.now)
        self.new.message = message
        self.new.failure = failure
        succeeded = phase == Phase.SUCCEEDED
        self.conditions.set(ConditionType.SUCCEEDED, "True" if succeeded else "False",
                            reason if succeeded else Reason.FINISHED, message if succeeded else "")
        self.conditions.set(ConditionType.FAILED, "False" if succeeded else "True",
                            Reason.FINISHED if succeeded else reason, "" if succeeded else message)
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        self.tick_clock(running=False)
        self.new.phase = phase
        self.event("Normal" if succeeded else "Warning", reason if not succeeded else phase.value, message)
        self.clean_pods()

    def clean_pods(self) -> None:
        policy = self.spec.run_policy.clean_pod_policy
        if policy == "None":
            return
        doomed = [p.name for p in self.pods if policy == "All" or p.phase in ("Pending", "Running", "Unknown")]
        if doomed:
            self.actions.append(DeletePods(tuple(sorted(doomed)), reason=f"cleanPodPolicy {policy}"))

    def tick_clock(self, *, running: bool) -> None:
        self.new.progress_clock = clock.tick(self.new.progress_clock, self.now, running=running)


class _ProgressRules(RunRecord):
    """The learner's progress, the progress clock, the deadlines and the stall rules of one pass."""

    def _take_progress(self) -> None:
        report = self.progress
        if report is None:  # the learner is gone: its termination message carries the final report
            for pod in self.learner_pods:
                report = report or report_from_termination_message(pod.message)
        if report is None:
            return
        take_learner_view(self.new.rollout, report)
        previous_trained = self.old.progress.groups_trained if self.old.progress else 0
        self.new.progress = progress_status(report)
        if report.tracking:  # a learner starting (again) reports none until its trackers' runs began
            self.new.tracking = [tracking_status(run) for run in report.tracking]
        if report.groups_trained > previous_trained:
            self.trained_now = True
            self.new.last_progress_time = format_time(self.now)
            self.new.progress_clock = clock.restart(self.new.progress_clock, self.now)
        elif report.groups_trained < previous_trained:  # a restarted learner, back at its checkpoint: not idleness
            self.new.progress_clock = clock.restart(self.new.progress_clock, self.now)

    def _progress_unknown(self) -> bool:
        """The learner's progress cannot be read: Stalled is Unknown, and missing data alone never fails a run."""
        message = f"the learner's progress cannot be read: {self.seen.progress_error}"
        if self.conditions.set(ConditionType.STALLED, "Unknown", Reason.PROGRESS_UNKNOWN, message):
            self.event("Warning", Reason.PROGRESS_UNKNOWN, message)
        self.conditions.set(ConditionType.PROGRESSING, "Unknown", Reason.PROGRESS_UNKNOWN, message)
        self.new.message = message
        return False

    def _check_deadlines(self, *, waiting: bool) -> bool:
        exceeded = deadline_exceeded(self.spec, self.new, self.now, pending=waiting)
        if exceeded is not None:
            self.finish(Phase.FAILED, exceeded.reason, exceeded.message,
                         FailureStatus(role="operator", reason=exceeded.reason, message=exceeded.waiting))
        return exceeded is not None

    def _check_stall(self, *, running: bool) -> bool:
        """Set or clear the Stalled condition; True when the stall policy finished the run."""
        idle = clock.idle_seconds(self.new.progress_clock, self.now)
        cause = stall_cause(self.spec, self.new, idle, running=running)
        deadline = cause is not None and cause.reason == Reason.PROGRESS_DEADLINE_EXCEEDED
        if running and self.seen.progress_error is not None and (self.seen.progress_lost or deadline):
            return self._progress_unknown()
        if cause is None:
            # Stalled clears from True (groups train again) and from Unknown (the learner's reports can be read
            # again): `kubectl wait --for=condition=Stalled=False` and alerts must see the end of either. A stuck
            # weight sync restarted under `stallPolicy: Report` is over only once a group trains again.
            stalled = self.conditions.get(ConditionType.STALLED)
            waits_for_training = (stalled is not None and stalled.status == "True"
                                  and stalled.reason == Reason.WEIGHT_SYNC_STUCK and not self.trained_now)
            if stalled is not None and stalled.status != "False" and not waits_for_training:
                resumed = ("groups are training again" if stalled.status == "True"
                           else "the learner's progress can be read again")
                self.conditions.set(ConditionType.STALLED, "False", Reason.PROGRESS_RESUMED, resumed)
                self.event("Normal", Reason.PROGRESS_RESUMED, resumed)
            if running:
                percent = f" ({self.new.progress.percent}% consumed)" if self.new.progress else ""
                self.conditions.set(ConditionType.PROGRESSING, "True", Reason.TRAINING,
                                    f"the learner is training{percent}")
                self.new.message = None
            return False
        if self.conditions.set(ConditionType.STALLED, "True", cause.reason, cause.message):
            self.event("Warning", Reason.STALLED, cause.message)
        # The learner's own stall streak ends the learner: it exits EXIT_STALLED with its final report in the
        # termination message, which is what status.failure should carry. Failing the run here as well raced that
        # exit and left the failure without exit code or message. The operator acts itself only on its own clock.
        if self.spec.progress.stall_policy == "Fail" and cause.reason == Reason.PROGRESS_DEADLINE_EXCEEDED:
            leader = next((p.name for p in self.learner_pods if rank(p.name) == 0), None)
            self.finish(Phase.FAILED, Reason.STALLED, cause.message,
                         FailureStatus(role="learner", pod=leader, reason=Reason.STALLED, message=cause.message))
            return True
        self.conditions.set(ConditionType.PROGRESSING, "False", cause.reason, cause.message)
        self.new.message = cause.message
        return False


class _Derivation(_ProgressRules):
    """One pass of the state machine over a RunRecord."""

    def decide(self) -> None:
        if self.old.phase in FINISHED_PHASES:
            self._after_finish()
            return
        if not self.new.conditions:
            _initial_conditions(self.conditions)
            if not self.seen.work_kept_locally:
                for warning in unkept_work(self.spec):
                    self.event("Warning", Reason.WORK_NOT_KEPT, warning)
        self._count_pods()
        if self.spec.run_policy.suspend or self.seen.hold is not None:
            self._suspend()
            return
        if self.old.phase == Phase.SUSPENDED:
            self._resume()
        if self.new.start_time is None:
            self.new.start_time = format_time(self.now)
        self._take_progress()
        if self._decide_on_exits():
            return
        self._scale()
        missing = self._missing_pods()
        if missing or not self.seen.children_exist:
            self.actions.append(CreateChildren())
        phase = self._running_phase(missing)
        self._surface_create_error()
        self.tick_clock(running=phase == Phase.RUNNING)
        if self._check_deadlines(waiting=phase != Phase.RUNNING) or self._check_stall(running=phase == Phase.RUNNING):
            return
        self.set_phase(phase)

    # --- observations ------------------------------------------------------------------------------------------
    def _count_pods(self, *, finished: bool = False) -> None:
        """status.rollout and status.learner from the pods that exist. A finished run is counted too: once
        cleanPodPolicy has deleted its servers it claims none (the scale subresource and `kubectl get` read these)."""
        self.new.rollout = rollout_status(self.spec.rollout.replicas, self.rollout_pods + self.surplus_pods,
                                          self.old.rollout, selector=rollout_selector(self.run.name),
                                          now=format_time(self.now))
        learner_ready = sum(1 for p in self.learner_pods if p.phase == "Running")
        self.new.learner = LearnerStatus(nodes=self.spec.learner.nodes, ready=learner_ready, restarts=self.new.restarts)
        if finished:
            self._finished_rollout_ready()
        else:
            self._rollout_ready()

    def _finished_rollout_ready(self) -> None:
        """RolloutReady of a finished run: what its remaining pods show, False with reason Finished once its servers
        are gone; no event (the run's end was announced)."""
        ready, reason, message = readiness(self.new.rollout, self.spec.run_policy.rollout_restart_limit)
        if not ready:
            wanted = len(wanted_servers(self.new.rollout))
            reason, message = (Reason.FINISHED,
                               f"the run has finished: {self.new.rollout.ready}/{wanted} rollout servers ready")
        self.conditions.set(ConditionType.ROLLOUT_READY, "True" if ready else "False", reason, message)

    def _rollout_ready(self) -> None:
        stuck = {}  # by replica: `ImagePullBackOff: ...`, `Unschedulable: 0/4 nodes are available: ...`
        for pod in self.rollout_pods:
            if (waiting := _waiting_reason([pod], [])) is not None:
                reason, text = waiting[0], waiting[1].removeprefix(f"pod {pod.name}: ")
                stuck[rank(pod.name)] = f"{reason}: {text.removeprefix(f'{reason}: ')}"
        ready, reason, message = readiness(self.new.rollout, self.spec.run_policy.rollout_restart_limit, stuck)
        if not ready:
            changed = self.conditions.set(ConditionType.ROLLOUT_READY, "False", reason, message)
            if changed and self.old.phase == Phase.RUNNING:
                self.event("Warning", reason, message)
        elif self.conditions.set(ConditionType.ROLLOUT_READY, "True", reason, message):
            self.event("Normal", Reason.ROLLOUT_READY, message)

    def _missing_pods(self) -> list[tuple[str, int]]:
        # A pod being deleted still holds its name: its slot is not free until it is gone (a create would be a 409).
        present = {(p.role, rank(p.name)) for p in self.pods + self.terminating}
        expected = [("rollout", i) for i in range(self.spec.rollout.replicas)]
        expected += [("learner", r) for r in range(self.spec.learner.nodes)]
        return [slot for slot in expected if slot not in present]

    def _running_phase(self, missing: list[tuple[str, int]]) -> Phase:
        # A running learner goes on while rollout servers are replaced (it waits when none is left): the run stays
        # Running and its progress clock counts, so progressDeadlineSeconds bounds the wait.
        learner_whole = not any(role == "learner" for role, _ in missing + [(p.role, 0) for p in self.terminating])
        if (self.old.phase == Phase.RUNNING and learner_whole and self.learner_pods
                and all(p.phase == "Running" for p in self.learner_pods)):
            return Phase.RUNNING
        if missing or self.terminating or any(p.phase in ("Pending", "Unknown") for p in self.pods):
            self._surface_waiting(default=(Reason.PODS_PENDING, "waiting for pods to be created and scheduled"))
            return Phase.PENDING
        all_ready = self.conditions.is_true(ConditionType.ROLLOUT_READY)
        learners_running = all(p.phase == "Running" for p in self.learner_pods)
        # Once running, an unready rollout server does not stop the run (or its clock): RolloutReady says it.
        if learners_running and (all_ready or self.old.phase == Phase.RUNNING):
            return Phase.RUNNING
        self._surface_waiting(default=(Reason.STARTING, "pods running; waiting for the rollout servers to be ready"))
        return Phase.STARTING

    def _reported(self, reason: str) -> bool:
        """The last pass's status already showed `reason` on Progressing: its event was emitted then. (The condition
        of this pass may have been overwritten by an earlier step of the same pass: not the one to compare with.)"""
        previous = next((c for c in self.old.conditions if c.type == ConditionType.PROGRESSING.value), None)
        return previous is not None and previous.reason == reason

    def _surface_waiting(self, default: tuple[str, str]) -> None:
        reason, message = _waiting_reason(self.pods, self.terminating) or default
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, message)
        # Pods being deleted are routine on every restart: no event, but the message says who is waited for. While a
        # create fails, CreateFailed takes the condition (below), so a stuck pod is reported once that clears (else
        # it would be "new" again on every pass).
        quiet = reason in (Reason.PODS_PENDING, Reason.STARTING, Reason.POD_TERMINATING)
        if not quiet and self.seen.create_error is None and not self._reported(reason):
            self.event("Warning", reason, message)
        self.new.message = None if reason in (Reason.PODS_PENDING, Reason.STARTING) else message

    def _surface_create_error(self) -> None:
        error = self.seen.create_error
        if error is None:
            return
        self.conditions.set(ConditionType.PROGRESSING, "False", Reason.CREATE_FAILED, error)
        if not self._reported(Reason.CREATE_FAILED):
            self.event("Warning", Reason.CREATE_FAILED, error)
        self.new.message = error

    # --- a live replica change ----------------------------------------------------------------------------------
    def _scale(self) -> None:
        """Keep the run config's `rollout.urls` at the spec's servers and delete the removed servers the learner has
        let go. While removed servers' pods remain, or the config lists another count (a scale back up while servers
        drain: no pod is missing, but their URLs must join again), ConfigureRollout comes first of the pass's
        actions: a server leaves the config before its pod may go, and joins it before the learner is expected to
        use it. (A scale-up's new servers are missing pods: CreateChildren adds their URLs before it creates them.)"""
        configured = self.seen.configured_servers
        if self.surplus_pods or (configured is not None and configured != self.spec.rollout.replicas):
            self.actions.insert(0, ConfigureRollout(self.spec.rollout.replicas))
        rollout = self.new.rollout
        refused = self.seen.scale_refused
        if refused is not None and refused != (self.old.rollout.scale_refused if self.old.rollout else None):
            self.event("Warning", Reason.SCALE_REFUSED, refused)
        rollout.scale_refused = refused
        before = len(wanted_servers(self.old.rollout)) if self.old.rollout else None
        if before is not None and before != self.spec.rollout.replicas and self.old.phase is not None:
            self.event("Normal", Reason.SCALED, scaling.scale_message(before, self.spec.rollout.replicas))
        learner_running = any(p.phase == "Running" for p in self.learner_pods)
        gone = scaling.removals(self.surplus_pods, rollout.servers, self.progress, learner_running=learner_running,
                                now=self.now, deadline_s=drain_deadline_seconds(self.spec))
        if gone:
            self.actions.append(DeletePods(tuple(removal.pod for removal in gone), reason="drained"))
        for removal in gone:
            self.event(removal.type, removal.reason, removal.message)

    # --- exits and the end of a run ----------------------------------------------------------------------------
    def _decide_on_exits(self) -> bool:
        verdict = classify_failure(self.learner_pods, self.rollout_pods, self.spec, restarts=self.new.restarts,
                                   disruptions=self.new.disruptions, removed_learners=self._removed_learners())
        if verdict is None:
            return self._replace_servers()
        if isinstance(verdict, Succeed):
            if verdict.output is not None:
                self.new.output = output_status(verdict.output)
                self.event("Normal", Reason.EXPORTED, _exported_message(verdict.output))
            self.finish(Phase.SUCCEEDED, verdict.reason, verdict.message)
        elif isinstance(verdict, Fail):
            if verdict.stall is not None:
                self.conditions.set(ConditionType.STALLED, "True", verdict.stall.reason, verdict.stall.message)
            self.finish(Phase.FAILED, verdict.reason, verdict.message, verdict.failure)
        elif isinstance(verdict, Restart):
            if verdict.stall is not None and self.conditions.set(ConditionType.STALLED, "True", verdict.stall.reason,
                                                                 verdict.stall.message):
                self.event("Warning", verdict.stall.reason, f"{verdict.stall.message} (stallPolicy Report: "
                           "the pods restart under backoffLimit)")
            return self._restart(verdict)
        return True

    def _replace_servers(self) -> bool:
        """Rollout servers that exited are replaced one by one while the learner goes on; True when the run failed."""
        limit = self.spec.run_policy.rollout_restart_limit
        used = {server.replica: server.restarts for server in self.new.rollout.servers}
        outcome = classify_rollout_exits(self.rollout_pods, used, limit=limit,
                                         rules=self.spec.run_policy.pod_failure_policy or ())
        if isinstance(outcome, Fail):
            self.finish(Phase.FAILED, outcome.reason, outcome.message, outcome.failure)
            return True
        for restart in outcome:
            self.actions.append(RecreatePods((restart.pod,)))
            if not restart.counted:
                count = count_restart(self.new.rollout, restart)
                error = f": {restart.error}" if restart.error else ""
                self.event("Warning", Reason.ROLLOUT_RESTARTED, f"{restart.what}; restart {count}/{limit}, the "
                           f"learner goes on with the other servers or waits for this one{error}")
        if outcome:
            self._rollout_ready()
        return False

    def _restart(self, verdict: Restart) -> bool:
        """Recreate the verdict's pods; True when the pass ends here (the learner restarts: the run is Pending)."""
        if verdict.pods:  # none when every pod to restart is going already (a drain)
            self.actions.append(RecreatePods(verdict.pods))
        # Rollout servers alone (a disrupted one, one a podFailurePolicy rule restarts): a running learner goes on.
        learners = {p.name for p in self.learner_pods} & set(verdict.pods) or self._removed_learners()
        servers_only = self.old.phase == Phase.RUNNING and not learners
        resume = "the learner goes on" if servers_only else "resuming from the last checkpoint"
        if not verdict.counted:
            detail = f": {verdict.detail}" if verdict.detail else ""
            if verdict.disruption is not None:
                self.new.disruptions += 1
                limit = self.spec.run_policy.max_disruptions
                self.event("Warning", Reason.DISRUPTED, f"{verdict.what}; disruption {self.new.disruptions}"
                           + (f"/{limit}" if limit is not None else "")
                           + f", not counted against backoffLimit; {resume}")
            else:
                self.new.restarts += 1
                self.event("Warning", Reason.RESTARTING, f"{verdict.what}; restart {self.new.restarts}/"
                           f"{self.spec.run_policy.backoff_limit}, {resume}{detail}")
        self.new.learner.restarts = self.new.restarts
        if servers_only:
            return False
        self.tick_clock(running=False)
        reason = Reason.DISRUPTED if verdict.disruption is not None else Reason.RESTARTING
        self.conditions.set(ConditionType.PROGRESSING, "False", reason, verdict.what)
        self.set_phase(Phase.PENDING)
        return True

    def _removed_learners(self) -> list[str]:
        """Learner pods that vanished from a running gang, or are going (the Eviction API, a manual delete). One seen
        while Terminating counts: the operator's own deletes leave the run Pending, so in a Running or Starting run
        someone else deleted it, and waiting until it is gone would leave the rest of the gang on an ended rendezvous
        (by then the run is Pending and the gap looks like a pod still to create)."""
        if self.old.phase not in (Phase.RUNNING, Phase.STARTING):
            return []
        present = {rank(p.name) for p in self.learner_pods}
        return [learner_pod_name(self.run.name, r) for r in range(self.spec.learner.nodes) if r not in present]

    def _after_finish(self) -> None:
        self._count_pods(finished=True)
        self.clean_pods()
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        if ttl is not None and self.new.completion_time and seconds_since(self.now, self.new.completion_time) >= ttl:
            self.actions.append(DeleteRun())

    # --- suspend -----------------------------------------------------------------------------------------------
    def _suspend(self) -> None:
        if self.pods:
            self.actions.append(DeletePods(tuple(sorted(p.name for p in self.pods)), reason="suspended"))
        self.tick_clock(running=False)
        reason, message = Reason.SUSPENDED, _phase_message(self.spec, Phase.SUSPENDED)
        if not self.spec.run_policy.suspend and self.seen.hold is not None:
            reason, message = self.seen.hold
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
        # Waiting to run again is timed from the resume, not from the suspension.
        self.new.progress_clock = clock.restart_pause(self.new.progress_clock, self.now)

def _exported_message(report: ExportReport) -> str:
    return (f"model exported to {report.uri}: step {report.step}, {report.bytes} bytes, manifest sha256 "
            f"{report.sha256}")


def _initial_conditions(conditions: Conditions) -> None:
    set_ = conditions.set
    set_(ConditionType.ROLLOUT_READY, "False", Reason.REPLICAS_NOT_READY, "no rollout server is ready yet")
    set_(ConditionType.PROGRESSING, "False", Reason.PODS_PENDING, "creating pods")
    set_(ConditionType.STALLED, "False", Reason.NOT_STALLED, "")
    set_(ConditionType.SUSPENDED, "False", Reason.NOT_SUSPENDED, "")
    set_(ConditionType.SUCCEEDED, "False", Reason.NOT_FINISHED, "")
    set_(ConditionType.FAILED, "False", Reason.NOT_FINISHED, "")


def _phase_message(spec: GRPORunSpec, phase: Phase) -> str:
    messages = {
        Phase.PENDING: f"creating {spec.rollout.replicas} rollout and {spec.learner.nodes} learner pods",
        Phase.STARTING: "pods are running; waiting for the rollout servers and the learner",
        Phase.RUNNING: "rollout servers ready, learner training",
        Phase.SUSPENDED: "spec.runPolicy.suspend is true: pods deleted, the run is kept",
    }
    return messages.get(phase, phase.value)


def _waiting_reason(pods: list[PodObservation], terminating: list[PodObservation]) -> tuple[str, str] | None:
    """A pod that will not start by itself (image pull, crash loop, unschedulable), or one being deleted that must
    be gone before it can be created again, as (reason, message)."""
    for pod in terminating:
        return Reason.POD_TERMINATING, (f"pod {pod.name} is being deleted; it is created again once it is gone "
                                        "(a pod on an unreachable node stays Terminating until the node is removed)")
    for pod in pods:
        if pod.waiting_reason in STUCK_WAITING_REASONS:
            return pod.waiting_reason, f"pod {pod.name}: {pod.waiting_reason}: {pod.message or ''}".strip()
        if pod.phase == "Pending" and pod.reason == Reason.UNSCHEDULABLE:
            return Reason.UNSCHEDULABLE, f"pod {pod.name}: {pod.message or 'unschedulable'}"
    return None


def _wire(status: GRPORunStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
