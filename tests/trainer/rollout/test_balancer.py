"""The rollout balancer against small HTTP servers that answer like vLLM's `/v1/completions` (or fail like a dead one).

Real vLLM servers behind the balancer are covered by tests/trainer/rollout/test_replicas.py; these cases need servers
that die, hang or refuse on cue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from grpo_trainer.contract.metrics import (
    METRIC_REPLICA_FAILURES,
    METRIC_REPLICA_READY,
    METRIC_REPLICA_SAMPLES,
    METRIC_REPLICA_WEIGHT_VERSION,
)
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport
from grpo_trainer.learner.exporter import render_metrics
from grpo_trainer.rollout.balancer import BalancerTimings, RolloutBalancer
from grpo_trainer.rollout.server_set import ServerSet
from grpo_trainer.rollout.weight_sync import resume_version
from tests.support.paths import COMPLETIONS_SERVER

#: Unready replicas probed often, so a test sees admissions within a fraction of a second.
FAST_PROBES = BalancerTimings(probe_interval_s=0.1)


class FakeServer:
    """A vLLM-shaped server on its own loop thread; `mode` is "ok", "fail" (500 like a dead engine) or "slow"."""

    def __init__(self, name: str, mode: str = "ok"):
        self.name, self.mode, self.served, self.probes = name, mode, 0, 0
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
        await asyncio.sleep(0.05 if self.mode == "ok" else 0.3)
        payload = await request.json()
        if payload.get("max_tokens") != 1:  # not the balancer's probe
            self.served += 1
        else:
            self.probes += 1
        return web.json_response({"choices": [{"text": self.name, "token_ids": [1]}]})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)


async def _generate(url: str, count: int) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> tuple[int, str]:
            async with session.post(f"{url}/v1/completions", json={"prompt": [i], "max_tokens": 4}) as response:
                body = await response.json()
                return response.status, body["choices"][0]["text"] if response.status == 200 else str(body)

        return await asyncio.gather(*(one(i) for i in range(count)))


def _wait_ready(replicas: ServerSet, count: int, timeout_s: float = 20.0) -> None:
    async def wait() -> None:
        while len(replicas.ready_urls()) < count:
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(wait(), timeout_s))


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(name: str, mode: str = "ok") -> FakeServer:
        made.append(FakeServer(name, mode))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def test_generation_is_shared_fairly_and_an_unready_replica_gets_none(servers):
    a, b, broken = servers("a"), servers("b"), servers("broken", mode="fail")
    replicas = ServerSet([a.url, b.url, broken.url])
    admitted: list[str] = []
    balancer = RolloutBalancer(replicas, "m", admit=admitted.append, timings=FAST_PROBES).start()
    try:
        _wait_ready(replicas, 2)
        results = asyncio.run(_generate(balancer.url, 60))
    finally:
        balancer.stop()
    assert all(status == 200 for status, _ in results)
    assert 24 <= a.served <= 36 and 24 <= b.served <= 36 and a.served + b.served == 60
    assert broken.served == 0 and broken.url not in admitted  # its probe never generated
    report = {r.url: r for r in replicas.report()}
    assert report[a.url].samples == a.served and report[b.url].samples == b.served
    assert not report[broken.url].ready


def test_requests_on_a_replica_that_dies_are_sent_again_to_another(servers):
    a, b = servers("a"), servers("b")
    replicas = ServerSet([a.url, b.url])
    balancer = RolloutBalancer(replicas, "m", timings=FAST_PROBES).start()
    try:
        _wait_ready(replicas, 2)
        b.mode = "fail"  # the engine died: every request on it answers 500
        results = asyncio.run(_generate(balancer.url, 30))
    finally:
        balancer.stop()
    assert [status for status, _ in results] == [200] * 30
    assert {text for _, text in results} == {"a"}
    report = {r.url: r for r in replicas.report()}
    assert report[b.url].failures >= 1 and not report[b.url].ready
    assert report[a.url].retried == report[b.url].failures  # every failed request was sent again, none lost


def test_with_no_ready_replica_a_request_waits_and_is_served_once_one_is_admitted(servers):
    a = servers("a", mode="fail")
    replicas = ServerSet([a.url])
    admitted: list[str] = []
    timings = BalancerTimings(probe_interval_s=0.1, wait_s=30)
    balancer = RolloutBalancer(replicas, "m", admit=admitted.append, timings=timings).start()
    try:
        async def scenario() -> list[tuple[int, str]]:
            pending = asyncio.ensure_future(_generate(balancer.url, 3))
            while balancer.waiting < 3:
                await asyncio.sleep(0.05)
            assert not pending.done()
            a.mode = "ok"  # the restarted server generates again
            return await pending

        results = asyncio.run(scenario())
    finally:
        balancer.stop()
    assert [status for status, _ in results] == [200] * 3
    assert admitted == [a.url]  # the catch-up ran before it took traffic


def test_with_no_replica_within_the_bound_the_request_is_answered_503(servers):
    a = servers("a", mode="fail")
    timings = BalancerTimings(probe_interval_s=0.1, wait_s=0.5)
    balancer = RolloutBalancer(ServerSet([a.url]), "m", timings=timings).start()
    try:
        [(status, body)] = asyncio.run(_generate(balancer.url, 1))
    finally:
        balancer.stop()
    assert status == 503 and "no rollout server was ready" in body


def test_replica_state_is_exported_with_a_replica_label():
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


def test_a_hung_replica_leaves_the_pool_its_requests_go_elsewhere_and_it_returns_after_catching_up(servers):
    # A SIGSTOPped server accepts connections (the kernel does) and answers nothing, /health included: only a
    # generation with a timeout tells it from a busy one.
    hung = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "hung"],
                            stdout=subprocess.PIPE, text=True)
    try:
        hung_url = hung.stdout.readline().strip()
        b = servers("b")
        replicas = ServerSet([hung_url, b.url])
        admitted: list[str] = []
        timings = BalancerTimings(probe_interval_s=0.1, liveness_interval_s=0.2, liveness_timeout_s=1.0)
        balancer = RolloutBalancer(replicas, "m", admit=admitted.append, timings=timings).start()
        try:
            _wait_ready(replicas, 2)
            os.kill(hung.pid, signal.SIGSTOP)
            results = asyncio.run(_generate(balancer.url, 20))  # some land on the hung one before it is found
            report = {r.url: r for r in replicas.report()}
            assert not report[hung_url].ready and "liveness" in report[hung_url].last_error
            later = asyncio.run(_generate(balancer.url, 10))
            assert admitted == [hung_url, b.url] or admitted == [b.url, hung_url]
            os.kill(hung.pid, signal.SIGCONT)  # it generates again: admitted only after the catch-up
            _wait_ready(replicas, 2)
        finally:
            balancer.stop()
    finally:
        hung.kill()
        hung.wait()
    assert [status for status, _ in results] == [200] * 20 and {text for _, text in results} <= {"hung", "b"}
    assert {text for _, text in later} == {"b"}  # out of the pool: no traffic
    assert admitted.count(hung_url) == 2 and admitted[-1] == hung_url
    # Every request caught on it was sent again; the liveness verdict itself counts as one failure.
    assert report[b.url].retried == report[hung_url].failures - 1


def test_a_server_whose_completions_keep_coming_back_is_not_probed_and_an_idle_one_is(servers):
    # Its completions prove it generates; a probe would take one of its slots (vLLM's --max-num-seqs) from the run.
    server = servers("a")
    replicas = ServerSet([server.url])
    interval_s = 0.2
    timings = BalancerTimings(probe_interval_s=0.1, liveness_interval_s=interval_s, liveness_timeout_s=1.0)
    balancer = RolloutBalancer(replicas, "m", timings=timings).start()
    try:
        _wait_ready(replicas, 1)
        admission_probes = server.probes
        started = time.monotonic()
        asyncio.run(_generate_window(balancer.url, total=60, window=2))  # 30 rounds of 0.05 s: ~1.5 s, 7 intervals
        busy_s = time.monotonic() - started
        busy_probes = server.probes - admission_probes
        time.sleep(4 * interval_s)  # idle: nothing proves it but the probe
        idle_probes = server.probes - admission_probes - busy_probes
    finally:
        balancer.stop()
    assert busy_s > 3 * interval_s and busy_probes == 0, (busy_s, busy_probes)
    assert idle_probes >= 1 and replicas.is_ready(server.url)


def test_replicas_of_unequal_speed_get_equal_concurrency_and_samples_by_speed(servers):
    # TRL's worker keeps a fixed window of requests in flight. Least outstanding requests keeps each replica's share
    # of that window equal, so the faster replica finishes (and is sent) more: requests dispatched and samples
    # finished differ by at most the window, and both measure speed. The fair share is of the concurrency.
    fast, slow = servers("fast"), servers("slow", mode="slow")  # 0.05 s and 0.3 s per completion
    replicas = ServerSet([fast.url, slow.url])
    balancer = RolloutBalancer(replicas, "m", timings=FAST_PROBES).start()
    try:
        _wait_ready(replicas, 2)
        asyncio.run(_generate_window(balancer.url, total=120, window=8))
    finally:
        balancer.stop()
    report = {r.url: r for r in replicas.report()}
    assert fast.served + slow.served == 120 and slow.served < 0.35 * 120  # the counts follow the servers' speed
    busy = report[fast.url].request_seconds + report[slow.url].request_seconds
    assert min(report[fast.url].request_seconds, report[slow.url].request_seconds) >= 0.35 * busy


async def _generate_window(url: str, total: int, window: int) -> None:
    """`window` clients sending one request after another, `total` in all: TRL's worker's in-flight window."""
    left = [total]
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with session.post(f"{url}/v1/completions", json={"prompt": [0], "max_tokens": 4}) as response:
                    assert response.status == 200

        await asyncio.gather(*(client() for _ in range(window)))


def _generate_until_disconnected(url: str) -> None:
    with contextlib.suppress(aiohttp.ClientError):  # the stop closes its connection
        asyncio.run(_generate(url, 1))


def test_a_stopping_learner_does_not_wait_on_a_request_a_frozen_server_holds(servers):
    # The learner stops its balancer after the checkpoint, within the pod's 30 s grace period, and a drain stops
    # or freezes the servers at the same moment. aiohttp's shutdown waits 60 s for a handler still in flight: past
    # the stop's own 30 s bound, and past the grace period (the kubelet's SIGKILL, exit 137).
    hung = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "hung"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = hung.stdout.readline().strip()
        replicas = ServerSet([url])
        balancer = RolloutBalancer(replicas, "m", timings=FAST_PROBES).start()
        try:
            _wait_ready(replicas, 1)
            os.kill(hung.pid, signal.SIGSTOP)
            threading.Thread(target=_generate_until_disconnected, args=(balancer.url,), daemon=True).start()
            deadline = time.monotonic() + 10
            while replicas.in_flight(url) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert replicas.in_flight(url) == 1
            began = time.monotonic()
            balancer.stop()
            stopped_s = time.monotonic() - began
        finally:
            balancer.stop()
    finally:
        hung.kill()
        hung.wait()
    assert stopped_s < 10, f"the stop waited {stopped_s:.0f} s on the frozen server's request"
