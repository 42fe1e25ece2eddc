"""The failure policy: what a run does when its pods exit (as jobset keeps its failure policy apart).

`classify_failure` looks at the pods that exited and says: the run succeeded, the run fails (and why), the pods
restart, or nothing happened. The rules, which docs/operator.md spells out for users:
- learner rank 0 exiting 0 means the run succeeded: at the epoch bound, or earlier when TRL's `max_steps` ended it
  (its final report says so, and the reason is MaxStepsReached);
- a learner preempted (SIGTERM: a drain, a spot reclaim) checkpointed and exited EXIT_PREEMPTED: its gang restarts
  without counting against `backoffLimit`;
- the learner's permanent exit codes (stalled, invalid config) fail the run at once: a retry cannot help;
- any other exit, of a learner or of a rollout server (a server never exits by itself), restarts the pods while
  `runPolicy.backoffLimit` allows, then fails the run with BackoffLimitExceeded;
- accelerate's ranks rendezvous once, so when one learner pod dies the whole learner gang restarts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from grpo_trainer.contract import (
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_SUCCEEDED,
    PERMANENT_EXIT_CODES,
    ProgressReport,
    parse_progress,
)

from ..api import FailureStatus, Reason
from .decision import PodObservation, rank

FAILURE_MESSAGE_MAX_CHARS = 1024


@dataclass(frozen=True)
class Succeed:
    reason: str
    message: str


@dataclass(frozen=True)
class Fail:
    reason: str
    message: str
    failure: FailureStatus
    stalled: str | None = None  # the Stalled condition's message, when the learner stopped as stalled


@dataclass(frozen=True)
class Restart:
    pods: tuple[str, ...]  # every pod to delete and create again
    what: str  # which pod exited how, for the event
    detail: str  # the pod's own last words (termination message), may be empty
    counted: bool = True  # False: a preemption, which does not use up backoffLimit


Verdict = Succeed | Fail | Restart


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


def classify_failure(learner_pods: Sequence[PodObservation], rollout_pods: Sequence[PodObservation], *,
                     restarts: int, backoff_limit: int) -> Verdict | None:
    """The run's fate from its exited pods; None while nothing has exited. `restarts` are those used so far."""
    leader = next((p for p in learner_pods if rank(p.name) == 0), None)
    if leader is not None and leader.phase == "Succeeded" and leader.exit_code in (EXIT_SUCCEEDED, None):
        report = report_from_termination_message(leader.message)
        if report is not None and report.ended_short:  # TRL's max_steps ended it before the epoch bound
            return Succeed(Reason.MAX_STEPS_REACHED, f"the learner exited 0: {report.message}")
        return Succeed(Reason.EPOCH_BOUND_REACHED, "the learner reached the epoch bound and exited 0")
    failed = [p for p in learner_pods if p.phase == "Failed"]
    failed += [p for p in rollout_pods if p.phase in ("Failed", "Succeeded")]  # a server never exits
    if not failed:
        return None
    first = failed[0]
    code = first.exit_code
    what = f"{first.role} pod {first.name} exited with code {code}" if code is not None else \
        f"{first.role} pod {first.name} failed ({first.reason or 'no exit code'})"
    detail = failure_text(first)
    with_detail = f"{what}: {detail}" if detail else what
    failure = FailureStatus(role=first.role, pod=first.name, exit_code=code, reason=first.reason,
                            message=detail or None)
    if code in PERMANENT_EXIT_CODES:
        reason = Reason.STALLED if code == EXIT_STALLED else Reason.INVALID_CONFIG
        failure.reason = reason
        return Fail(reason, with_detail, failure, stalled=(detail or what) if reason == Reason.STALLED else None)
    counted = code != EXIT_PREEMPTED
    if counted and restarts >= backoff_limit:
        failure.reason = failure.reason or Reason.BACKOFF_LIMIT_EXCEEDED
        return Fail(Reason.BACKOFF_LIMIT_EXCEEDED,
                    f"{what} after {restarts} restarts (backoffLimit {backoff_limit})"
                    + (f": {detail}" if detail else ""), failure)
    restart = {p.name for p in failed}
    if any(p.role == "learner" for p in failed):
        restart |= {p.name for p in learner_pods}
    return Restart(tuple(sorted(restart)), what, detail, counted)
