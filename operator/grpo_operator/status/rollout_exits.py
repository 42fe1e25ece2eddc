"""Rollout servers that exit: each is replaced alone, with its own counter and limit.

A vLLM server never ends by itself: any exit, 0 included (vLLM exits 0 after its engine died), is a failure. The
learner takes the dead server out of its pool and goes on with the others (with a single server it
waits); the operator deletes the pod and creates it again. Each server's restarts are counted in
`status.rollout.servers[i].restarts` against `runPolicy.rolloutRestartLimit`, never against the learner's
`backoffLimit`; the exit after the last allowed restart fails the run with RolloutRestartLimitExceeded and the
engine's error line. A rollout pod that was disrupted, or that a podFailurePolicy rule matches, follows exits.py.

A crash is counted once: a rollout pod carries its server's restart count at creation, so a pass replayed after a
failed delete or an operator crash deletes it again without counting it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grpo_trainer.contract.rollout_pod import EXIT_LINE_PREFIX, engine_error_line

from ..api import PodFailureRule
from ..run_status import FailureStatus, Reason
from .decision import PodObservation, rank
from .exits import Fail, exit_summary, replaced_alone


@dataclass(frozen=True)
class ServerRestart:
    pod: str
    replica: int
    what: str  # which pod exited how, for the event
    error: str | None  # the engine's error line
    counted: bool = False  # an earlier pass counted this exit already (its delete did not happen)


def rollout_error_line(message: str | None) -> str | None:
    """The engine's error line out of a rollout pod's termination message.

    The rollout entrypoint writes `grpo rollout: vLLM exited with code N: <error line>` (grpo_trainer.server.main); when
    the entrypoint itself was killed the kubelet falls back to the log's tail, where the root error is looked for
    past vLLM's wrappers and the nanobind leak dump.
    """
    if not message:
        return None
    lines = message.splitlines()
    summaries = [line.removeprefix(EXIT_LINE_PREFIX) for line in lines if line.startswith(EXIT_LINE_PREFIX)]
    if summaries:
        return summaries[-1].partition(": ")[2].strip() or None
    return engine_error_line(lines)


def classify_rollout_exits(rollout_pods: Sequence[PodObservation], restarts: Mapping[int, int], *, limit: int,
                           rules: Sequence[PodFailureRule] = ()) -> list[ServerRestart] | Fail:
    """The servers to replace, or the run's failure once a server exits with its restarts used up.

    `restarts` are each server's restarts so far, by replica index.
    """
    replaced = []
    for pod in rollout_pods:
        if not replaced_alone(pod, rules):
            continue
        replica, what, error = rank(pod.name), exit_summary(pod), rollout_error_line(pod.message)
        used = restarts.get(replica, 0)
        if pod.rollout_restarts is not None and pod.rollout_restarts < used:
            replaced.append(ServerRestart(pod.name, replica, what, error, counted=True))
            continue
        if used >= limit:
            reason = Reason.ROLLOUT_RESTART_LIMIT_EXCEEDED
            failure = FailureStatus(role="rollout", pod=pod.name, exit_code=pod.exit_code, reason=reason,
                                    message=error)
            message = f"{what} after {used} restarts (runPolicy.rolloutRestartLimit {limit})"
            return Fail(reason, message + (f": {error}" if error else ""), failure)
        replaced.append(ServerRestart(pod.name, replica, what, error))
    return replaced
