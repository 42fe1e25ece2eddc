"""The learner's side of the rollout servers with filesystem sync: server state, the weight sync, their supervision.

`start_rollout_pool` wires them so that a server that fails a request or a sync leaves the pool, and comes back only
after it generates again and has loaded the current weights (`FilesystemWeightTransfer.catch_up`). The requests
themselves go from TRL's worker child straight to the servers (grpo_trainer.rollout.router): `routing()` is what that
child needs to find the pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..contract.config import RunConfig
from ..contract.report import RolloutReplicaReport
from .route_board import RouteBoard
from .router import RouterSettings
from .run_config_watch import RolloutUrlsWatch
from .server_set import ServerSet
from .supervisor import RolloutSupervisor
from .weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer


@dataclass
class RolloutPool:
    servers: ServerSet
    transfer: FilesystemWeightTransfer
    supervisor: RolloutSupervisor
    board: RouteBoard
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopped: bool = False

    def routing(self) -> RouterSettings:
        return RouterSettings(self.board.path)

    def report(self) -> list[RolloutReplicaReport]:
        """The servers with the router's latest tallies; after `stop`, its last ones (the final report's)."""
        with self._lock:
            if not self._stopped:
                self.supervisor.exchange()
        return self.servers.report()

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.supervisor.stop()
            self.supervisor.exchange()  # what the router tallied last
            self.board.close()


def start_rollout_pool(config: RunConfig, *, ready_timeout_s: float, tied_embeddings: bool,
                       config_path: str | None = None) -> RolloutPool:
    """With `config_path` (the run config file the learner read) the set of servers follows its `rollout.urls`."""
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
    board = RouteBoard.create()
    try:
        supervisor = RolloutSupervisor(servers, board, config.model, admit=transfer.catch_up, watch=watch).start()
    except BaseException:
        board.close()
        raise
    return RolloutPool(servers, transfer, supervisor, board)
