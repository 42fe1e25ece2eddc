"""What the learner knows about each rollout server: its place in the set, ready or not, the weight version it
serves, its load and output.

One `ServerSet` is shared by the supervision (readiness, membership: grpo_trainer.rollout.supervisor), the weight sync
(versions, a server that fails a sync leaves the pool) and the progress report (`/progress` `rollout`, metrics with a
`replica` label). The requests themselves are routed in TRL's worker child (grpo_trainer.rollout.router), which sees
the set as `routes()` and whose tallies come back through `absorb`. Torch-free and thread-safe: the supervision runs
on its own event-loop thread, the sync on the trainer's.

The set follows `rollout.urls` while the learner runs (`apply`, docs/rollout.md "Scaling a running run"): a new URL
joins (`ReplicaState.JOINING`, no traffic until it is admitted), an admitted one serves, a URL that left drains (no
new request, in no weight sync) and is forgotten once nothing is in flight on it: no request, and no weight-sync step
that began before it left. Its requests are counted by the router, so it is forgotten only once the router has been
shown it draining and a later look at the tallies still finds none in flight. Whoever stops a drained server waits
for that (its absence from the report), so no step is cut off by the stop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..contract.codes import ReplicaState
from ..contract.report import RolloutReplicaReport
from .route_board import CAPACITY, Route, Routes, RouteState, SlotTally

#: How long after the router was shown a server draining its count of the requests in flight there is trusted.
DRAIN_SETTLE_S = 0.5


@dataclass
class RolloutServer:
    index: int
    url: str
    slot: int  # its tallies on the route board
    state: ReplicaState = ReplicaState.JOINING
    ready: bool = False
    weight_version: str | None = None
    outstanding: int = 0  # requests in flight on it, as the router last counted
    sync_steps: int = 0  # weight-sync steps (a pause, a reload, a resume, a catch-up) in flight on it
    failures: int = 0
    last_error: str = ""
    admissions: int = 0
    abandons: int = 0  # times its requests in flight were given up (hung, failed a weight sync)
    #: When it last proved that it generates (a completion returned, a liveness probe answered, its admission).
    proven_at: float = 0.0
    #: The slot's tallies when it joined (they count from there) and when they were last absorbed.
    baseline: SlotTally = field(default_factory=SlotTally)
    absorbed: SlotTally = field(default_factory=SlotTally)
    #: Draining: when the router was shown so (`published`); its count of requests in flight is trusted from
    #: DRAIN_SETTLE_S later.
    drain_published_at: float | None = None

    @property
    def busy(self) -> bool:
        return bool(self.outstanding or self.sync_steps)

    @property
    def samples(self) -> int:
        return int(self.absorbed.done - self.baseline.done)

    @property
    def retried(self) -> int:
        return int(self.absorbed.retried - self.baseline.retried)

    @property
    def request_seconds(self) -> float:
        return self.absorbed.busy_s - self.baseline.busy_s


@dataclass(frozen=True)
class MembershipChange:
    """What one `ServerSet.apply` did, by URL."""

    joined: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.joined or self.draining)


@dataclass(frozen=True)
class Absorbed:
    """What one look at the router's tallies found: servers whose requests failed there since the last look (URL,
    count, the last error), and draining servers forgotten (nothing left in flight)."""

    failed: tuple[tuple[str, int, str], ...] = ()
    left: tuple[str, ...] = ()


class NoFreeSlot(RuntimeError):
    """More distinct rollout server URLs over the learner's life than the route board has slots."""


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
        self._slots: dict[str, int] = {}  # a URL keeps its slot for the learner's life
        self._last_tally: dict[str, SlotTally] = {}  # a URL that comes back counts from there
        self._servers = [self._new_server(index, url) for index, url in enumerate(urls)]
        # A weight sync holds the servers paused: the liveness probe gives no verdict meanwhile.
        self.syncing = False
        self.syncs_started = 0
        self.syncs_ended = 0
        #: The weight version every server in the pool holds (the last sync's): what a request asks a server for.
        self.pool_version = 0
        #: Grows with every change the router must see (`routes`).
        self.revision = 0

    def _new_server(self, index: int, url: str) -> RolloutServer:
        slot = self._slots.get(url)
        if slot is None:
            if len(self._slots) >= CAPACITY:
                raise NoFreeSlot(f"rollout server {url}: the learner has seen {CAPACITY} server URLs, the most its "
                                 "route board holds")
            slot = self._slots[url] = len(self._slots)
        return RolloutServer(index, url, slot)

    def _changed(self) -> None:
        self.revision += 1

    def sync_started(self) -> None:
        self.syncs_started += 1
        self.syncing = True

    def sync_ended(self, version: int | None = None) -> None:
        """A sync is over; with `version`, every server still in the pool holds it."""
        with self._lock:
            self.syncs_ended += 1
            self.syncing = False
            if version is not None and version != self.pool_version:
                self.pool_version = version
                self._changed()

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
        joined, draining = [], []
        with self._lock:
            known = {server.url: server for server in self._servers}
            members = []
            for index, url in enumerate(urls):
                server = known.pop(url, None)
                if server is None:
                    server = self._new_server(index, url)
                    server.baseline = server.absorbed = self._last_tally.get(url, SlotTally())
                    joined.append(url)
                elif server.state == ReplicaState.DRAINING:
                    server.state, server.ready = ReplicaState.JOINING, False
                    server.drain_published_at = None
                    joined.append(url)
                server.index = index
                members.append(server)
            for server in known.values():
                if server.state != ReplicaState.DRAINING:
                    server.state = ReplicaState.DRAINING
                    draining.append(server.url)
                members.append(server)  # forgotten once the router has seen it draining and nothing is in flight
            self._servers = members
            self._changed()
        return MembershipChange(tuple(joined), tuple(draining))

    def admitted(self, url: str) -> bool:
        """`url` was admitted (it generated and caught up): it serves. False when it drains or left
        meanwhile: it stays out of the pool."""
        with self._lock:
            server = self._find(url)
            if server is None or server.state == ReplicaState.DRAINING:
                return False
            server.state, server.ready = ReplicaState.SERVING, True
            server.admissions += 1
            server.proven_at = time.monotonic()  # its admission began with a generated token
            self._changed()
            return True

    def set_unready(self, url: str, error: str = "") -> None:
        with self._lock:
            server = self._find(url)
            if server is None:
                return  # drained and forgotten meanwhile
            server.ready = False
            if error:
                server.last_error = error
            self._changed()

    def fail(self, url: str, error: str) -> None:
        """A failure outside a generation request (a weight sync step, a liveness probe without a token): out of the
        pool, counted, and its requests in flight abandoned: the router sends them again elsewhere, since what it
        holds (weights half loaded, an engine that makes no progress) can serve them no more."""
        with self._lock:
            server = self._find(url)
            if server is None:
                return
            server.ready = False
            server.failures += 1
            server.last_error = error
            server.abandons += 1
            self._changed()

    def set_version(self, url: str, version: str) -> None:
        with self._lock:
            server = self._find(url)
            if server is not None:
                server.weight_version = version

    # -- the router's side --------------------------------------------------------------------------------------------
    def routes(self) -> Routes:
        """The set as the router sees it: which servers take new requests, and the version they must hold."""
        with self._lock:
            return Routes(self.pool_version, tuple(
                Route(server.slot, server.url, server.index, _route_state(server), server.admissions,
                      server.abandons)
                for server in self._servers))

    def slots(self) -> dict[int, str]:
        """Each server's slot on the route board, by slot."""
        with self._lock:
            return {server.slot: server.url for server in self._servers}

    def published(self, routes: Routes) -> None:
        """`routes` were handed to the router: a server draining in them is now known to it as draining."""
        now = time.monotonic()
        draining = {route.url for route in routes.servers if route.state is RouteState.DRAINING}
        with self._lock:
            for server in self._servers:
                if (server.url in draining and server.state == ReplicaState.DRAINING
                        and server.drain_published_at is None):
                    server.drain_published_at = now

    def absorb(self, tallies: dict[int, SlotTally], now_wall: float | None = None) -> Absorbed:
        """Take in the router's tallies by slot: requests in flight, completions (each proves its server generates),
        and failures, which take a server out of the pool until it is admitted again (a refusal by its weight-version
        gate too: it holds an older version than the pool, as a restarted server does)."""
        now_wall = time.time() if now_wall is None else now_wall
        failed, left = [], []
        with self._lock:
            for server in list(self._servers):
                tally = tallies.get(server.slot)
                if tally is not None:
                    failed.extend(self._absorb_one(server, tally, now_wall))
                if self._forget_if_drained(server):
                    left.append(server.url)
        return Absorbed(tuple(failed), tuple(left))

    def _absorb_one(self, server: RolloutServer, tally: SlotTally, now_wall: float) -> list[tuple[str, int, str]]:
        """One server's tallies (under the lock); its new failures, if any."""
        self._last_tally[server.url] = tally
        before, server.absorbed = server.absorbed, tally
        server.outstanding = tally.in_flight
        if tally.last_done > before.last_done:
            proven = time.monotonic() - max(now_wall - tally.last_done, 0.0)
            server.proven_at = max(server.proven_at, proven)
        new_failures = int(tally.failed - before.failed) + int(tally.refused - before.refused)
        if new_failures <= 0:
            return []
        server.failures += new_failures
        server.last_error = tally.error
        if server.ready:
            server.ready = False
            self._changed()
        return [(server.url, new_failures, tally.error)]

    def in_flight(self, url: str) -> int:
        """Requests in flight on `url` as the router last counted them (0 for a server the set does not hold)."""
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

    def _forget_if_drained(self, server: RolloutServer) -> bool:
        """A draining server with nothing left in flight leaves the set (called under the lock). The router's count
        is trusted once it has been shown the server draining, DRAIN_SETTLE_S ago: a request it routed by its
        earlier copy of the routes was counted within microseconds of that copy's read."""
        published = server.drain_published_at
        settled = published is not None and time.monotonic() - published >= DRAIN_SETTLE_S
        if server.state == ReplicaState.DRAINING and settled and not server.busy:
            self._servers = [other for other in self._servers if other is not server]
            self._changed()
            return True
        return False

    def _find(self, url: str) -> RolloutServer | None:
        url = url.rstrip("/")
        return next((server for server in self._servers if server.url == url), None)


def _route_state(server: RolloutServer) -> RouteState:
    if server.state == ReplicaState.DRAINING:
        return RouteState.DRAINING
    return RouteState.SERVING if server.ready and server.state == ReplicaState.SERVING else RouteState.OUT
