"""What the learner knows about each rollout server: its place in the set, ready or not, the weight version it
serves, its load and output.

One `ServerSet` is shared by the balancer (routing, readiness), the weight sync (versions, a server that fails a
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

from ..contract.codes import ReplicaState
from ..contract.report import RolloutReplicaReport


@dataclass
class RolloutServer:
    index: int
    url: str
    state: ReplicaState = ReplicaState.JOINING
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
    #: When it last proved that it generates (a completion returned, a liveness probe answered, its admission).
    proven_at: float = 0.0

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
    """What one `ServerSet.apply` did, by URL."""

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


class ServerSet:
    def __init__(self, urls: list[str]):
        urls = normalized(urls)
        if not urls:
            raise EmptyRolloutSet("at least one rollout server URL is needed")
        self._lock = threading.Lock()
        self._servers = [RolloutServer(index, url) for index, url in enumerate(urls)]
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
        """Every server the learner knows, draining ones too."""
        with self._lock:
            return [server.url for server in self._servers]

    def __len__(self) -> int:
        return len(self._servers)

    def ready_urls(self) -> list[str]:
        """The pool: admitted servers that are up. Routing, every weight sync step and the liveness probe use it."""
        with self._lock:
            return [server.url for server in self._servers
                    if server.ready and server.state == ReplicaState.SERVING]

    @contextlib.contextmanager
    def sync_step(self, url: str, *, admitting: bool = False) -> Iterator[bool]:
        """Hold `url` for one weight-sync step; yields whether it is held: a server in the pool, or with `admitting`
        one being admitted (in the set, not draining). One that leaves the set meanwhile stays in it, draining, until
        the step ends: a server stopped once the report dropped it had cut off a `/resume` under way."""
        with self._lock:
            server = self._find(url)
            if admitting:
                held = server is not None and server.state != ReplicaState.DRAINING
            else:
                held = server is not None and server.ready and server.state == ReplicaState.SERVING
            if held:
                server.sync_steps += 1
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    server.sync_steps -= 1
                    self._forget_if_drained(server)

    def unproven_urls(self, within_s: float) -> list[str]:
        """The servers the liveness probe must try: in the pool, or draining with requests in flight (so a hung
        one's requests move elsewhere), and with no proof that they generate in the last `within_s` seconds. A
        server whose completions keep coming back is proven by them: probing it would only take one of its slots."""
        since = time.monotonic() - within_s
        with self._lock:
            return [server.url for server in self._servers
                    if server.ready and server.proven_at <= since
                    and (server.state == ReplicaState.SERVING
                         or (server.state == ReplicaState.DRAINING and server.outstanding))]

    def proved(self, url: str) -> None:
        """`url` generated (its liveness probe answered)."""
        with self._lock:
            server = self._find(url)
            if server is not None:
                server.proven_at = time.monotonic()

    def to_admit(self) -> list[str]:
        """Replicas in the set that are not in the pool: joining ones, and serving ones that failed."""
        with self._lock:
            return [server.url for server in self._servers
                    if server.state != ReplicaState.DRAINING and not server.ready]

    def apply(self, urls: list[str]) -> MembershipChange:
        """Make `urls` the set, in their order (a server's index is its place in it; a draining one keeps its last).

        A URL that comes back while it drains joins again: it missed the weight syncs meanwhile, so it is admitted
        (caught up) before it gets traffic. Raises EmptyRolloutSet for no URL, leaving the set as it was.
        """
        urls = normalized(urls)
        if not urls:
            raise EmptyRolloutSet("the new set of rollout servers is empty")
        joined, draining, left = [], [], []
        with self._lock:
            known = {server.url: server for server in self._servers}
            members = []
            for index, url in enumerate(urls):
                server = known.pop(url, None)
                if server is None:
                    server = RolloutServer(index, url)
                    joined.append(url)
                elif server.state == ReplicaState.DRAINING:
                    server.state, server.ready = ReplicaState.JOINING, False
                    joined.append(url)
                server.index = index
                members.append(server)
            for server in known.values():
                if server.state != ReplicaState.DRAINING:
                    server.state = ReplicaState.DRAINING
                    draining.append(server.url)
                if server.busy:
                    members.append(server)
                else:
                    left.append(server.url)
            self._servers = members
        return MembershipChange(tuple(joined), tuple(draining), tuple(left))

    def admitted(self, url: str) -> bool:
        """The balancer admitted `url` (it generated and caught up): it serves. False when it drains or left
        meanwhile: it stays out of the pool."""
        with self._lock:
            server = self._find(url)
            if server is None or server.state == ReplicaState.DRAINING:
                return False
            server.state, server.ready = ReplicaState.SERVING, True
            server.proven_at = time.monotonic()  # its admission began with a generated token
            return True

    def acquire(self) -> RolloutServer | None:
        """The ready server with the fewest requests in flight (ties: the fewest served so far), now holding one more.

        Least outstanding requests adapts to servers of different speed, where round robin would queue work behind
        the slowest one; the tie-break spreads an idle start evenly.
        """
        with self._lock:
            ready = [server for server in self._servers
                     if server.ready and server.state == ReplicaState.SERVING]
            if not ready:
                return None
            chosen = min(ready, key=lambda server: (server.outstanding, server.requests, server.index))
            chosen.hold(+1)
            chosen.requests += 1
            return chosen

    def release(self, server: RolloutServer, *, ok: bool, error: str = "", sample: bool = True) -> None:
        """Give back the request slot; a failure takes the server out of the pool until it is probed ready again.
        A draining server whose last request this was leaves the set."""
        with self._lock:
            server.hold(-1)
            if ok:
                server.samples += int(sample)
                if sample:
                    server.proven_at = server.changed_at
            else:
                server.failures += 1
                server.last_error = error
                server.ready = False
            self._forget_if_drained(server)

    def count_retry(self, server: RolloutServer) -> None:
        with self._lock:
            server.retried += 1

    def set_unready(self, url: str, error: str = "") -> None:
        with self._lock:
            server = self._find(url)
            if server is None:
                return  # drained and forgotten meanwhile
            server.ready = False
            if error:
                server.last_error = error

    def fail(self, url: str, error: str) -> None:
        """A failure outside a generation request (a weight sync step): out of the pool, counted."""
        with self._lock:
            server = self._find(url)
            if server is None:
                return
            server.ready = False
            server.failures += 1
            server.last_error = error

    def set_version(self, url: str, version: str) -> None:
        with self._lock:
            server = self._find(url)
            if server is not None:
                server.weight_version = version

    def in_flight(self, url: str) -> int:
        """Requests in flight on `url` (0 for a server the set does not hold)."""
        with self._lock:
            server = self._find(url)
            return server.outstanding if server is not None else 0

    def is_ready(self, url: str) -> bool:
        with self._lock:
            server = self._find(url)
            return server is not None and server.ready

    def report(self) -> list[RolloutReplicaReport]:
        with self._lock:
            return [
                RolloutReplicaReport(
                    replica=server.index, url=server.url, ready=server.ready, state=server.state,
                    weight_version=server.weight_version,
                    samples=server.samples, failures=server.failures, retried=server.retried,
                    request_seconds=round(server.request_seconds, 3), last_error=server.last_error[:200],
                )
                for server in self._servers
            ]

    def _forget_if_drained(self, server: RolloutServer) -> None:
        """A draining server with nothing left in flight leaves the set (called under the lock)."""
        if server.state == ReplicaState.DRAINING and not server.busy:
            self._servers = [other for other in self._servers if other is not server]

    def _find(self, url: str) -> RolloutServer | None:
        url = url.rstrip("/")
        return next((server for server in self._servers if server.url == url), None)
