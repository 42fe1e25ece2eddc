"""Which server an episode plays on: an environment's address resolved to its ready servers, and each episode pinned to
the one with the fewest episodes in flight.

An environment server may hold an episode's state in its memory (the guess game, a sandbox, a code executor): every
call of one episode (its reset, tool calls and get_reward) must reach the server its reset reached. An environment's
address (the URL the learner gets, contract.pod_env) is
- on a cluster, its headless Service's URL: the name resolves to the IPs of the ready servers only (the cluster's
  DNS leaves out a pod whose readiness probe fails, or that is being deleted);
- under `grporun local`, its servers' URLs, separated by ENVIRONMENT_URL_SEPARATOR (one loopback port each).
A pool (`ServerPool`, one per address in the process) resolves the address again every RESOLVE_INTERVAL_S, so a new
server gets episodes within seconds of being ready, and one that left gets no new ones: its episodes in flight finish
there, or fail as the environment's once it is gone (out of the name and refusing connections: a call waiting on it
then ends at once, not at its deadline).

The guarded environments (grpo_trainer.agentic.tools) run each call of an episode within `episode_scope(pins)`, the
episode's `EpisodePins`; the transport (grpo_trainer.agentic.transport) sends a request where the pins say.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..contract.pod_env import ENVIRONMENT_URL_SEPARATOR

logger = logging.getLogger(__name__)

#: Seconds between resolutions of an environment's address: how soon a server that became ready gets episodes, and
#: one that left gets none.
RESOLVE_INTERVAL_S = 5.0
#: Seconds a probe's connection to a server may take (`reachable`).
PROBE_TIMEOUT_S = 1.0

T = TypeVar("T", bound=Hashable)


class ServerChooser(Generic[T]):
    """Pure: the servers an episode may start on now, and the episodes in flight on each. `choose` gives the server
    with the fewest in flight (ties: the one chosen longest ago, so idle servers take turns); a server that left
    (`update` without it) is never chosen again, and its episodes in flight are still released as they end.
    Not thread-safe (ServerPool locks around it)."""

    def __init__(self, servers: Iterable[T] = ()):
        self._servers: list[T] = []
        self._in_flight: Counter[T] = Counter()
        self._last_chosen: dict[T, int] = {}
        self._choices = 0
        self.update(servers)

    @property
    def servers(self) -> list[T]:
        return list(self._servers)

    def update(self, servers: Iterable[T]) -> None:
        """The servers to choose from from now on (repeats count once)."""
        self._servers = list(dict.fromkeys(servers))
        self._last_chosen = {server: turn for server, turn in self._last_chosen.items() if server in self._servers}

    def choose(self) -> T | None:
        """The server the next episode plays on, counted in flight there; None when there is none."""
        if not self._servers:
            return None
        server = min(self._servers, key=lambda s: (self._in_flight[s], self._last_chosen.get(s, -1)))
        self._in_flight[server] += 1
        self._last_chosen[server] = self._choices
        self._choices += 1
        return server

    def release(self, server: T) -> None:
        """An episode on `server` ended."""
        if self._in_flight[server] > 1:
            self._in_flight[server] -= 1
        else:
            self._in_flight.pop(server, None)

    def in_flight(self, server: T) -> int:
        return self._in_flight[server]


@dataclass(frozen=True)
class Server:
    """One server of an environment: `url` reaches it (its own address), `host` is the address's host as the
    environment's URL named it (sent as the Host header, and as the TLS server name over https)."""

    url: str
    host: str

    @property
    def hostname(self) -> str:
        return urllib.parse.urlsplit(f"//{self.host}").hostname or ""


def environment_urls(address: str) -> list[str]:
    """The URLs an environment's address lists (one on a cluster)."""
    return [url.strip().rstrip("/") for url in address.split(ENVIRONMENT_URL_SEPARATOR) if url.strip()]


def check_address(address: str) -> None:
    """Raise ValueError naming what is wrong when `address` is not one or more http(s) URLs."""
    urls = environment_urls(address)
    if not urls:
        raise ValueError(f"an environment's URL must be http(s)://..., not {address!r}")
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an environment's URL must be http(s)://..., not {url!r}")


def resolve_servers(address: str) -> list[Server]:
    """The servers `address` reaches now: each URL's host resolved (IPv4 addresses when it has any: a dual-stack name
    lists each server under both, and a server listening on 0.0.0.0 answers IPv4 only). Raises OSError when a name
    does not resolve (a headless Service with no ready server has no address)."""
    servers = []
    for url in environment_urls(address):
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ips = [info[4][0] for info in infos if info[0] == socket.AF_INET] or [
            info[4][0] for info in infos if info[0] == socket.AF_INET6]
        for ip in dict.fromkeys(ips):
            literal = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
            servers.append(Server(f"{parts.scheme}://{literal}:{port}{parts.path}", parts.netloc))
    return servers


def reachable(server: Server, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server accepts a connection now (what a Service's default readiness probe checks)."""
    parts = urllib.parse.urlsplit(server.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Readiness:
    """An environment's servers as a probe found them: `servers` its address resolved to, `ready` of them accepting
    connections, and what went wrong resolving it (empty when nothing did)."""

    ready: int
    servers: int
    problem: str = ""

    def describe(self) -> str:
        return f"{self.ready}/{self.servers} server(s) accept connections{self.problem}"


class NoServer(OSError):
    """An environment's address has no server to start an episode on."""


class ServerPool:
    """An environment's servers as its address resolves them (again every `interval_s`), and the episodes in flight
    on each. Thread-safe: every episode of the process's environments of this address shares it."""

    def __init__(self, address: str, *, resolve: Callable[[str], list[Server]] = resolve_servers,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = RESOLVE_INTERVAL_S,
                 probe: Callable[[Server], bool] = reachable):
        self.address = address
        self._resolve, self._clock, self._interval_s, self._probe = resolve, clock, interval_s, probe
        self._lock = threading.Lock()
        self._chooser: ServerChooser[Server] = ServerChooser()
        self._resolved: list[Server] = []
        # Servers a connection to failed (a call's, or a probe's): no episode starts there until a probe connects.
        self._unreachable: set[Server] = set()
        self._probed = False  # whether `readiness` has found a server ready yet (the first episode waits for it)
        self._resolved_at: float | None = None
        self._problem = ""

    def acquire(self) -> Server:
        """The server a new episode plays on, counted in flight until `release`. Raises NoServer."""
        with self._lock:
            self._refresh_when_due()
            server = self._chooser.choose()
            if server is None:
                raise NoServer(f"{self.address}: no ready server to start an episode on{self._problem}")
            return server

    def release(self, server: Server) -> None:
        with self._lock:
            self._chooser.release(server)

    def mark_unreachable(self, server: Server) -> None:
        """A connection to `server` failed: no new episode starts there until a probe connects to it again."""
        with self._lock:
            if server in self._unreachable:
                return
            self._unreachable.add(server)
            self._chooser.update(s for s in self._resolved if s not in self._unreachable)
        logger.warning("environment %s: %s does not accept connections; no episode starts there until it does",
                       self.address, server.url)

    def has_ready_server(self) -> bool:
        """Whether an episode may start now without a probe: a probe found a server ready once, and a server is
        left that no connection has failed to since (the address resolved again when due)."""
        with self._lock:
            self._refresh_when_due()
            return self._probed and bool(self._chooser.servers)

    def readiness(self) -> Readiness:
        """Resolve the address now and probe every server it names: those that accept a connection are the ones
        episodes start on from here."""
        with self._lock:
            self._refresh(self._clock())
            servers, problem = list(self._resolved), self._problem
        unreachable = {server for server in servers if not self._probe(server)}
        with self._lock:
            self._unreachable = unreachable | (self._unreachable - set(servers))
            self._chooser.update(s for s in self._resolved if s not in self._unreachable)
            ready = len(servers) - len(unreachable)
            self._probed = self._probed or ready > 0
        return Readiness(ready, len(servers), problem)

    def servers(self) -> list[Server]:
        with self._lock:
            return self._chooser.servers

    def gone(self, server: Server) -> bool:
        """Whether `server` has left: the address, resolved again when due, no longer names it, and it does not
        accept a connection (a deleted pod, a lost node). A server only out of the name (a readiness probe failing, a
        scale-down's grace period) still finishes the episodes it holds."""
        with self._lock:
            self._refresh_when_due()
            if server in self._resolved:
                return False
        return not self._probe(server)

    def in_flight(self) -> dict[str, int]:
        """The episodes in flight on each server now, by its URL."""
        with self._lock:
            return {server.url: self._chooser.in_flight(server) for server in self._chooser.servers}

    def _refresh_when_due(self) -> None:
        """Resolve the address again if it was never resolved or its interval has passed (under the lock)."""
        now = self._clock()
        if self._resolved_at is None or now - self._resolved_at >= self._interval_s:
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        try:
            servers = self._resolve(self.address)
        except OSError as error:  # no ready server behind the name, or DNS down: tried again on the next episode
            self._chooser.update([])
            self._resolved = []
            self._resolved_at, self._problem = None, f" (resolving it: {type(error).__name__}: {error})"
            return
        if [server.url for server in servers] != [server.url for server in self._resolved]:
            logger.info("environment %s: %d server(s): %s", self.address, len(servers),
                        ", ".join(server.url for server in servers))
        # A server that is unreachable and named again is probed: back in the choice once it accepts a connection.
        self._unreachable = {server for server in self._unreachable if server in servers and not self._probe(server)}
        self._resolved = servers
        self._chooser.update(s for s in servers if s not in self._unreachable)
        self._resolved_at, self._problem = now, ""


_pools: dict[str, ServerPool] = {}
_pools_lock = threading.Lock()


def pool_for(address: str) -> ServerPool:
    """The process's pool of `address`: the environments of one address share one count of episodes in flight."""
    with _pools_lock:
        if address not in _pools:
            _pools[address] = ServerPool(address)
        return _pools[address]


class EpisodePins:
    """The server each pool gave one episode, so that its later calls go there too; `release` ends the episode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[ServerPool, Server] = {}
        self._ended = False

    def server(self, pool: ServerPool) -> Server:
        """The episode's server of `pool`: chosen by its first call. Raises NoServer once the episode ended (a call
        abandoned past its deadline that runs on would otherwise hold a server for good)."""
        with self._lock:
            if pool not in self._held:
                if self._ended:
                    raise NoServer(f"{pool.address}: the episode has ended")
                self._held[pool] = pool.acquire()
            return self._held[pool]

    def lost(self) -> str | None:
        """Which server of the episode has left its pool (ServerPool.gone), in words; None while each is there."""
        with self._lock:
            held = list(self._held.items())
        for pool, server in held:
            if pool.gone(server):
                return f"its server {server.url} left {pool.address} and does not accept connections"
        return None

    def release(self) -> None:
        with self._lock:
            held, self._held, self._ended = self._held, {}, True
        for pool, server in held.items():
            pool.release(server)


_episode: contextvars.ContextVar[EpisodePins | None] = contextvars.ContextVar("grpo_episode_pins", default=None)


@contextlib.contextmanager
def episode_scope(pins: EpisodePins) -> Iterator[None]:
    """Send the requests made in this thread (or task), until the block ends, to the servers `pins` holds."""
    token = _episode.set(pins)
    try:
        yield
    finally:
        _episode.reset(token)


def current_pins() -> EpisodePins | None:
    """The pins of the episode whose call runs here; None outside an episode."""
    return _episode.get()
