"""The kubelet's part in a local run: a step of its own before each pass of the engine, as on a cluster, where the
kubelet acts on the pods and the operator's pass only observes what it did.

Two things, each decided from what the step reads, then carried out: a running rollout server that its liveness
probes find hung is stopped (rollout_restarts.Liveness; the state machine then replaces it like any server that
exited), and an environment server that exited is started again in place once its back-off is over
(environments.InPlaceRestarts: restartPolicy Always).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from grpo_trainer.contract.rollout_pod import EXIT_LINE_PREFIX

from .environments import InPlaceRestarts
from .processes import LocalProcess
from .rollout_restarts import HUNG_STOP_GRACE_S, Liveness


@dataclass(frozen=True)
class StopHung:
    """Stop a rollout server its liveness probes find hung; `why` becomes its termination message."""

    server: str
    why: str


@dataclass(frozen=True)
class RestartInPlace:
    """Start an environment server that exited again, in place (its pod's restartPolicy is Always)."""

    server: str


KubeletAction = StopHung | RestartInPlace


def decide(processes: Iterable[LocalProcess], liveness: Liveness | None,
           in_place: InPlaceRestarts) -> list[KubeletAction]:
    """What the kubelet does now. Reading a hung verdict starts the server's next probe when one is due (on the
    probes' own threads: nothing here waits for a server)."""
    actions: list[KubeletAction] = []
    for process in processes:
        role, name = process.plan.role, process.plan.name
        if role == "environment" and in_place.due(process):
            actions.append(RestartInPlace(name))
        elif (role == "rollout" and liveness is not None and process.popen is not None and process.poll() is None
              and (why := liveness.hung(process)) is not None):
            actions.append(StopHung(name, why))
    return actions


def act(actions: list[KubeletAction], processes: Mapping[str, LocalProcess], in_place: InPlaceRestarts,
        hung: dict[str, str], log: Callable[[str], None]) -> None:
    """Carry out `actions`; `hung` keeps each stopped server's termination message, `log` takes one line each."""
    for action in actions:
        process = processes[action.server]
        if isinstance(action, RestartInPlace):
            in_place.restart(process, log)
            continue
        log(f"Warning RolloutUnresponsive: {action.server}: {action.why}")
        # Written as the entrypoint's exit line, so the state machine carries `why` as the server's error.
        hung[action.server] = f"{EXIT_LINE_PREFIX}stopped by its liveness probe: {action.why}"
        process.stop(grace_s=HUNG_STOP_GRACE_S)
