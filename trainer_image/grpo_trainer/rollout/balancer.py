"""A least-outstanding-requests HTTP front for the rollout servers, in the learner process (rank 0).

TRL 1.16's rollout worker speaks to one server URL. The learner starts this front on loopback and gives TRL its URL:
`POST /v1/completions` goes to the ready server with the fewest requests in flight; a request that fails on a
server (connection refused or reset, a 5xx from a dead engine, no answer within the worker's own timeout) takes that
server out of the pool and is sent again to another one, so a dying server loses no sample. With no ready server
a request waits (bounded by `wait_s`, logged) instead of failing: TRL's worker would otherwise spin its own retries
against a dead port. Every other path (`/health`, `/v1/models`, `/server_info`) goes to any ready server.

An unready server is probed by generating one token (`rollout_health.generation_probe`), not by `/health`: a server
whose engine died, or hung, still answers `/health`. Before it is admitted again `admit(url)` runs (the weight sync's
catch-up, which loads the current weights), so a restarted server never serves the initial or an old policy.
A ready server must prove that it generates at least every `liveness_interval_s`: a completion it returns proves
it; one that returned none in that time is probed the same way, except while a weight sync holds it paused (a paused
server holds the probe too). A server whose completions keep coming back is never probed, so the probe takes none of
its slots while it is busy. A server that generates no token within `liveness_timeout_s` is hung. It leaves
the pool, the requests in flight on it are sent again to another server at once (not after the request timeout),
and it is admitted again, through the same catch-up, once it generates.

With a `RolloutUrlsWatch` the set of servers follows the run config while the learner runs
(`server_set.ServerSet.apply`): a new server joins through the same admission; a server that left gets no new
request and is in no weight sync, its requests in flight finish there (or, if it fails or hangs, are sent again
elsewhere), and it leaves the set when none is left. A sync that was running when it left may have paused it: it is
resumed once that sync ends, so its frozen requests finish without the sync waiting on it.
The clocks named here are `BalancerTimings` fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ..contract.rollout_pod import PROBE_TIMEOUT_S
from ..server.health import generation_probe
from .run_config_watch import WATCH_INTERVAL_S, RolloutUrlsWatch
from .server_set import EmptyRolloutSet, ServerSet

logger = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
#: Headers that describe one hop's connection, never forwarded (RFC 9110 7.6.1), plus those aiohttp recomputes.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"})

AdmitFn = Callable[[str], None]
#: How often a ready server must prove it generates. A CPU server busy with TRL's full in-flight window answered a
#: one-token probe within a few seconds here, far inside PROBE_TIMEOUT_S.
LIVENESS_INTERVAL_S = 15.0
#: Servers are looked at this many times per interval, so one that stops generating is probed within 1.25 intervals
#: of its last proof, not two.
LIVENESS_LOOKS_PER_INTERVAL = 4
#: The event-loop thread's name: what per-thread CPU figures (the bench's) find it by.
THREAD_NAME = "grpo-rollout-balancer"


@dataclass(frozen=True)
class BalancerTimings:
    """The balancer's clocks. `wait_s`: how long a request is held while no server is ready; `probe_interval_s`: how
    often unready servers are probed; `request_timeout_s`: a request's whole time on one server;
    `liveness_interval_s`/`liveness_timeout_s`: how often a ready server must generate a token, and within what;
    `watch_interval_s`: how often the run config's rollout URLs are read again."""

    wait_s: float = 600.0
    probe_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    liveness_interval_s: float = LIVENESS_INTERVAL_S
    liveness_timeout_s: float = PROBE_TIMEOUT_S
    watch_interval_s: float = WATCH_INTERVAL_S


DEFAULT_TIMINGS = BalancerTimings()


class RolloutBalancer:
    def __init__(
        self, servers: ServerSet, model: str, *, admit: AdmitFn | None = None, host: str = "127.0.0.1",
        port: int = 0, watch: RolloutUrlsWatch | None = None, timings: BalancerTimings = DEFAULT_TIMINGS,
    ):
        self.servers = servers
        self.model = model
        self.admit = admit
        self.watch = watch
        self.host, self.port = host, port
        self.timings = timings
        # The generation requests being forwarded to each server: cancelled when it is found hung, so that they go
        # elsewhere at once. Registered, not wrapped in a task and a waiter of their own per request: those made
        # about a sixth of the balancer thread's Python calls per proxied request.
        self._forwarding: dict[str, set[asyncio.Task]] = {}
        self._found_hung: set[asyncio.Task] = set()  # of those, the ones cancelled for that reason
        self.waiting = 0  # requests held because no server is ready (visible in logs and tests)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=THREAD_NAME, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._liveness_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._resumes: set[asyncio.Task] = set()  # draining servers to resume after the sync that paused them

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- life cycle ---------------------------------------------------------------------------------------------------
    def start(self) -> RolloutBalancer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        logger.info("rollout balancer on %s over %d server(s)", self.url, len(self.servers))
        return self

    async def _start(self) -> None:
        # No pool limit: TRL's worker bounds concurrency itself (max_inflight_tasks).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # The requests still in flight at the stop are the learner's own worker's, which has stopped. aiohttp's
        # default waits 60 s for them: a drained node's frozen or stopping servers held the learner past its grace
        # period (the kubelet's SIGKILL, after the checkpoint was saved).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._probe_task = asyncio.ensure_future(self._probe_forever())
        self._liveness_task = asyncio.ensure_future(self._liveness_forever())
        if self.watch is not None:
            self._watch_task = asyncio.ensure_future(self._watch_forever())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _stop(self) -> None:
        for task in (self._probe_task, self._liveness_task, self._watch_task, *self._resumes):
            if task is not None:
                task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # -- readiness ----------------------------------------------------------------------------------------------------
    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(url) for url in self.servers.to_admit()))
            await asyncio.sleep(self.timings.probe_interval_s)

    async def _probe(self, url: str) -> None:
        # A server left paused by a failed sync holds every request, the probe's too: it gets no traffic from here
        # until admitted, so letting it run is safe.
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
            logger.info("rollout server %s is ready", url)

    async def _liveness_forever(self) -> None:
        interval = self.timings.liveness_interval_s
        while True:
            await asyncio.sleep(interval / LIVENESS_LOOKS_PER_INTERVAL)
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
        for task in self._forwarding.pop(url, ()):
            self._found_hung.add(task)
            task.cancel()

    # -- membership ---------------------------------------------------------------------------------------------------
    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.timings.watch_interval_s)
            urls = self.watch.poll()
            if urls is not None:
                self.apply_servers(urls)

    def apply_servers(self, urls: list[str]) -> None:
        """Make `urls` the set of servers (on the balancer's loop)."""
        syncing, syncs_ended = self.servers.syncing, self.servers.syncs_ended
        try:
            change = self.servers.apply(urls)
        except EmptyRolloutSet:
            logger.warning("an empty set of rollout servers is refused; the learner keeps %s", self.servers.urls)
            return
        for url in change.joined:
            logger.info("rollout server %s joins; it gets requests once it generates at the current weights", url)
        for url in change.draining:
            logger.info("rollout server %s left the run's set: it gets no new request and no weight sync, and "
                        "leaves once its requests (or a weight-sync step) in flight are done", url)
        for url in change.left:
            logger.info("rollout server %s left the run's set (no request in flight on it)", url)
        for url in change.draining:
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

    # -- forwarding ---------------------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if request.path == COMPLETIONS_PATH and request.method == "POST":
            return await self._generate(request, body, headers)
        server = await self._acquire()
        if server is None:
            return web.json_response({"error": "no rollout server is ready"}, status=503)
        try:
            status, answer, content_type = await self._forward(server.url, request, body, headers)
        except (TimeoutError, aiohttp.ClientError) as error:
            self.servers.release(server, ok=False, error=f"{type(error).__name__}: {error}")
            return web.json_response({"error": f"rollout server {server.url}: {error}"}, status=502)
        self.servers.release(server, ok=True, sample=False)
        return web.Response(status=status, body=answer, content_type=content_type)

    async def _generate(self, request: web.Request, body: bytes, headers: dict) -> web.StreamResponse:
        attempts = 0
        while True:
            server = await self._acquire()
            if server is None:
                return web.json_response({"error": f"no rollout server was ready within {self.timings.wait_s:.0f}s"},
                                         status=503)
            if attempts:
                self.servers.count_retry(server)
            attempts += 1
            # Registered with no await since `_acquire` found the server ready: a server found hung meanwhile has
            # this request's task among those it cancels.
            task = asyncio.current_task()
            forwarding = self._forwarding.setdefault(server.url, set())
            forwarding.add(task)
            failure = None
            try:
                status, answer, content_type = await self._forward(server.url, request, body, headers)
            except (TimeoutError, aiohttp.ClientError) as error:
                failure = f"{type(error).__name__}: {error}"
            except asyncio.CancelledError:
                if task not in self._found_hung:
                    raise
                self._found_hung.discard(task)
                task.uncancel()
                failure = f"{server.url} is hung: no token from its liveness probe"
            finally:
                forwarding.discard(task)
            if failure is None:
                if status < 500:
                    self.servers.release(server, ok=True, sample=status == 200)  # a 4xx is the request's fault
                    return web.Response(status=status, body=answer, content_type=content_type)
                failure = f"HTTP {status}: {answer[:200].decode(errors='replace')}"
            logger.warning("rollout server %s failed a generation (%s); it leaves the pool, request sent again",
                           server.url, failure)
            self.servers.release(server, ok=False, error=failure)

    async def _acquire(self):
        server = self.servers.acquire()
        if server is not None:
            return server
        self.waiting += 1
        logger.warning("no rollout server is ready; holding a request for up to %.0fs", self.timings.wait_s)
        deadline = time.monotonic() + self.timings.wait_s
        try:
            while server is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                server = self.servers.acquire()
            return server
        finally:
            self.waiting -= 1

    async def _forward(self, url: str, request: web.Request, body: bytes, headers: dict) -> tuple[int, bytes, str]:
        timeout = aiohttp.ClientTimeout(total=self.timings.request_timeout_s)
        async with self._session.request(request.method, f"{url}{request.path_qs}", data=body, headers=headers,
                                         timeout=timeout) as response:
            return response.status, await response.read(), response.content_type
