"""The failure policy: what a run does when its pods exit (as jobset keeps its failure policy apart).

`classify_failure` looks at the pods that exited and says: the run succeeded, the run fails (and why), the pods
restart, or nothing happened. The rules, which docs/operator.md spells out for users:
- learner rank 0 exiting 0 means the run succeeded: at the epoch bound, or earlier when TRL's `max_steps` ended it
  (its final report says so, and the reason is MaxStepsReached); but when the run has `spec.output`, only with the
  exported model in its final report: a run never succeeds without its model (ExportFailed);
- the learner's permanent exit codes (stalled, export failed, invalid config) fail the run at once: a retry cannot
  help (an export failure's checkpoints stay, and the reason names the cause); except
  that a weight sync past its deadline (the learner's report names it: `WeightSyncStuck`) is a stall on a clock,
  which `progress.stallPolicy` handles like the progress deadline: `Fail` fails the run, `Report` reports it and
  restarts the pods under `runPolicy.backoffLimit` (a new process opens new connections and process groups);
- a disruption (a pod with a True DisruptionTarget condition: evicted, preempted, removed by the taint manager or
  the kubelet; a learner pod deleted from a running gang; the learner's own preempted exit code) restarts the pods
  without counting against `runPolicy.backoffLimit`: it has its own counter and the optional
  `runPolicy.maxDisruptions`;
- a rollout server that exits (any code: a server never ends by itself, and vLLM exits 0 after its engine died) is
  replaced alone, with its own counter and `runPolicy.rolloutRestartLimit` (rollout_exits.py), unless a
  podFailurePolicy rule matches it, it was disrupted, or it refused its config (78, permanent as for a learner);
- any other exit of a learner restarts the pods while `runPolicy.backoffLimit` allows, then fails the run with
  BackoffLimitExceeded;
- accelerate's ranks rendezvous once, so when one learner pod dies the whole learner gang restarts;
- a failure is counted once: pods carry the attempt they were created at (restarts + disruptions), so a pass
  replayed after a failed delete or an operator crash re-issues the restart without counting it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from grpo_trainer.contract.codes import (
    EXIT_EXPORT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_SUCCEEDED,
    PERMANENT_EXIT_CODES,
    StallCause,
)
from grpo_trainer.contract.report import ExportReport, ProgressReport, parse_progress

from ..api import FailureStatus, GRPORunSpec, PodFailureRule, Reason
from .decision import PodObservation, rank

FAILURE_MESSAGE_MAX_CHARS = 1024

#: The learner's "preempted" exit code: on SIGTERM (a drain, a spot reclaim) it checkpointed and left because it was
#: asked to. Handled as a disruption, not against backoffLimit.
PREEMPTED_EXIT_CODES: frozenset[int] = frozenset({EXIT_PREEMPTED})
#: The reason a permanent exit code other than the stall's fails the run with.
PERMANENT_EXIT_REASONS = {EXIT_INVALID_CONFIG: Reason.INVALID_CONFIG, EXIT_EXPORT_FAILED: Reason.EXPORT_FAILED}


@dataclass(frozen=True)
class Succeed:
    reason: str
    message: str
    output: ExportReport | None = None  # the model the learner exported (spec.output)


@dataclass(frozen=True)
class Stall:
    """The Stalled condition a learner that ended as stalled sets: its reason and message."""

    reason: str
    message: str


@dataclass(frozen=True)
class Fail:
    reason: str
    message: str
    failure: FailureStatus
    stall: Stall | None = None  # when the learner stopped as stalled


@dataclass(frozen=True)
class Restart:
    pods: tuple[str, ...]  # every pod to delete and create again
    what: str  # which pod exited how, for the event
    detail: str  # the pod's own last words (termination message), may be empty
    disruption: str | None = None  # the disruption's reason: counted as a disruption, not against backoffLimit
    counted: bool = False  # an earlier pass counted this failure already (its deletes did not all happen)
    stall: Stall | None = None  # a stall that `stallPolicy: Report` restarts instead of failing the run


Verdict = Succeed | Fail | Restart


def report_from_termination_message(message: str | None) -> ProgressReport | None:
    """The learner writes its final ProgressReport as its termination message; anything else is a log tail."""
    if not message:
        return None
    try:
        return parse_progress(message)
    except (ValidationError, ValueError):
        return None


def stall_reason(pod: PodObservation) -> str:
    """The Stalled condition's reason for a learner that exited EXIT_STALLED, from the cause its report names."""
    report = report_from_termination_message(pod.message)
    if report is not None and report.stall_cause == StallCause.WEIGHT_SYNC:
        return Reason.WEIGHT_SYNC_STUCK
    return Reason.STALLED


def failure_text(pod: PodObservation) -> str:
    report = report_from_termination_message(pod.message)
    text = report.message if report is not None and report.message else (pod.message or pod.reason or "")
    return text.strip()[-FAILURE_MESSAGE_MAX_CHARS:]


def policy_action(pod: PodObservation, rules: Sequence[PodFailureRule]) -> str | None:
    """The action of the first `runPolicy.podFailurePolicy` rule the failed pod matches, if any."""
    return next((rule.action for rule in rules if rule.matches(pod.exit_code, pod.conditions)), None)


def server_exited(pod: PodObservation) -> bool:
    """A rollout server's pod that ended, with any code: a server never ends by itself."""
    return pod.role == "rollout" and pod.phase in ("Failed", "Succeeded")


def replaced_alone(pod: PodObservation, rules: Sequence[PodFailureRule] = ()) -> bool:
    """A rollout server that exited on its own: no disruption, no podFailurePolicy rule (rollout_exits.py), and not
    the rollout entrypoint's invalid-config exit, which a new pod would repeat: that fails the run at once."""
    return (server_exited(pod) and pod.disruption is None and policy_action(pod, rules) is None
            and pod.exit_code != EXIT_INVALID_CONFIG)


def disruption_of(pod: PodObservation, rules: Sequence[PodFailureRule] = ()) -> str | None:
    """Why a pod was disrupted (not its own fault), or None for a crash."""
    action = policy_action(pod, rules)
    if action is not None:
        return Reason.POD_FAILURE_POLICY if action == "Ignore" else None
    if pod.disruption is not None:
        return pod.disruption
    if pod.role == "learner" and pod.exit_code in PREEMPTED_EXIT_CODES:
        return "Preempted"
    return None


def classify_failure(learner_pods: Sequence[PodObservation], rollout_pods: Sequence[PodObservation],
                     spec: GRPORunSpec, *, restarts: int, disruptions: int = 0,
                     removed_learners: Sequence[str] = ()) -> Verdict | None:
    """The run's fate from its exited pods under the run's `spec`; None while nothing has exited.

    `restarts` and `disruptions` are those used so far (against `runPolicy.backoffLimit` and `maxDisruptions`);
    `removed_learners` are learner pods that vanished from a running gang (deleted through the Eviction API, say):
    the rest of the gang cannot go on without them. The run's `runPolicy.podFailurePolicy`: the first rule a failed
    pod matches decides, before the defaults. `progress.stallPolicy` decides what a weight sync past its deadline
    does. A run with `spec.output` must report the exported model when it succeeds.
    """
    rules: Sequence[PodFailureRule] = spec.run_policy.pod_failure_policy or ()
    backoff_limit, max_disruptions = spec.run_policy.backoff_limit, spec.run_policy.max_disruptions
    stall_policy, output_expected = spec.progress.stall_policy, spec.output is not None
    leader = next((p for p in learner_pods if rank(p.name) == 0), None)
    if leader is not None and leader.phase == "Succeeded" and leader.exit_code in (EXIT_SUCCEEDED, None):
        report = report_from_termination_message(leader.message)
        output = report.output if report is not None else None
        if output_expected and output is None:
            message = (f"learner pod {leader.name} exited 0 without reporting an exported model, though spec.output "
                       "is set (a learner image that does not export?); its last checkpoint stays")
            return Fail(Reason.EXPORT_FAILED, message, FailureStatus(
                role="learner", pod=leader.name, exit_code=leader.exit_code, reason=Reason.EXPORT_FAILED,
                message=message))
        if report is not None and report.ended_short:  # TRL's max_steps ended it before the epoch bound
            return Succeed(Reason.MAX_STEPS_REACHED, f"the learner exited 0: {report.message}", output)
        return Succeed(Reason.EPOCH_BOUND_REACHED, "the learner reached the epoch bound and exited 0", output)
    failed = [p for p in learner_pods if p.phase == "Failed"]
    failed += [p for p in rollout_pods if server_exited(p) and not replaced_alone(p, rules)]
    crashed = [p for p in failed if disruption_of(p, rules) is None]
    if not crashed:
        return _disrupted(failed, learner_pods, removed_learners, restarts + disruptions, disruptions,
                          max_disruptions, rules)
    first = crashed[0]
    if first.attempt is not None and first.attempt < restarts + disruptions:
        return Restart(_gang(failed, learner_pods), exit_summary(first), failure_text(first), counted=True)
    code = first.exit_code
    what = exit_summary(first)
    detail = failure_text(first)
    with_detail = f"{what}: {detail}" if detail else what
    failure = FailureStatus(role=first.role, pod=first.name, exit_code=code, reason=first.reason,
                            message=detail or None)
    action = policy_action(first, rules)
    if action == "Fail":
        failure.reason = Reason.POD_FAILURE_POLICY
        return Fail(Reason.POD_FAILURE_POLICY, f"{with_detail} (a runPolicy.podFailurePolicy rule says Fail)", failure)
    stall = Stall(stall_reason(first), detail or what) if code == EXIT_STALLED and action is None else None
    reported = stall is not None and stall.reason == Reason.WEIGHT_SYNC_STUCK and stall_policy == "Report"
    if code in PERMANENT_EXIT_CODES and action is None and not reported:
        reason = stall.reason if stall is not None else PERMANENT_EXIT_REASONS[code]
        failure.reason = reason
        return Fail(reason, with_detail, failure, stall=stall)
    if restarts >= backoff_limit:
        failure.reason = failure.reason or Reason.BACKOFF_LIMIT_EXCEEDED
        return Fail(Reason.BACKOFF_LIMIT_EXCEEDED,
                    f"{what} after {restarts} restarts (backoffLimit {backoff_limit})"
                    + (f": {detail}" if detail else ""), failure, stall=stall)
    return Restart(_gang(failed, learner_pods), what, detail, stall=stall)


def _disrupted(failed: list[PodObservation], learner_pods: Sequence[PodObservation], removed: Sequence[str],
               attempts: int, disruptions: int, max_disruptions: int | None,
               rules: Sequence[PodFailureRule]) -> Verdict | None:
    if not failed and not removed:
        return None
    if failed:
        first = failed[0]
        reason = disruption_of(first, rules) or "Disrupted"
        what = f"{first.role} pod {first.name} was disrupted ({reason})"
        if first.attempt is not None and first.attempt < attempts:
            return Restart(_gang(failed, learner_pods), what, "", disruption=reason, counted=True)
    else:
        reason, what = "PodDeleted", f"learner pod {removed[0]} was removed from the running gang"
    if max_disruptions is not None and disruptions >= max_disruptions:
        failure = FailureStatus(role="learner" if not failed else failed[0].role,
                                pod=failed[0].name if failed else removed[0], reason=Reason.DISRUPTION_LIMIT_EXCEEDED,
                                message=what)
        return Fail(Reason.DISRUPTION_LIMIT_EXCEEDED,
                    f"{what} after {disruptions} disruptions (maxDisruptions {max_disruptions})", failure)
    pods = _gang(failed, learner_pods, force_gang=bool(removed))
    return Restart(pods, what, "", disruption=reason)


def exit_summary(pod: PodObservation) -> str:
    if pod.reason == Reason.OOM_KILLED:  # exit code 137 alone reads as any SIGKILL
        limit = (f"memory limit {pod.memory_limit}" if pod.memory_limit
                 else "no memory limit set, the node ran out of memory")
        code = f", exit code {pod.exit_code}" if pod.exit_code is not None else ""
        return f"{pod.role} pod {pod.name} was OOMKilled: container {pod.container or pod.role} ({limit}){code}"
    if pod.exit_code is not None:
        return f"{pod.role} pod {pod.name} exited with code {pod.exit_code}"
    return f"{pod.role} pod {pod.name} failed ({pod.reason or 'no exit code'})"


def _gang(failed: Sequence[PodObservation], learner_pods: Sequence[PodObservation], *,
          force_gang: bool = False) -> tuple[str, ...]:
    """The failed pods, plus every learner pod when a learner failed (accelerate's ranks rendezvous once)."""
    restart = {p.name for p in failed}
    if force_gang or any(p.role == "learner" for p in failed):
        restart |= {p.name for p in learner_pods}
    return tuple(sorted(restart))
