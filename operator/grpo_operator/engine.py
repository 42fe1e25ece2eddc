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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

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
    RecordImages,
    RecreatePods,
    ReleaseQuota,
    ResizeWorkload,
    derive_status,
)

#: What a port read of a run besides the Observation, for its own write and actions (a frozen value).
State = TypeVar("State")


@dataclass(frozen=True)
class Observed(Generic[State]):
    """What a port saw of a run this pass: the spec to run it by (as admitted: a refused scale keeps the count in
    effect; None when it cannot be parsed, `seen.spec_error` saying why), the status the derivation starts from, the
    world, and the port's own `state`: everything its write and actions use of what it read, handed back to them."""

    spec: GRPORunSpec | None
    status: dict[str, Any] | None
    seen: Observation
    state: State


class RunPort(Protocol[State]):
    """Where a run lives. `observe` only reads; everything the pass changes goes through the other methods, each
    given what that observe returned."""

    async def observe(self) -> Observed[State]: ...

    async def write(self, observed: Observed[State], decision: Decision) -> bool:
        """Land the decided status, then its events. False when the run is gone (no action follows)."""

    async def configure_rollout(self, observed: Observed[State], replicas: int) -> None:
        """Make the run config's `rollout.urls` list `replicas` servers."""

    async def record_images(self, observed: Observed[State], images: Mapping[str, Sequence[str]]) -> None:
        """Make the run config's `images` hold these image digests, by role."""

    async def create_children(self, observed: Observed[State], status: dict[str, Any]) -> None:
        """Create what is missing of the run (config, services, pods), at the restart counts `status` holds."""

    async def delete_pods(self, observed: Observed[State], pods: tuple[str, ...], reason: str) -> None: ...

    async def recreate_pods(self, observed: Observed[State], pods: tuple[str, ...]) -> None:
        """Delete these pods so that the next pass's CreateChildren starts them again."""

    async def delete_run(self, observed: Observed[State]) -> None: ...


@runtime_checkable
class QueuedRunPort(RunPort[State], Protocol[State]):
    """A port whose runs Kueue admits through a Workload (status.admission decides; only a run whose observation
    names a Workload gets these actions)."""

    async def create_workload(self, observed: Observed[State]) -> None: ...

    async def release_quota(self, observed: Observed[State]) -> None: ...

    async def resize_workload(self, observed: Observed[State]) -> None: ...

    async def finish_workload(self, observed: Observed[State], status: dict[str, Any]) -> None:
        """Mark the Workload Finished, with the run's final `status` (its phase and message)."""


@dataclass(frozen=True)
class Outcome(Generic[State]):
    """A pass carried out: what it observed and what it decided (and wrote, and did)."""

    observed: Observed[State]
    decision: Decision


class NoQueue(TypeError):
    """The pass decided a Kueue Workload action for a port that has no Kueue admission."""


ActionFn = Callable[[Any, Observed[Any], Any, Decision], Awaitable[None]]

#: Each action the derivation can return for any run, and the RunPort method that carries it out.
ACTIONS: dict[type[Action], ActionFn] = {
    ConfigureRollout: lambda port, seen, action, _: port.configure_rollout(seen, action.replicas),
    RecordImages: lambda port, seen, action, _: port.record_images(seen, action.images),
    CreateChildren: lambda port, seen, _, decision: port.create_children(seen, decision.status),
    DeletePods: lambda port, seen, action, _: port.delete_pods(seen, action.pods, action.reason),
    RecreatePods: lambda port, seen, action, _: port.recreate_pods(seen, action.pods),
    DeleteRun: lambda port, seen, _action, _decision: port.delete_run(seen),
}

#: The Workload actions, for a queued run, and the QueuedRunPort method that carries each out.
QUEUE_ACTIONS: dict[type[Action], ActionFn] = {
    CreateWorkload: lambda port, seen, _action, _decision: port.create_workload(seen),
    ReleaseQuota: lambda port, seen, _action, _decision: port.release_quota(seen),
    ResizeWorkload: lambda port, seen, _action, _decision: port.resize_workload(seen),
    FinishWorkload: lambda port, seen, _, decision: port.finish_workload(seen, decision.status),
}


async def run_pass(run: RunRef, port: RunPort[State]) -> Outcome[State] | None:
    """One pass, carried out; None when the run was gone at the write (nothing was acted on). Raises NoQueue, before
    writing, when it decided a Workload action for a port that is not a QueuedRunPort."""
    observed = await port.observe()
    decision = derive_status(run, observed.spec, observed.status, observed.seen)
    queued = [type(action).__name__ for action in decision.actions if type(action) in QUEUE_ACTIONS]
    if queued and not isinstance(port, QueuedRunPort):
        raise NoQueue(f"{type(port).__name__} has no Kueue admission, but the pass decided {', '.join(queued)}: "
                      "its observation named a Workload")
    if not await port.write(observed, decision):
        return None
    for action in decision.actions:
        carry_out = ACTIONS.get(type(action)) or QUEUE_ACTIONS[type(action)]
        await carry_out(port, observed, action, decision)
    return Outcome(observed, decision)
