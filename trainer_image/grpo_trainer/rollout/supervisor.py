"""The learner's supervision of its rollout servers (rank 0): which are in the pool, and the routes the router gets.

Generation requests do not pass through the learner: TRL's worker child sends them straight to the servers through
grpo_trainer.rollout.router, by the routes this supervision publishes on the route board
(grpo_trainer.rollout.route_board), and tallies what each server did there. Here, on an event-loop thread of its
own, with no work per request:

- An unready server is probed by generating one token (`server.health.generation_probe`), not by `/health`: a
  server whose engine died, or hung, still answers `/health`. Before it is admitted again `admit(url)` runs (the
  weight sync's catch-up, which loads the current weights), so a restarted server never serves the initial or an
  old policy; the server's weight-version gate refuses what the router sends it before that.
- A ready server must prove that it generates at least every `liveness_interval_s`: a completion the router tallies
  proves it; one that returned none in that time is probed the same way, except while a weight sync holds it
  paused (a paused server holds the probe too). A server whose completions keep coming back is never probed, so the
  probe takes none of its slots while it is busy. A server that generates no token within `liveness_timeout_s` is
  hung: it leaves the pool, its requests in flight are abandoned (the router sends them again elsewhere at once,
  not after the request timeout), and it is admitted again, through the same catch-up, once it generates.
- Every `tally_interval_s` the router's tallies are absorbed (a failure the router saw takes the server out of the
  pool until it is admitted again) and the routes are published again if anything changed.
- With a `RolloutUrlsWatch` the set of servers follows the run config while the learner runs
  (`server_set.ServerSet.apply`): a new server joins through the same admission; a server that left gets no new
  request and is in no weight sync, its requests in flight finish there (or, if it fails or hangs, are sent again
  elsewhere), and it leaves the set when none is left. A sync that was running when it left may have paused it: it is
  resumed once that sync ends, so its frozen requests finish without the sync waiting on it.

The clocks named here are `SupervisorTimings` fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from ..contract.rollout_pod import PROBE_TIMEOUT_S
from ..server.health import generation_probe
from .route_board import RouteBoard
from .run_config_watch import WATCH_INTERVAL_S, RolloutUrlsWatch
from .server_set import EmptyRolloutSet, NoFreeSlot, ServerSet

logger = logging.getLogger(__name__)

AdmitFn = Callable[[str], None]
#: How often a ready server must prove it generates. A CPU server busy with TRL's full in-flight window answered a
#: one-token probe within a few seconds here, far inside PROBE_TIMEOUT_S.
LIVENESS_INTERVAL_S = 15.0
#: Servers are looked at this many times per interval, so one that stops generating is probed within 1.25 intervals
#: of its last proof, not two.
LIVENESS_LOOKS_PER_INTERVAL = 4
#: How often the router's tallies are read and changed routes published: a failure the router saw reaches the
#: report and the admission within this; a draining server leaves within a few of them once its requests are done.
TALLY_INTERVAL_S = 0.2
#: The event-loop thread's name: what per-thread CPU figures (the bench's) find it by.
THREAD_NAME = "grpo-rollout-supervisor"


@dataclass(frozen=True)
class SupervisorTimings:
    """The supervision's clocks. `probe_interval_s`: how often unready servers are probed;
    `liveness_interval_s`/`liveness_timeout_s`: how often a ready server must generate a token, and within what;
    `watch_interval_s`: how often the run config's rollout URLs are read again; `tally_interval_s`: how often the
    router's tallies are read and the routes published."""

    probe_interval_s: float = 2.0
    liveness_interval_s: float = LIVENESS_INTERVAL_S
    liveness_timeout_s: float = PROBE_TIMEOUT_S
    watch_interval_s: float = WATCH_INTERVAL_S
    tally_interval_s: float = TALLY_INTERVAL_S


DEFAULT_TIMINGS = SupervisorTimings()


class RolloutSupervisor:
    def __init__(
        self, servers: ServerSet, board: RouteBoard, model: str, *, admit: AdmitFn | None = None,
        watch: RolloutUrlsWatch | None = None, timings: SupervisorTimings = DEFAULT_TIMINGS,
    ):
        self.servers = servers
        self.board = board
        self.model = model
        self.admit = admit
        self.watch = watch
        self.timings = timings
        self._board_lock = threading.Lock()  # the board's routes have one writer at a time
        self._published_revision = -1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=THREAD_NAME, daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._resumes: set[asyncio.Task] = set()  # draining servers to resume after the sync that paused them

    # -- life cycle ---------------------------------------------------------------------------------------------------
    def start(self) -> RolloutSupervisor:
        self.exchange()  # the routes are on the board before any router reads them
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        logger.info("rollout supervision over %d server(s); requests are routed in the rollout worker",
                    len(self.servers))
        return self

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession()
        loops = [self._probe_forever(), self._liveness_forever(), self._exchange_forever()]
        if self.watch is not None:
            loops.append(self._watch_forever())
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _stop(self) -> None:
        for task in (*self._tasks, *self._resumes):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    # -- the router's side --------------------------------------------------------------------------------------------
    def exchange(self) -> None:
        """Absorb the router's tallies, then publish the routes if anything changed. Any thread."""
        absorbed = self.servers.absorb({slot: self.board.tally(slot) for slot in self.servers.slots()})
        for url, count, error in absorbed.failed:
            logger.warning("rollout server %s failed %d generation request(s) (%s); it leaves the pool until it "
                           "is admitted again, the requests were sent again to another server", url, count, error)
        for url in absorbed.left:
            logger.info("rollout server %s left the run's set (no request in flight on it)", url)
        with self._board_lock:
            revision = self.servers.revision
            if revision != self._published_revision:
                routes = self.servers.routes()
                self.board.publish(routes)
                self._published_revision = revision
                self.servers.published(routes)

    async def _exchange_forever(self) -> None:
        while True:
            await asyncio.sleep(self.timings.tally_interval_s)
            self.exchange()

    # -- readiness ----------------------------------------------------------------------------------------------------
    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(url) for url in self.servers.to_admit()))
            await asyncio.sleep(self.timings.probe_interval_s)

    async def _probe(self, url: str) -> None:
        # A server left paused by a failed sync holds every request, the probe's too: it gets no traffic from here
        # until admitted (the router's requests in flight on it were abandoned), so letting it run is safe.
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.post(f"{url}/resume", timeout=aiohttp.ClientTimeout(total=10)):
                pass
        error = await generation_probe(self._session, url, self.model)
        if error is not None:
            return
        with self.servers.sync_step(url, admitting=True) as held:
            if not held:
                return  # it left the run's set since the probe began
            try:
                if self.admit is not None:
                    await asyncio.get_running_loop().run_in_executor(None, self.admit, url)
            except Exception as admit_error:  # noqa: BLE001 - stays out of the pool; the next probe tries again
                logger.warning("rollout server %s answers but could not be brought to the current weights: %s", url,
                               admit_error)
                self.servers.set_unready(url, error=str(admit_error))
                return
        if self.servers.admitted(url):
            self.exchange()  # routed to from now on
            logger.info("rollout server %s is ready", url)

    async def _liveness_forever(self) -> None:
        interval = self.timings.liveness_interval_s
        while True:
            await asyncio.sleep(interval / LIVENESS_LOOKS_PER_INTERVAL)
            # The latest tallies first: a completion the router counted since the last exchange is a proof, and a
            # probe sent instead would take one of the server's slots.
            self.exchange()
            await asyncio.gather(*(self._check_alive(url) for url in self.servers.unproven_urls(interval)))

    async def _check_alive(self, url: str) -> None:
        syncs = self.servers.syncs_started
        if self.servers.syncing:
            return
        error = await generation_probe(self._session, url, self.model, timeout_s=self.timings.liveness_timeout_s)
        if error is None:
            self.servers.proved(url)
            return
        if self.servers.syncing or self.servers.syncs_started != syncs:
            return  # a sync paused it meanwhile: no verdict
        if not self.servers.is_ready(url):
            return  # already out of the pool (a failed request)
        logger.warning("rollout server %s is hung (%s); it leaves the pool, its requests are sent again", url, error)
        self.servers.fail(url, f"liveness: {error}")
        self.exchange()

    # -- membership ---------------------------------------------------------------------------------------------------
    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.timings.watch_interval_s)
            urls = self.watch.poll()
            if urls is not None:
                self.apply_servers(urls)

    def apply_servers(self, urls: list[str]) -> None:
        """Make `urls` the set of servers (on the supervision's loop)."""
        syncing, syncs_ended = self.servers.syncing, self.servers.syncs_ended
        try:
            change = self.servers.apply(urls)
        except (EmptyRolloutSet, NoFreeSlot) as refused:
            logger.warning("%s; the learner keeps %s", refused, self.servers.urls)
            return
        self.exchange()  # a draining server gets no new request from here
        for url in change.joined:
            logger.info("rollout server %s joins; it gets requests once it generates at the current weights", url)
        for url in change.draining:
            logger.info("rollout server %s left the run's set: it gets no new request and no weight sync, and "
                        "leaves once its requests (or a weight-sync step) in flight are done", url)
            task = asyncio.ensure_future(self._resume_after_sync(url, syncs_ended if syncing else None))
            self._resumes.add(task)
            task.add_done_callback(self._resumes.discard)

    async def _resume_after_sync(self, url: str, syncs_ended: int | None) -> None:
        """A sync running when `url` left may have paused it, freezing its requests; the sync no longer goes to it,
        so it is resumed here once that sync is over (harmless when it was not paused)."""
        if syncs_ended is None:
            return
        while self.servers.syncs_ended <= syncs_ended:
            await asyncio.sleep(0.1)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.post(f"{url}/resume", timeout=aiohttp.ClientTimeout(total=10)):
                pass
