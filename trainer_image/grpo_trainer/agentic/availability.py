"""An environment with no ready server: episodes wait for one instead of failing, and the learner names the wait,
ends it as a stall past spec.environments[].unavailableSeconds.

Two sides, one rule (a server is ready when its address resolves and it accepts a connection,
`ServerPool.readiness`):
- in TRL's worker child, `AvailabilityGate.wait` runs before each episode's reset (grpo_trainer.agentic.tools), before
  the episode's deadline starts: while one of the run's environments has no ready server, no episode starts, so none
  is burnt on a server that is down. The pools know a server is down from the transport (a call that could not
  connect marks its server unreachable) and from the probes the gate makes while it waits; the first episode waits
  for the first ready server (the learner may start before the environment's pods are Ready);
- in the learner, `EnvironmentWatch` probes every environment each second: the wait is named on /progress
  ("waiting for environment guess: 0/2 ready"), and an environment that had a ready server and then none for longer
  than its unavailableSeconds ends the run as stalled (exit 42). Before its first ready server, the operator's
  progress.startupDeadlineSeconds bounds the wait (image pulls and model loads are a run's start, not an outage).
While the gate holds the episodes, no group is consumed, so the learner's stall rules (groups in a row without one
training) count none of the wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..contract.config import EnvironmentServersConfig, RunConfig
from .servers import NoServer, Readiness, ServerPool, environment_urls, pool_for

logger = logging.getLogger(__name__)

#: Seconds between probes of an environment with no ready server (the gate's and the watch's).
POLL_S = 1.0

#: Set when TRL's rollout loop stops (grpo_trainer.rollout.worker): a reset waiting at the gate gives up, so that the
#: loop, which awaits the reset before it sees its stop, ends.
_stopping = threading.Event()


def release_waits() -> None:
    """The rollout loop is stopping: every wait at the gate ends (raising NoServer), and no new one begins."""
    _stopping.set()


@dataclass(frozen=True)
class AvailabilityGate:
    """The run's environments' addresses, (name, address) pairs (RunConfig.environments). Picklable and hashable: it
    travels to TRL's child with the environment factory, and is part of the guarded class it makes."""

    addresses: tuple[tuple[str, str], ...] = ()
    poll_s: float = POLL_S

    @classmethod
    def of(cls, config: RunConfig) -> AvailabilityGate:
        return cls(tuple(config.environments.items()))

    def wait(self, pool_of: Callable[[str], ServerPool] = pool_for) -> None:
        """Return once every environment has a server to start an episode on. Raises NoServer when the rollout loop
        stops first."""
        for name, address in self.addresses:
            pool = pool_of(address)
            if pool.has_ready_server():
                continue
            started = time.monotonic()
            logged = False
            while not (readiness := pool.readiness()).ready:
                if not logged:
                    logger.warning("environment %s has no ready server (%s): no episode starts until one is",
                                   name, readiness.describe())
                    logged = True
                if _stopping.wait(self.poll_s):
                    raise NoServer(f"{address}: the rollout loop stopped while waiting for a ready server")
            if logged:
                logger.info("environment %s is ready again after %.0f s (%s): episodes start", name,
                            time.monotonic() - started, readiness.describe())


#: The gate of a run with no environment servers of its own (an environment factory that reaches elsewhere).
NO_ENVIRONMENTS = AvailabilityGate()


@dataclass(frozen=True)
class WatchedEnvironment:
    name: str
    address: str
    servers: EnvironmentServersConfig


def watched_environments(config: RunConfig) -> tuple[WatchedEnvironment, ...]:
    """The run config's environments; one it has no servers' settings for (an older operator's config) has the
    defaults, with as many servers as its address names."""
    return tuple(WatchedEnvironment(name, address, config.environment_servers.get(name) or EnvironmentServersConfig(
                     replicas=len(environment_urls(address))))
                 for name, address in config.environments.items())


@dataclass(frozen=True)
class Unavailable:
    """An environment with no ready server now: since when (time.monotonic()), and whether it had one before."""

    environment: WatchedEnvironment
    readiness: Readiness
    since: float
    after_ready: bool


class EnvironmentWatch:
    """The learner's view of its environments' servers (rank 0): `poll` probes each, `waiting` names those with no
    ready server, `expired` the first whose wait passed its unavailableSeconds. `start` polls on a daemon thread and
    calls `on_expired(message)` once."""

    def __init__(self, environments: list[WatchedEnvironment], *, on_expired: Callable[[str], None],
                 pool_of: Callable[[str], ServerPool] = pool_for, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = POLL_S):
        self.environments = environments
        self._on_expired, self._pool_of, self._clock, self._poll_s = on_expired, pool_of, clock, poll_s
        self._lock = threading.Lock()
        self._unavailable: dict[str, Unavailable] = {}
        self._ever_ready: set[str] = set()
        self._expired = False
        self._stopped = threading.Event()

    def poll(self) -> None:
        now = self._clock()
        for environment in self.environments:
            readiness = self._pool_of(environment.address).readiness()
            with self._lock:
                if readiness.ready:
                    self._ever_ready.add(environment.name)
                    self._unavailable.pop(environment.name, None)
                    continue
                previous = self._unavailable.get(environment.name)
                after_ready = environment.name in self._ever_ready
                since = previous.since if previous is not None and previous.after_ready == after_ready else now
                self._unavailable[environment.name] = Unavailable(environment, readiness, since, after_ready)
        expired = self.expired()
        if expired is not None and not self._expired:
            self._expired = True
            self._on_expired(expired)

    def waiting(self) -> str | None:
        """What the learner waits for, when an environment has no ready server: "waiting for environment guess: 0/2
        ready" (several joined by "; ")."""
        with self._lock:
            waits = [f"waiting for environment {u.environment.name}: "
                     f"{u.readiness.ready}/{max(u.environment.servers.replicas, u.readiness.servers)} ready"
                     + ("" if u.after_ready else " (its servers have not been ready yet)")
                     for u in self._unavailable.values()]
        return "; ".join(waits) or None

    def paused_seconds(self) -> float:
        """How long the longest wait in progress has lasted (0: none)."""
        now = self._clock()
        with self._lock:
            return max((now - u.since for u in self._unavailable.values()), default=0.0)

    def expired(self) -> str | None:
        """The stall's message once an environment that had a ready server has had none for longer than its
        unavailableSeconds; else None."""
        now = self._clock()
        with self._lock:
            for u in self._unavailable.values():
                bound = u.environment.servers.unavailable_seconds
                if u.after_ready and now - u.since > bound:
                    return (f"environment {u.environment.name} had no ready server for {now - u.since:.0f} s "
                            f"(spec.environments[].unavailableSeconds {bound}; {u.readiness.describe()})")
        return None

    def start(self) -> None:
        threading.Thread(target=self._run, name="grpo-environment-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._expired:
            try:
                self.poll()
            except Exception:  # a probe that raised is no reason to stop watching
                logger.exception("probing the environments' servers failed")
            if self._stopped.wait(self._poll_s):
                return
