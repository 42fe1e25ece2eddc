"""What the learner knows about each rollout server: ready or not, the weight version it serves, its load and output.

One `ReplicaSet` is shared by the balancer (routing, readiness), the weight sync (versions, a replica that fails a
sync leaves the pool) and the progress report (`/progress` `rollout`, metrics with a `replica` label). Torch-free and
thread-safe: the balancer runs on its own event-loop thread, the sync on the trainer's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from . import contract as c


# more than 8: one server's live state, all defaulted but index and url
@dataclass
class Replica:
    index: int
    url: str
    ready: bool = False
    weight_version: str | None = None
    outstanding: int = 0
    requests: int = 0
    samples: int = 0
    failures: int = 0
    retried: int = 0
    last_error: str = ""
    request_seconds: float = 0.0  # outstanding requests integrated over time
    changed_at: float = field(default_factory=time.monotonic)

    def hold(self, delta: int) -> None:
        now = time.monotonic()
        self.request_seconds += self.outstanding * (now - self.changed_at)
        self.changed_at = now
        self.outstanding += delta


class ReplicaSet:
    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("at least one rollout server URL is needed")
        self._lock = threading.Lock()
        self._replicas = [Replica(index, url.rstrip("/")) for index, url in enumerate(urls)]
        # A weight sync holds the servers paused: the balancer's liveness probe gives no verdict meanwhile.
        self.syncing = False
        self.syncs_started = 0

    def sync_started(self) -> None:
        self.syncs_started += 1
        self.syncing = True

    def sync_ended(self) -> None:
        self.syncing = False

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self._replicas]

    def __len__(self) -> int:
        return len(self._replicas)

    def ready_urls(self) -> list[str]:
        with self._lock:
            return [replica.url for replica in self._replicas if replica.ready]

    def acquire(self) -> Replica | None:
        """The ready replica with the fewest requests in flight (ties: the fewest served so far), now holding one more.

        Least outstanding requests adapts to replicas of different speed, where round robin would queue work behind
        the slowest one; the tie-break spreads an idle start evenly.
        """
        with self._lock:
            ready = [replica for replica in self._replicas if replica.ready]
            if not ready:
                return None
            chosen = min(ready, key=lambda replica: (replica.outstanding, replica.requests, replica.index))
            chosen.hold(+1)
            chosen.requests += 1
            return chosen

    def release(self, replica: Replica, *, ok: bool, error: str = "", sample: bool = True) -> None:
        """Give back the request slot; a failure takes the replica out of the pool until it is probed ready again."""
        with self._lock:
            replica.hold(-1)
            if ok:
                replica.samples += int(sample)
            else:
                replica.failures += 1
                replica.last_error = error
                replica.ready = False

    def count_retry(self, replica: Replica) -> None:
        with self._lock:
            replica.retried += 1

    def set_ready(self, url: str, ready: bool, error: str = "") -> None:
        with self._lock:
            replica = self._by_url(url)
            replica.ready = ready
            if error:
                replica.last_error = error

    def fail(self, url: str, error: str) -> None:
        """A failure outside a generation request (a weight sync step): out of the pool, counted."""
        with self._lock:
            replica = self._by_url(url)
            replica.ready = False
            replica.failures += 1
            replica.last_error = error

    def set_version(self, url: str, version: str) -> None:
        with self._lock:
            self._by_url(url).weight_version = version

    def is_ready(self, url: str) -> bool:
        with self._lock:
            return self._by_url(url).ready

    def report(self) -> list[c.RolloutReplicaReport]:
        with self._lock:
            return [
                c.RolloutReplicaReport(
                    replica=replica.index, url=replica.url, ready=replica.ready, weight_version=replica.weight_version,
                    samples=replica.samples, failures=replica.failures, retried=replica.retried,
                    request_seconds=round(replica.request_seconds, 3), last_error=replica.last_error[:200],
                )
                for replica in self._replicas
            ]

    def _by_url(self, url: str) -> Replica:
        url = url.rstrip("/")
        for replica in self._replicas:
            if replica.url == url:
                return replica
        raise KeyError(f"unknown rollout server {url}")
