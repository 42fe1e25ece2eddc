"""`status.rollout`: each rollout server as its pod shows it (Ready) and as the learner sees it (its `/progress`:
whether the balancer sends it requests, the weight version it serves, the samples it produced), plus its restarts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grpo_trainer.contract import ProgressReport

from ..api import Reason, RolloutServerStatus, RolloutStatus
from .decision import PodObservation, rank
from .rollout_exits import ServerRestart


def rollout_status(replicas: int, pods: Sequence[PodObservation], old: RolloutStatus | None) -> RolloutStatus:
    """The servers from this pass's pods; restarts and the learner's last view are carried over from `old`."""
    previous = {server.replica: server for server in (old.servers if old else [])}
    by_replica = {rank(pod.name): pod for pod in pods}
    servers = []
    for replica in range(replicas):
        pod = by_replica.get(replica)
        server = previous.get(replica) or RolloutServerStatus(replica=replica)
        server = server.model_copy(update={"pod": pod.name if pod else server.pod,
                                           "ready": pod is not None and pod.phase == "Running" and pod.ready})
        servers.append(server)
    return RolloutStatus(replicas=replicas, ready=sum(server.ready for server in servers),
                         restarts=sum(server.restarts for server in servers), servers=servers)


def take_learner_view(status: RolloutStatus, report: ProgressReport) -> None:
    for seen in report.rollout:
        if seen.replica < len(status.servers):
            server = status.servers[seen.replica]
            server.serving, server.weight_version, server.samples = seen.ready, seen.weight_version, seen.samples


def count_restart(status: RolloutStatus, restart: ServerRestart) -> int:
    """One more restart of the server; its new count."""
    server = status.servers[restart.replica]
    server.restarts += 1
    server.last_error = restart.error
    status.restarts += 1
    return server.restarts


def readiness(status: RolloutStatus, limit: int, stuck: Mapping[int, str] | None = None) -> tuple[bool, str, str]:
    """RolloutReady as (true, reason, message). The message names each server that is not ready after restarts (its
    last exit) or whose pod will not start by itself (`stuck`, by replica: e.g. `Unschedulable: 0/4 nodes ...`)."""
    message = f"{status.ready}/{status.replicas} rollout servers ready"
    if status.ready == status.replicas:
        return True, Reason.ALL_REPLICAS_READY, message
    stuck = stuck or {}
    details = []
    for server in status.servers:
        if server.ready or not (server.restarts or server.replica in stuck):
            continue
        name = server.pod or f"replica {server.replica}"
        parts = [f"restarted {server.restarts}/{limit} times"] if server.restarts else []
        parts += [f"last exit: {server.last_error}"] if server.restarts and server.last_error else []
        parts += [stuck[server.replica]] if server.replica in stuck else []
        details.append(f"{name} is not ready, {', '.join(parts)}")
    restarting = any(not server.ready and server.restarts for server in status.servers)
    return False, Reason.ROLLOUT_RESTARTING if restarting else Reason.REPLICAS_NOT_READY, "; ".join([message, *details])
