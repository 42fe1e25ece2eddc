"""`status.rollout`: each rollout server as its pod shows it (Ready) and as the learner sees it (its `/progress`:
whether requests are routed to it, the weight version it serves, the samples it produced), plus its restarts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grpo_trainer.contract.codes import ReplicaState
from grpo_trainer.contract.report import ProgressReport

from ..run_status import Reason, RemovedServerStatus, RolloutServerStatus, RolloutStatus
from .decision import PodObservation, rank
from .rollout_exits import ServerRestart


def rollout_status(wanted: int, pods: Sequence[PodObservation], old: RolloutStatus | None, *,
                   selector: str, now: str) -> RolloutStatus:
    """The servers from this pass's pods; restarts and the learner's last view are carried over from `old`.

    `wanted` servers (spec.rollout.replicas) are listed by replica index, then each surplus pod (an index at or past
    `wanted`, left by a scale-down), draining since the pass that first saw it surplus (`now`, the API's time format)
    until its pod is gone. A server that leaves with restarts counted is kept in `removed_servers`, so a scale-up
    that brings it back finds its count (restartLimit is per server, and the total must not go down)."""
    previous = {server.replica: server for server in (old.servers if old else [])}
    removed = {server.replica: server for server in (old.removed_servers or [] if old else [])}
    by_replica = {rank(pod.name): pod for pod in pods}
    listed = set(range(wanted)) | set(by_replica)
    servers = []
    for replica in sorted(listed):
        pod = by_replica.get(replica)
        back = removed.get(replica)
        server = previous.get(replica) or RolloutServerStatus(
            replica=replica, restarts=back.restarts if back else 0, last_error=back.last_error if back else None)
        surplus = replica >= wanted
        server = server.model_copy(update={
            "pod": pod.name if pod else server.pod, "ready": pod is not None and pod.phase == "Running" and pod.ready,
            "drain_start_time": (server.drain_start_time or now) if surplus else None})
        servers.append(server)
    wanted_servers = servers[:wanted]
    left = [RemovedServerStatus(replica=server.replica, restarts=server.restarts, last_error=server.last_error)
            for server in previous.values() if server.replica not in listed and server.restarts]
    still_removed = sorted([*left, *(server for server in removed.values() if server.replica not in listed)],
                           key=lambda server: server.replica)
    return RolloutStatus(replicas=len(pods), ready=sum(server.ready for server in wanted_servers),
                         restarts=sum(server.restarts for server in [*servers, *still_removed]), selector=selector,
                         scale_refused=old.scale_refused if old else None, servers=servers,
                         removed_servers=still_removed or None)


def take_learner_view(status: RolloutStatus, report: ProgressReport) -> None:
    by_replica = {server.replica: server for server in status.servers}
    for seen in report.rollout:
        if (server := by_replica.get(seen.replica)) is not None:
            server.weight_version, server.samples = seen.weight_version, seen.samples
            # A state only a newer learner knows is left out: status declares the states this version knows. Whether
            # the learner sends such a server requests is unknown too (it may be holding it back), not its `ready`.
            known = isinstance(seen.state, ReplicaState)
            server.state, server.serving = (seen.state, seen.ready) if known else (None, None)
    reported = {seen.replica for seen in report.rollout}
    for server in status.servers:
        if server.replica not in reported:
            server.state = None  # the learner does not use it (any more, or yet)


def wanted_servers(status: RolloutStatus) -> list[RolloutServerStatus]:
    """The servers spec.rollout.replicas asks for (surplus ones, draining, follow them in `status.servers`)."""
    return [server for server in status.servers if server.drain_start_time is None]


def count_restart(status: RolloutStatus, restart: ServerRestart) -> int:
    """One more restart of the server; its new count."""
    server = next(server for server in status.servers if server.replica == restart.replica)
    server.restarts += 1
    server.last_error = restart.error
    status.restarts += 1
    return server.restarts


def readiness(status: RolloutStatus, limit: int, stuck: Mapping[int, str] | None = None) -> tuple[bool, str, str]:
    """RolloutReady as (true, reason, message). The message names each server that is not ready after restarts (its
    last exit), whose pod will not start by itself, or whose probe fails (`stuck`, by replica: e.g. `Unschedulable:
    0/4 nodes ...`, `readiness probe failed: connection refused (3 times in 20 s)`)."""
    wanted = wanted_servers(status)
    message = f"{status.ready}/{len(wanted)} rollout servers ready"
    if status.ready == len(wanted):
        return True, Reason.ALL_REPLICAS_READY, message
    stuck = stuck or {}
    details = []
    for server in wanted:
        if server.ready or not (server.restarts or server.replica in stuck):
            continue
        name = server.pod or f"replica {server.replica}"
        parts = [f"restarted {server.restarts}/{limit} times"] if server.restarts else []
        parts += [f"last exit: {server.last_error}"] if server.restarts and server.last_error else []
        parts += [stuck[server.replica]] if server.replica in stuck else []
        details.append(f"{name} is not ready, {', '.join(parts)}")
    restarting = any(not server.ready and server.restarts for server in wanted)
    return False, Reason.ROLLOUT_RESTARTING if restarting else Reason.REPLICAS_NOT_READY, "; ".join([message, *details])
