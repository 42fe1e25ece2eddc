"""Generation requests routed in TRL's rollout worker child, straight to the rollout servers.

TRL's worker sends every generation request itself, from its spawned child (`_AsyncRolloutLoop._post`). The learner's
worker loop (grpo_trainer.rollout.worker) sends them through this router instead of to one URL: each request goes
to the server in the pool with the fewest requests in flight (ties: the fewest sent so far, then the lower index),
over the worker's own HTTP session, with no hop in between. The pool comes from the learner's supervision
(grpo_trainer.rollout.supervisor) through the route board (grpo_trainer.rollout.route_board); what the router sees
of each server goes back the same way.

What it keeps:
- A request names the pool's weight version as the least a server must hold (contract.rollout_pod's header). The
  server's gate (grpo_trainer.server.version_gate) refuses it when the server holds an older one (a restarted server
  not caught up yet, one that missed a sync): the request goes to another server and the refusal is tallied, which
  takes the server out of the pool until it is admitted again. A server that is loading weights refuses too; the
  request goes elsewhere, or, while every server loads (a weight sync), waits a moment and is sent again.
- A request that fails on a server (connection refused or reset, a 5xx, no answer within the request timeout) is
  sent again to another one at once; the router sends that server nothing more until the learner has admitted it
  again, and tallies the failure, which takes it out of the pool.
- Requests in flight on a server the learner gives up on (its liveness probe got no token, it failed a weight sync)
  are cancelled and sent again elsewhere at once, not after the request timeout.
- A draining server gets no new request; its requests in flight finish there.
- With no server in the pool a request waits (bounded: `wait_s`), rather than failing at once.
- A 4xx other than the gate's is the request's own fault: it is raised as TRL's own request would raise it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from ..contract.codes import weight_version_name
from ..contract.rollout_pod import (
    LOADING_WEIGHTS,
    MIN_WEIGHT_VERSION_HEADER,
    SERVED_WEIGHT_VERSION_HEADER,
    WEIGHT_REFUSED_STATUS,
)
from .route_board import RouteBoard, Routes, RouteState, Tally

logger = logging.getLogger(__name__)

#: How long a request waits while no server is ready before it fails (and TRL's worker retries it). Long enough for
#: a CPU server restart measured at 25-150 s here.
NO_SERVER_WAIT_S = 300.0
#: How often the routes are read again while a request waits, and while requests are in flight (a server given up
#: on has its requests sent again within this).
CHECK_INTERVAL_S = 0.2
#: The pause before a request is sent again when every server in the pool was loading weights: doubled each time, up
#: to LOADING_RETRY_MAX_S, so that a long load is not met with a request every few milliseconds.
LOADING_RETRY_S = 0.05
LOADING_RETRY_MAX_S = 1.0


@dataclass(frozen=True)
class RouterSettings:
    """What TRL's worker child needs to route (picklable: the child is spawned). `board`: the route board's path."""

    board: str
    wait_s: float = NO_SERVER_WAIT_S
    check_interval_s: float = CHECK_INTERVAL_S


class NoServerReady(aiohttp.ClientConnectionError):
    """No rollout server was in the pool within the wait: TRL's worker retries the request, as a refused
    connection."""


@dataclass
class _Server:
    """The router's own count for one slot."""

    in_flight: int = 0
    sent: int = 0
    busy_s: float = 0.0
    changed_at: float = field(default_factory=time.monotonic)
    tasks: set[asyncio.Task] = field(default_factory=set)
    excluded_under: int | None = None  # its admission count when a request failed there
    abandons: int = 0


#: What one attempt came to, when it did not return a completion.
_LOADING, _FAILED = "loading", "failed"
_NO_ANSWER = object()


class ServerRouter:
    def __init__(self, settings: RouterSettings, board: RouteBoard | None = None):
        self.settings = settings
        self.board = board or RouteBoard.attach(settings.board)
        self._servers: dict[int, _Server] = {}
        self._routes = Routes(version=0)
        self._abandoned: set[asyncio.Task] = set()
        self._watch: asyncio.TimerHandle | None = None
        self._waiting = 0

    async def post(self, session: aiohttp.ClientSession, path: str, payload: dict, timeout_s: float) -> dict:
        """POST `payload` to `path` on a server of the pool; its JSON answer (TRL's `_post` contract)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(self.settings.check_interval_s, self._look)
        loading: set[int] = set()  # servers that refused this request while loading weights
        loading_retry_s = LOADING_RETRY_S
        failed_before = False
        waiting_since = None
        while True:
            routes = self._refresh()
            route = self._choose(routes, loading)
            if route is None:
                if loading:  # every server in the pool is loading weights: a sync is under way
                    loading.clear()
                    await asyncio.sleep(loading_retry_s)
                    loading_retry_s = min(2 * loading_retry_s, LOADING_RETRY_MAX_S)
                    continue
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    if not self._waiting:
                        logger.warning("no rollout server is ready; requests wait for one for up to %.0fs",
                                       self.settings.wait_s)
                elif time.monotonic() - waiting_since > self.settings.wait_s:
                    raise NoServerReady(f"no rollout server was ready within {self.settings.wait_s:.0f}s")
                self._waiting += 1
                try:
                    await asyncio.sleep(self.settings.check_interval_s)
                finally:
                    self._waiting -= 1
                continue
            waiting_since = None
            outcome = await self._attempt(session, route, routes.version, (path, payload, timeout_s), failed_before)
            if isinstance(outcome, dict):
                return outcome
            if outcome == _LOADING:
                loading.add(route.slot)
            else:
                failed_before = True

    # -- one attempt on one server ------------------------------------------------------------------------------------
    async def _attempt(self, session: aiohttp.ClientSession, route, version: int, request: tuple[str, dict, float],
                       retried: bool) -> dict | str:
        path, payload, timeout_s = request
        server = self._servers[route.slot]
        task = asyncio.current_task()
        self._hold(route.slot, server, +1)
        self.board.add(route.slot, Tally.SENT)
        if retried:
            self.board.add(route.slot, Tally.RETRIED)
        server.tasks.add(task)
        status, content, error, refused_by = 0, _NO_ANSWER, "", None
        try:
            async with session.post(f"{route.url}{path}", json=payload,
                                    headers={MIN_WEIGHT_VERSION_HEADER: weight_version_name(version)},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                status = response.status
                if status == 200:
                    content = await response.json()
                else:
                    refused_by = response.headers.get(SERVED_WEIGHT_VERSION_HEADER)
                    text = (await response.read())[:200].decode(errors="replace")
                    error = f"HTTP {status}: {text}"
                    request_info, history, headers, reason = (response.request_info, response.history,
                                                              response.headers, response.reason)
        except asyncio.CancelledError:
            if task not in self._abandoned:
                self._end(route.slot, server, task)
                raise
            self._abandoned.discard(task)
            task.uncancel()
            error = f"{route.url} was given up on (no token from its liveness probe, or a failed weight sync)"
        except (aiohttp.ClientError, TimeoutError, ValueError) as failure:
            error = f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__
        self._end(route.slot, server, task)
        if status == 200 and content is not _NO_ANSWER:
            self.board.set(route.slot, Tally.LAST_DONE, time.time())
            self.board.add(route.slot, Tally.DONE)
            return content if content else {}
        if status == WEIGHT_REFUSED_STATUS and refused_by is not None:
            if refused_by == LOADING_WEIGHTS:
                return _LOADING
            error = f"it holds weights {refused_by}, the pool serves {weight_version_name(version)} or newer"
            return self._exclude(route, server, Tally.REFUSED, error)
        if 400 <= status < 500:  # the request's own fault, as TRL's worker would have raised it
            raise aiohttp.ClientResponseError(request_info, history, status=status, message=reason or error,
                                              headers=headers)
        logger.warning("rollout server %s failed a generation (%s); the request is sent again to another server",
                       route.url, error)
        return self._exclude(route, server, Tally.FAILED, error)

    def _exclude(self, route, server: _Server, tally: Tally, error: str) -> str:
        """No more requests to this server until the learner admits it again; the learner hears of it by the
        tally (the error's text first, so that it is there when the count grows)."""
        server.excluded_under = route.admissions
        self.board.record_error(route.slot, error)
        self.board.add(route.slot, tally)
        return _FAILED

    def _hold(self, slot: int, server: _Server, delta: int) -> None:
        now = time.monotonic()
        server.busy_s += server.in_flight * (now - server.changed_at)
        server.changed_at = now
        server.in_flight += delta
        self.board.set(slot, Tally.BUSY_S, server.busy_s)

    def _end(self, slot: int, server: _Server, task: asyncio.Task) -> None:
        server.tasks.discard(task)
        self._hold(slot, server, -1)
        self.board.add(slot, Tally.ENDED)

    # -- the routes ---------------------------------------------------------------------------------------------------
    def _refresh(self) -> Routes:
        routes = self.board.routes()
        if routes is self._routes:
            return routes
        self._routes = routes
        for route in routes.servers:
            server = self._servers.get(route.slot)
            if server is None:
                tally = self.board.tally(route.slot)
                server = self._servers[route.slot] = _Server(busy_s=tally.busy_s, sent=int(tally.sent),
                                                            abandons=route.abandons)
            if route.abandons > server.abandons:
                server.abandons = route.abandons
                for task in list(server.tasks):
                    self._abandoned.add(task)
                    task.cancel()
            if server.excluded_under is not None and route.admissions > server.excluded_under:
                server.excluded_under = None
        return routes

    def _choose(self, routes: Routes, skip: set[int]):
        """The serving server with the fewest requests in flight (ties: the fewest sent so far, then the lower
        index), now counted as sent one more. Least outstanding requests adapts to servers of different speed,
        where round robin would queue work behind the slowest one; the tie-break spreads an idle start evenly."""
        best, best_key = None, None
        for route in routes.servers:
            if route.state is not RouteState.SERVING or route.slot in skip:
                continue
            server = self._servers[route.slot]
            if server.excluded_under is not None:
                continue
            key = (server.in_flight, server.sent, route.index)
            if best_key is None or key < best_key:
                best, best_key = route, key
        if best is not None:
            self._servers[best.slot].sent += 1
        return best

    def _look(self) -> None:
        """Reads the routes while requests are in flight, so that those on a server given up on move at once even
        when nothing new is sent. A timer, not a task: the worker's loop may close with it pending."""
        self._refresh()
        if any(server.tasks for server in self._servers.values()):
            self._watch = asyncio.get_running_loop().call_later(self.settings.check_interval_s, self._look)
        else:
            self._watch = None

