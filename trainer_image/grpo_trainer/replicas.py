"""What the learner knows about each rollout server: its place in the set, ready or not, the weight version it
serves, its load and output.

One `ReplicaSet` is shared by the balancer (routing, readiness), the weight sync (versions, a replica that fails a
sync leaves the pool) and the progress report (`/progress` `rollout`, metrics with a `replica` label). Torch-free and
thread-safe: the balancer runs on its own event-loop thread, the sync on the trainer's.

The set follows `rollout.urls` while the learner runs (`apply`, docs/rollout.md "Scaling a running run"): a new URL
joins (`ReplicaState.JOINING`, no traffic until the balancer admits it), an admitted one serves, a URL that left
drains (no new request, in no weight sync) and is forgotten once nothing is in flight on it: no request, and no
weight-sync step that began before it left. Whoever stops a drained server waits for that (its absence from the
report), so no step is cut off by the stop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import contract as c


@dataclass
class Replica:
    index: int
    url: str
    state: c.ReplicaState = c.ReplicaState.JOINING
    ready: bool = False
    weight_version: str | None = None
    outstanding: int = 0
    sync_steps: int = 0  # weight-sync steps (a pause, a reload, a resume, a catch-up) in flight on it
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

    @property
    def busy(self) -> bool:
        return bool(self.outstanding or self.sync_steps)


@dataclass(frozen=True)
class MembershipChange:
    """What one `ReplicaSet.apply` did, by URL."""

    joined: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()
    left: tuple[str, ...] = ()  # draining with nothing in flight: forgotten at once

    def __bool__(self) -> bool:
        return bool(self.joined or self.draining or self.left)


class EmptyRolloutSet(ValueError):
    """A set of no rollout servers: the learner could never generate again, so it is refused."""


def normalized(urls: list[str]) -> list[str]:
    """`urls` without trailing slashes and repeats, in their order."""
    return list(dict.fromkeys(url.rstrip("/") for url in urls))


class ReplicaSet:
    def __init__(self, urls: list[str]):
        urls = normalized(urls)
        if not urls:
            raise EmptyRolloutSet("at least one rollout server URL is needed")
        self._lock = threading.Lock()
        self._replicas = [Replica(index, url) for index, url in enumerate(urls)]
        # A weight sync holds the servers paused: the balancer's liveness probe gives no verdict meanwhile.
        self.syncing = False
        self.syncs_started = 0
        self.syncs_ended = 0

    def sync_started(self) -> None:
        self.syncs_started += 1
        self.syncing = True

    def sync_ended(self) -> None:
        self.syncs_ended += 1
        self.syncing = False

    @property
    def urls(self) -> list[str]:
        """Every replica the learner knows, draining ones too."""
        with self._lock:
            return [replica.url for replica in self._replicas]

    def __len__(self) -> int:
        return len(self._replicas)

    def ready_urls(self) -> list[str]:
        """The pool: admitted replicas that are up. Routing, every weight sync step and the liveness probe use it."""
        with self._lock:
            return [replica.url for replica in self._replicas
                    if replica.ready and replica.state == c.ReplicaState.SERVING]

    @contextlib.contextmanager
    def sync_step(self, url: str, *, admitting: bool = False) -> Iterator[bool]:
        """Hold `url` for one weight-sync step; yields whether it is held: a replica in the pool, or with `admitting`
        one being admitted (in the set, not draining). One that leaves the set meanwhile stays in it, draining, until
        the step ends: a server stopped once the report dropped it had cut off a `/resume` under way."""
        with self._lock:
            replica = self._find(url)
            if admitting:
                held = replica is not None and replica.state != c.ReplicaState.DRAINING
            else:
                held = replica is not None and replica.ready and replica.state == c.ReplicaState.SERVING
            if held:
                replica.sync_steps += 1
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    replica.sync_steps -= 1
                    self._forget_if_drained(replica)

    def draining_busy_urls(self) -> list[str]:
        """Draining replicas that still hold requests and are believed up: the liveness probe watches them too, so a
        hung one's requests move elsewhere."""
        with self._lock:
            return [replica.url for replica in self._replicas
                    if replica.state == c.ReplicaState.DRAINING and replica.ready and replica.outstanding]

    def to_admit(self) -> list[str]:
        """Replicas in the set that are not in the pool: joining ones, and serving ones that failed."""
        with self._lock:
            return [replica.url for replica in self._replicas
                    if replica.state != c.ReplicaState.DRAINING and not replica.ready]

    def apply(self, urls: list[str]) -> MembershipChange:
        """Make `urls` the set, in their order (a replica's index is its place in it; a draining one keeps its last).

        A URL that comes back while it drains joins again: it missed the weight syncs meanwhile, so it is admitted
        (caught up) before it gets traffic. Raises EmptyRolloutSet for no URL, leaving the set as it was.
        """
        urls = normalized(urls)
        if not urls:
            raise EmptyRolloutSet("the new set of rollout servers is empty")
        joined, draining, left = [], [], []
        with self._lock:
            known = {replica.url: replica for replica in self._replicas}
            members = []
            for index, url in enumerate(urls):
                replica = known.pop(url, None)
                if replica is None:
                    replica = Replica(index, url)
                    joined.append(url)
                elif replica.state == c.ReplicaState.DRAINING:
                    replica.state, replica.ready = c.ReplicaState.JOINING, False
                    joined.append(url)
                replica.index = index
                members.append(replica)
            for replica in known.values():
                if replica.state != c.ReplicaState.DRAINING:
                    replica.state = c.ReplicaState.DRAINING
                    draining.append(replica.url)
                if replica.busy:
                    members.append(replica)
                else:
                    left.append(replica.url)
            self._replicas = members
        return MembershipChange(tuple(joined), tuple(draining), tuple(left))

    def admitted(self, url: str) -> bool:
        """The balancer admitted `url` (it generated and caught up): it serves. False when it drains or left
        meanwhile: it stays out of the pool."""
        with self._lock:
            replica = self._find(url)
            if replica is None or replica.state == c.ReplicaState.DRAINING:
                return False
            replica.state, replica.ready = c.ReplicaState.SERVING, True
            return True

    def acquire(self) -> Replica | None:
        """The ready replica with the fewest requests in flight (ties: the fewest served so far), now holding one more.

        Least outstanding requests adapts to replicas of different speed, where round robin would queue work behind
        the slowest one; the tie-break spreads an idle start evenly.
        """
        with self._lock:
            ready = [replica for replica in self._replicas
                     if replica.ready and replica.state == c.ReplicaState.SERVING]
            if not ready:
                return None
            chosen = min(ready, key=lambda replica: (replica.outstanding, replica.requests, replica.index))
            chosen.hold(+1)
            chosen.requests += 1
            return chosen

    def release(self, replica: Replica, *, ok: bool, error: str = "", sample: bool = True) -> None:
        """Give back the request slot; a failure takes the replica out of the pool until it is probed ready again.
        A draining replica whose last request this was leaves the set."""
        with self._lock:
            replica.hold(-1)
            if ok:
                replica.samples += int(sample)
            else:
                replica.failures += 1
                replica.last_error = error
                replica.ready = False
            self._forget_if_drained(replica)

    def count_retry(self, replica: Replica) -> None:
        with self._lock:
            replica.retried += 1

    def set_unready(self, url: str, error: str = "") -> None:
        with self._lock:
            replica = self._find(url)
            if replica is None:
                return  # drained and forgotten meanwhile
            replica.ready = False
            if error:
                replica.last_error = error

    def fail(self, url: str, error: str) -> None:
        """A failure outside a generation request (a weight sync step): out of the pool, counted."""
        with self._lock:
            replica = self._find(url)
            if replica is None:
                return
            replica.ready = False
            replica.failures += 1
            replica.last_error = error

    def set_version(self, url: str, version: str) -> None:
        with self._lock:
            replica = self._find(url)
            if replica is not None:
                replica.weight_version = version

    def in_flight(self, url: str) -> int:
        """Requests in flight on `url` (0 for a server the set does not hold)."""
        with self._lock:
            replica = self._find(url)
            return replica.outstanding if replica is not None else 0

    def is_ready(self, url: str) -> bool:
        with self._lock:
            replica = self._find(url)
            return replica is not None and replica.ready

    def report(self) -> list[c.RolloutReplicaReport]:
        with self._lock:
            return [
                c.RolloutReplicaReport(
                    replica=replica.index, url=replica.url, ready=replica.ready, state=replica.state,
                    weight_version=replica.weight_version,
                    samples=replica.samples, failures=replica.failures, retried=replica.retried,
                    request_seconds=round(replica.request_seconds, 3), last_error=replica.last_error[:200],
                )
                for replica in self._replicas
            ]

    def _forget_if_drained(self, replica: Replica) -> None:
        """A draining replica with nothing left in flight leaves the set (called under the lock)."""
        if replica.state == c.ReplicaState.DRAINING and not replica.busy:
            self._replicas = [other for other in self._replicas if other is not replica]

    def _find(self, url: str) -> Replica | None:
        url = url.rstrip("/")
        return next((replica for replica in self._replicas if replica.url == url), None)
