"""The worker's router (in a process of its own, as in TRL's worker child) and the learner's supervision, against
small HTTP servers that answer like vLLM's `/v1/completions` (or fail like a dead one).

Real vLLM servers are covered by tests/trainer/rollout/test_replicas.py and test_routing_guards.py; these cases need
servers that die, hang or refuse on cue.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from grpo_trainer.contract.metrics import (
    METRIC_REPLICA_FAILURES,
    METRIC_REPLICA_READY,
    METRIC_REPLICA_SAMPLES,
    METRIC_REPLICA_WEIGHT_VERSION,
)
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport
from grpo_trainer.contract.rollout_pod import (
    LOADING_WEIGHTS,
    MIN_WEIGHT_VERSION_HEADER,
    SERVED_WEIGHT_VERSION_HEADER,
    WEIGHT_REFUSED_STATUS,
)
from grpo_trainer.learner.exporter import render_metrics
from grpo_trainer.rollout.route_board import Route, RouteBoard, Routes, RouteState, Tally
from grpo_trainer.rollout.supervisor import SupervisorTimings
from grpo_trainer.rollout.weight_sync import resume_version
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.routing import FAST, routing


class FakeServer:
    """A vLLM-shaped server on its own loop thread; `mode` is "ok", "fail" (500 like a dead engine), "slow",
    "behind" (its weight-version gate refuses every request naming a version, as a restarted server's does) or
    "loading" (its gate refuses them while a weight load is under way)."""

    def __init__(self, name: str, mode: str = "ok"):
        self.name, self.mode, self.served, self.probes, self.refused = name, mode, 0, 0, 0
        self.completed_at: list[float] = []
        self.probed_at: list[float] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/resume", self._resume)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _resume(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def _complete(self, request: web.Request) -> web.Response:
        if self.mode == "fail":
            return web.json_response({"error": "EngineCore encountered an issue"}, status=500)
        if self.mode in ("behind", "loading") and MIN_WEIGHT_VERSION_HEADER in request.headers:
            self.refused += 1
            held = "v0" if self.mode == "behind" else LOADING_WEIGHTS
            return web.json_response({"error": self.mode}, status=WEIGHT_REFUSED_STATUS,
                                     headers={SERVED_WEIGHT_VERSION_HEADER: held})
        await asyncio.sleep(0.05 if self.mode in ("ok", "behind") else 0.3)
        payload = await request.json()
        if payload.get("max_tokens") != 1:  # not the supervision's probe
            self.served += 1
            self.completed_at.append(time.monotonic())
        else:
            self.probes += 1
            self.probed_at.append(time.monotonic())
        return web.json_response({"choices": [{"text": self.name, "token_ids": [1]}]})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(name: str, mode: str = "ok") -> FakeServer:
        made.append(FakeServer(name, mode))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def test_generation_is_shared_fairly_and_an_unready_server_gets_none(servers):
    a, b, broken = servers("a"), servers("b"), servers("broken", mode="fail")
    admitted: list[str] = []
    with routing([a.url, b.url, broken.url], admit=admitted.append) as pool:
        pool.wait_ready(2)
        results = pool.send(60)
        report = pool.report()
    assert all(status == 200 for status, _ in results)
    assert 24 <= a.served <= 36 and 24 <= b.served <= 36 and a.served + b.served == 60
    assert broken.served == 0 and broken.url not in admitted  # its probe never generated
    assert report[a.url].samples == a.served and report[b.url].samples == b.served
    assert not report[broken.url].ready


def test_requests_on_a_server_that_dies_are_sent_again_to_another(servers):
    a, b = servers("a"), servers("b")
    with routing([a.url, b.url]) as pool:
        pool.wait_ready(2)
        b.mode = "fail"  # the engine died: every request on it answers 500
        results = pool.send(30)
        report = pool.report()
    assert [status for status, _ in results] == [200] * 30
    assert {text for _, text in results} == {"a"}
    assert report[b.url].failures >= 1 and not report[b.url].ready
    assert report[a.url].retried == report[b.url].failures  # every failed request was sent again, none lost


def test_a_server_whose_gate_refuses_gets_no_more_and_is_admitted_again_before_it_does(servers):
    # A restarted server holds the model it loaded: its gate refuses what names the pool's version. The router
    # sends the request elsewhere; the learner takes the server out and runs its catch-up before it is used again.
    a, b = servers("a"), servers("b")
    admitted: list[str] = []

    def catch_up(url: str) -> None:
        admitted.append(url)
        if url == b.url and admitted.count(b.url) > 1:
            b.mode = "ok"  # the catch-up loaded the current weights

    with routing([a.url, b.url], admit=catch_up) as pool:
        pool.wait_ready(2)
        pool.servers.sync_ended(3)  # a sync published v3
        b.mode = "behind"  # it restarted meanwhile
        results = pool.send(30)
        pool.wait_for(lambda: admitted.count(b.url) == 2 and len(pool.servers.ready_urls()) == 2, "b's catch-up")
        later = pool.send(20)
        report = pool.report()
    assert [status for status, _ in results] == [200] * 30 and {text for _, text in results} == {"a"}
    assert b.refused >= 1 and b.served == [text for _, text in later].count("b") > 0
    assert report[b.url].failures == b.refused and "holds weights v0" in report[b.url].last_error


def test_while_every_server_loads_weights_requests_wait_and_no_server_is_taken_out(servers):
    # A weight sync: the gate of each server refuses while it loads, then serves the version it loaded.
    a, b = servers("a"), servers("b")
    with routing([a.url, b.url]) as pool:
        pool.wait_ready(2)
        a.mode = b.mode = "loading"
        sending = pool.start_sending(8)
        pool.wait_for(lambda: a.refused >= 8 and b.refused >= 8, "the requests to be refused while loading")
        a.mode = b.mode = "ok"
        results = sending.result()
        report = pool.report()
    assert [status for status, _ in results] == [200] * 8
    assert report[a.url].failures == report[b.url].failures == 0 and report[a.url].ready and report[b.url].ready


def test_with_no_ready_server_a_request_waits_and_is_served_once_one_is_admitted(servers):
    a = servers("a", mode="fail")
    admitted: list[str] = []
    with routing([a.url], admit=admitted.append) as pool:
        sending = pool.start_sending(3)
        try:
            sending.stderr_line("no rollout server is ready")
            assert sending.process.poll() is None
            a.mode = "ok"  # the restarted server generates again
            results = sending.result()
        finally:
            sending.kill()
    assert [status for status, _ in results] == [200] * 3
    assert admitted == [a.url]  # the catch-up ran before it took traffic


def test_with_no_server_within_the_bound_the_request_fails_for_trls_retry(servers):
    a = servers("a", mode="fail")
    with routing([a.url]) as pool:
        [(status, error)] = pool.send(1, wait_s=0.5)
    assert status == 0 and "NoServerReady" in error and "no rollout server was ready within" in error


def test_server_state_is_exported_with_a_replica_label():
    report = ProgressReport(rollout=[
        RolloutReplicaReport(replica=0, url="http://a", ready=True, weight_version="v7", samples=40),
        RolloutReplicaReport(replica=1, url="http://b", ready=False, weight_version=None, samples=3, failures=2),
    ])
    text = render_metrics(lambda: report).decode()
    assert f'{METRIC_REPLICA_READY}{{replica="0"}} 1.0' in text
    assert f'{METRIC_REPLICA_READY}{{replica="1"}} 0.0' in text
    assert f'{METRIC_REPLICA_WEIGHT_VERSION}{{replica="0"}} 7.0' in text
    assert f'{METRIC_REPLICA_SAMPLES}{{replica="0"}} 40.0' in text
    assert f'{METRIC_REPLICA_FAILURES}{{replica="1"}} 2.0' in text


def test_a_restarted_learner_keeps_counting_versions_and_cleans_old_and_partial_ones(tmp_path: Path):
    for name in ("v1", "v2", "v3", ".v4.partial-123"):
        (tmp_path / name).mkdir()
    (tmp_path / "v3" / "model-00000.safetensors").write_bytes(b"x")
    assert resume_version(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]
    assert resume_version(tmp_path) == 3  # a second restart: the same version, nothing else removed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resume_version(empty) == 0


def test_a_hung_server_leaves_the_pool_its_requests_go_elsewhere_and_it_returns_after_catching_up(servers):
    # A SIGSTOPped server accepts connections (the kernel does) and answers nothing, /health included: only a
    # generation with a timeout tells it from a busy one.
    # Its completions take 3 s, so that requests are in flight on it when it hangs.
    hung = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "hung", "--delay", "3"],
                            stdout=subprocess.PIPE, text=True)
    try:
        hung_url = hung.stdout.readline().strip()
        b = servers("b")
        admitted: list[str] = []
        timings = SupervisorTimings(probe_interval_s=0.1, tally_interval_s=0.05, liveness_interval_s=0.2,
                                    liveness_timeout_s=1.0)
        with routing([hung_url, b.url], admit=admitted.append, timings=timings) as pool:
            pool.wait_ready(2)
            sending = pool.start_sending(20)  # the request timeout (30 s) is far off
            pool.wait_for(lambda: pool.report()[hung_url].ready and pool.servers.in_flight(hung_url) > 0,
                          "requests in flight on the server about to hang")
            os.kill(hung.pid, signal.SIGSTOP)
            results = sending.result()
            report = pool.report()
            assert not report[hung_url].ready and "liveness" in report[hung_url].last_error
            later = pool.send(10)
            assert sorted(admitted) == sorted([hung_url, b.url])
            os.kill(hung.pid, signal.SIGCONT)  # it generates again: admitted only after the catch-up
            pool.wait_ready(2)
            report = pool.report()
    finally:
        hung.kill()
        hung.wait()
    assert [status for status, _ in results] == [200] * 20 and {text for _, text in results} <= {"hung", "b"}
    assert {text for _, text in later} == {"b"}  # out of the pool: no traffic
    assert admitted.count(hung_url) == 2 and admitted[-1] == hung_url
    # Every request caught on it was sent again; the liveness verdict itself counts as one failure.
    assert report[b.url].retried == report[hung_url].failures - 1 >= 1


def test_a_server_whose_completions_keep_coming_back_is_not_probed_and_an_idle_one_is(servers):
    # Its completions prove it generates; a probe would take one of its slots (vLLM's --max-num-seqs) from the run.
    # The interval is long next to a loaded machine's scheduling delays: the admission proves it too, and the first
    # completion must come back within the interval for the test to measure the busy stretch at all.
    server = servers("a")
    interval_s = 1.0
    timings = SupervisorTimings(probe_interval_s=0.1, tally_interval_s=0.05, liveness_interval_s=interval_s,
                                liveness_timeout_s=5.0)
    with routing([server.url], timings=timings) as pool:
        pool.wait_ready(1)
        pool.send(160, window=2)  # 80 rounds of 0.05 s: ~4 s, 4 intervals
        time.sleep(3 * interval_s)  # idle: nothing proves it but the probe (due within 1.25 intervals)
        ready = pool.servers.is_ready(server.url)
    first, last = server.completed_at[0], server.completed_at[-1]
    busy_probes = [at for at in server.probed_at if first < at < last]
    idle_probes = [at for at in server.probed_at if at > last]
    assert last - first > 3 * interval_s and busy_probes == [], (last - first, busy_probes)
    assert idle_probes and ready


def test_servers_of_unequal_speed_get_equal_concurrency_and_samples_by_speed(servers):
    # TRL's worker keeps a fixed window of requests in flight. Least outstanding requests keeps each server's share
    # of that window equal, so the faster server finishes (and is sent) more: requests dispatched and samples
    # finished differ by at most the window, and both measure speed. The fair share is of the concurrency.
    fast, slow = servers("fast"), servers("slow", mode="slow")  # 0.05 s and 0.3 s per completion
    with routing([fast.url, slow.url]) as pool:
        pool.wait_ready(2)
        assert [status for status, _ in pool.send(120, window=8)] == [200] * 120
        report = pool.report()
    assert fast.served + slow.served == 120 and slow.served < 0.35 * 120  # the counts follow the servers' speed
    busy = report[fast.url].request_seconds + report[slow.url].request_seconds
    assert min(report[fast.url].request_seconds, report[slow.url].request_seconds) >= 0.35 * busy


def test_a_stopping_learner_does_not_wait_on_a_probe_a_frozen_server_holds():
    # The learner stops its supervision after the checkpoint, within the pod's grace period, and a drain stops or
    # freezes the servers at the same moment: a liveness probe then hangs on a frozen server.
    hung = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "hung"], stdout=subprocess.PIPE, text=True)
    try:
        url = hung.stdout.readline().strip()
        timings = SupervisorTimings(probe_interval_s=0.1, liveness_interval_s=0.2, liveness_timeout_s=60.0)
        with routing([url], timings=timings) as pool:
            pool.wait_ready(1)
            os.kill(hung.pid, signal.SIGSTOP)
            time.sleep(1.0)  # its liveness probe is under way, and hangs
            began = time.monotonic()
            pool.supervisor.stop()
            stopped_s = time.monotonic() - began
    finally:
        hung.kill()
        hung.wait()
    assert stopped_s < 10, f"the stop waited {stopped_s:.0f} s on the frozen server's probe"


def test_the_routes_read_whole_or_not_at_all_and_the_tallies_are_the_routers():
    board = RouteBoard.create()
    reader = RouteBoard.attach(board.path)
    try:
        assert reader.routes() == Routes(version=0)  # nothing published yet
        routes = Routes(4, (Route(0, "http://a", 0, RouteState.SERVING, 1, 0),
                            Route(1, "http://b", 1, RouteState.DRAINING, 2, 1)))
        board.publish(routes)
        assert reader.routes() == routes
        # A write caught halfway (its bytes changed, its CRC not yet): the last good copy stands.
        board._map[20:24] = b"XXXX"
        board._map[0:8] = (board.sequence + 1).to_bytes(8, "little")
        assert reader.routes() == routes
        reader.add(1, Tally.SENT, 3)
        reader.add(1, Tally.ENDED)
        reader.record_error(1, "HTTP 500: dead")
        reader.add(1, Tally.FAILED)
        tally = board.tally(1)
        assert (tally.sent, tally.in_flight, tally.failed, tally.error) == (3, 2, 1, "HTTP 500: dead")
    finally:
        reader.close()
        board.close()
    assert not Path(board.path).exists()


def test_the_router_process_attaches_to_a_board_it_did_not_create_and_leaves_it(servers, tmp_path):
    a = servers("a")
    with routing([a.url], timings=FAST) as pool:
        pool.wait_ready(1)
        assert pool.send(2) == [(200, "a"), (200, "a")]
        assert Path(pool.board.path).exists()  # the router's exit does not remove the learner's board
        path = pool.board.path
    assert not Path(path).exists()


def test_the_pools_report_after_its_stop_holds_what_the_router_tallied_last(servers, tmp_path):
    # The learner stops its pool before it writes its final report (the termination message).
    from grpo_trainer.contract.config import RunConfig
    from grpo_trainer.rollout.pool import start_rollout_pool
    from tests.support.routing import Routing

    a = servers("a")
    config = RunConfig.model_validate({
        "model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "rollout": {"urls": [a.url], "weightSync": {"mode": "filesystem", "directory": str(tmp_path / "w")}}})
    pool = start_rollout_pool(config, ready_timeout_s=30, tied_embeddings=False)
    try:
        deadline = time.monotonic() + 30
        while not pool.servers.ready_urls():
            assert time.monotonic() < deadline, "the server was never admitted"
            time.sleep(0.05)
        assert pool.routing().board == pool.board.path
        assert Routing(pool.servers, pool.board, pool.supervisor).send(5) == [(200, "a")] * 5
    finally:
        pool.stop()
    [replica] = pool.report()
    assert replica.samples == 5 and replica.ready
    pool.stop()  # a second stop (the learner's close after a failed start) is harmless
