"""One pass of one run, the same for a cluster and for `grporun local`: observe -> derive -> write -> act.

`run_pass` is the only place the sequence is written. What differs between the two is behind a `RunPort`: the
cluster adapter (cluster/reconcile.py) observes pods through the API server's index and writes the GRPORun's status
subresource; the local adapter (local/supervise.py) observes processes and keeps the status in memory. What is
decided is decided once, by status.derive_status; each action it returns is carried out through one table from the
action's type to the port method that does it.

Kueue admission is a capability a port may have, as Kueue's `JobWith*` interfaces make a job integration's
capabilities optional: a port that can hold a run in a Kueue Workload is also a `QueuedRunPort` (the cluster's is;
a local run has no queue). A Workload action decided for a port without it is an error, raised before anything is
written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .api import GRPORunSpec
from .run_ref import RunRef
from .status import (
    Action,
    ConfigureRollout,
    CreateChildren,
    CreateWorkload,
    Decision,
    DeletePods,
    DeleteRun,
    FinishWorkload,
    Observation,
    RecreatePods,
    ReleaseQuota,
    ResizeWorkload,
    derive_status,
)


@dataclass(frozen=True)
class Observed:
    """What a port saw of a run this pass: the spec to run it by (as admitted: a refused scale keeps the count in
    effect; None when it cannot be parsed, `seen.spec_error` saying why), the status the derivation starts from, and
    the world."""

    spec: GRPORunSpec | None
    status: dict[str, Any] | None
    seen: Observation


class RunPort(Protocol):
    """Where a run lives. `observe` only reads; everything the pass changes goes through the other methods."""

    async def observe(self) -> Observed: ...

    async def write(self, decision: Decision) -> bool:
        """Land the decided status, then its events. False when the run is gone (no action follows)."""

    async def configure_rollout(self, replicas: int) -> None:
        """Make the run config's `rollout.urls` list `replicas` servers."""

    async def create_children(self, status: dict[str, Any]) -> None:
        """Create what is missing of the run (config, services, pods), at the restart counts `status` holds."""

    async def delete_pods(self, pods: tuple[str, ...], reason: str) -> None: ...

    async def recreate_pods(self, pods: tuple[str, ...]) -> None:
        """Delete these pods so that the next pass's CreateChildren starts them again."""

    async def delete_run(self) -> None: ...


@runtime_checkable
class QueuedRunPort(RunPort, Protocol):
    """A port whose runs Kueue admits through a Workload (status.admission decides; only a run whose observation
    names a Workload gets these actions)."""

    async def create_workload(self) -> None: ...

    async def release_quota(self) -> None: ...

    async def resize_workload(self) -> None: ...

    async def finish_workload(self, status: dict[str, Any]) -> None:
        """Mark the Workload Finished, with the run's final `status` (its phase and message)."""


class NoQueue(TypeError):
    """The pass decided a Kueue Workload action for a port that has no Kueue admission."""


ActionFn = Callable[[Any, Any, Decision], Awaitable[None]]

#: Each action the derivation can return for any run, and the RunPort method that carries it out.
ACTIONS: dict[type[Action], ActionFn] = {
    ConfigureRollout: lambda port, action, _: port.configure_rollout(action.replicas),
    CreateChildren: lambda port, _, decision: port.create_children(decision.status),
    DeletePods: lambda port, action, _: port.delete_pods(action.pods, action.reason),
    RecreatePods: lambda port, action, _: port.recreate_pods(action.pods),
    DeleteRun: lambda port, _action, _decision: port.delete_run(),
}

#: The Workload actions, for a queued run, and the QueuedRunPort method that carries each out.
QUEUE_ACTIONS: dict[type[Action], ActionFn] = {
    CreateWorkload: lambda port, _action, _decision: port.create_workload(),
    ReleaseQuota: lambda port, _action, _decision: port.release_quota(),
    ResizeWorkload: lambda port, _action, _decision: port.resize_workload(),
    FinishWorkload: lambda port, _, decision: port.finish_workload(decision.status),
}


async def run_pass(run: RunRef, port: RunPort) -> Decision | None:
    """One pass: the decision carried out, or None when the run was gone at the write (nothing was acted on).
    Raises NoQueue, before writing, when it decided a Workload action for a port that is not a QueuedRunPort."""
    observed = await port.observe()
    decision = derive_status(run, observed.spec, observed.status, observed.seen)
    queued = [type(action).__name__ for action in decision.actions if type(action) in QUEUE_ACTIONS]
    if queued and not isinstance(port, QueuedRunPort):
        raise NoQueue(f"{type(port).__name__} has no Kueue admission, but the pass decided {', '.join(queued)}: "
                      "its observation named a Workload")
    if not await port.write(decision):
        return None
    for action in decision.actions:
        carry_out = ACTIONS.get(type(action)) or QUEUE_ACTIONS[type(action)]
        await carry_out(port, action, decision)
    return decision
