"""One pass of one run, the same for a cluster and for `grporun local`: observe -> derive -> write -> act.

`run_pass` is the only place the sequence is written. What differs between the two is behind a `RunPort`: the
cluster adapter (cluster/reconcile.py) observes pods through the API server's index and writes the GRPORun's status
subresource; the local adapter (local/supervise.py) observes processes and keeps the status in memory. What is
decided is decided once, by status.derive_status; each action it returns is carried out through one table from the
action's type to the port method that does it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

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

    # Kueue admission (status.admission decides; only a run whose observation names a Workload gets these)
    async def create_workload(self) -> None: ...

    async def release_quota(self) -> None: ...

    async def resize_workload(self) -> None: ...

    async def finish_workload(self, status: dict[str, Any]) -> None:
        """Mark the Workload Finished, with the run's final `status` (its phase and message)."""


ActionFn = Callable[[RunPort, Any, Decision], Awaitable[None]]

#: Each action the derivation can return, and the port method that carries it out.
ACTIONS: dict[type[Action], ActionFn] = {
    ConfigureRollout: lambda port, action, _: port.configure_rollout(action.replicas),
    CreateChildren: lambda port, _, decision: port.create_children(decision.status),
    DeletePods: lambda port, action, _: port.delete_pods(action.pods, action.reason),
    RecreatePods: lambda port, action, _: port.recreate_pods(action.pods),
    DeleteRun: lambda port, _action, _decision: port.delete_run(),
    CreateWorkload: lambda port, _action, _decision: port.create_workload(),
    ReleaseQuota: lambda port, _action, _decision: port.release_quota(),
    ResizeWorkload: lambda port, _action, _decision: port.resize_workload(),
    FinishWorkload: lambda port, _, decision: port.finish_workload(decision.status),
}


async def run_pass(run: RunRef, port: RunPort) -> Decision | None:
    """One pass: the decision carried out, or None when the run was gone at the write (nothing was acted on)."""
    observed = await port.observe()
    decision = derive_status(run, observed.spec, observed.status, observed.seen)
    if not await port.write(decision):
        return None
    for action in decision.actions:
        await ACTIONS[type(action)](port, action, decision)
    return decision
