"""The learner's side of the rollout servers with filesystem sync: server state, the weight sync, the balancer.

`start_rollout_pool` wires the three so that a server that fails a request or a sync leaves the pool, and comes back
only after it generates again and has loaded the current weights (`FilesystemWeightTransfer.catch_up`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.config import RunConfig
from ..contract.report import RolloutReplicaReport
from .balancer import BalancerTimings, RolloutBalancer
from .run_config_watch import RolloutUrlsWatch
from .server_set import ServerSet
from .weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer

#: How long a generation request waits when no server is ready (a single server being restarted) before it is
#: answered 503 and TRL's worker retries it. Long enough for a CPU server restart measured at 25-150 s here.
NO_SERVER_WAIT_S = 300.0


@dataclass
class RolloutPool:
    servers: ServerSet
    transfer: FilesystemWeightTransfer
    balancer: RolloutBalancer

    @property
    def url(self) -> str:
        return self.balancer.url

    def report(self) -> list[RolloutReplicaReport]:
        return self.servers.report()

    def stop(self) -> None:
        self.balancer.stop()


def start_rollout_pool(
    config: RunConfig, *, ready_timeout_s: float, tied_embeddings: bool, request_timeout_s: float = 600.0,
    config_path: str | None = None,
) -> RolloutPool:
    """`request_timeout_s` is TRL's own (`request_timeout`): a server that has not answered by then is hung. With
    `config_path` (the run config file the learner read) the set of servers follows its `rollout.urls`."""
    sync = config.rollout.weight_sync
    if sync.mode != "filesystem" or not sync.directory:
        raise ValueError("the rollout pool needs rollout.weightSync.mode filesystem with a directory")
    servers = ServerSet(config.rollout.urls)
    transfer = FilesystemWeightTransfer(
        servers.urls, sync.directory, ready_timeout_s=ready_timeout_s,
        aliases=TIED_EMBEDDING_ALIASES if tied_embeddings else None, servers=servers,
        adapter_window=config.training.max_staleness + 1,
    )
    watch = RolloutUrlsWatch(config_path, servers.urls) if config_path else None
    timings = BalancerTimings(wait_s=NO_SERVER_WAIT_S, request_timeout_s=request_timeout_s)
    balancer = RolloutBalancer(servers, config.model, admit=transfer.catch_up, watch=watch, timings=timings).start()
    return RolloutPool(servers, transfer, balancer)
