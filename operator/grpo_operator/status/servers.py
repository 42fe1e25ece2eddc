"""`status.rollout`: each rollout server as its pod shows it (Ready) and as the learner sees it (its `/progress`:
whether the balancer sends it requests, the weight version it serves, the samples it produced), plus its restarts.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def readiness(status: RolloutStatus, limit: int) -> tuple[bool, str, str]:
    """RolloutReady as (true, reason, message): a server not ready after restarts names its last exit."""
    message = f"{status.ready}/{status.replicas} rollout servers ready"
    if status.ready == status.replicas:
        return True, Reason.ALL_REPLICAS_READY, message
    restarted = [server for server in status.servers if not server.ready and server.restarts]
    if not restarted:
        return False, Reason.REPLICAS_NOT_READY, message
    details = [f"{server.pod or f'replica {server.replica}'} is not ready, restarted {server.restarts}/{limit} "
               "times" + (f", last exit: {server.last_error}" if server.last_error else "") for server in restarted]
    return False, Reason.ROLLOUT_RESTARTING, "; ".join([message, *details])
