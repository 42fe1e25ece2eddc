"""The learner's set of rollout servers follows `rollout.urls` in its run config file while it runs.

Scripted servers in their own processes (tests/support/servers/completions_server.py) stand behind the real balancer,
replica set and filesystem weight sync; the run config file is written as the operator or `grporun local scale`
would. The same change with real vLLM servers under `grporun local` is in tests/operator/cli/test_local_scale.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from grpo_trainer.contract.codes import ReplicaState
from grpo_trainer.contract.metrics import METRIC_REPLICA_READY, METRIC_REPLICA_SAMPLES
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport
from grpo_trainer.rollout.balancer import BalancerTimings, RolloutBalancer
from grpo_trainer.rollout.run_config_watch import RolloutUrlsWatch
from grpo_trainer.rollout.server_set import EmptyRolloutSet, ServerSet
from grpo_trainer.rollout.sync_watchdog import DaemonCall
from grpo_trainer.rollout.weight_sync import FilesystemWeightTransfer
from tests.support.paths import COMPLETIONS_SERVER

SERVER = str(COMPLETIONS_SERVER)
WATCH_S = 0.1


def write_config(path: Path, urls: list[str]) -> None:
    """A run config naming `urls`, replaced in one step as the kubelet and `grporun local scale` do."""
    config = {"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
              "rollout": {"urls": urls}}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(config))
    partial.replace(path)


@pytest.fixture
def scripted() -> Iterator[Callable[..., str]]:
    """Start a scripted server: `scripted(name, *flags)` -> its URL. All are killed at the end."""
    started: list[subprocess.Popen] = []

    def start(name: str, *flags: str) -> str:
        process = subprocess.Popen([sys.executable, SERVER, name, *flags], stdout=subprocess.PIPE, text=True)
        started.append(process)
        return process.stdout.readline().strip()

    yield start
    for process in started:
        process.kill()
        process.wait()


def states(replicas: ServerSet) -> dict[str, ReplicaState]:
    return {replica.url: replica.state for replica in replicas.report()}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def generate(url: str, count: int) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> tuple[int, str]:
            async with session.post(f"{url}/v1/completions", json={"prompt": [i], "max_tokens": 4}) as response:
                body = await response.json()
                return response.status, body["choices"][0]["text"] if response.status == 200 else str(body)

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def in_background(coroutine) -> tuple[asyncio.AbstractEventLoop, asyncio.Future]:
    """Run `coroutine` on its own loop thread, so the test can change the set while its requests are in flight."""
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop, asyncio.run_coroutine_threadsafe(coroutine, loop)


def balancer_on(config: Path, urls: list[str], admit=None) -> tuple[ServerSet, RolloutBalancer]:
    write_config(config, urls)
    replicas = ServerSet(urls)
    balancer = RolloutBalancer(replicas, "m", admit=admit, watch=RolloutUrlsWatch(config, urls),
                               timings=BalancerTimings(probe_interval_s=0.05, watch_interval_s=WATCH_S)).start()
    return replicas, balancer


def test_a_server_added_to_the_config_is_admitted_then_gets_traffic(scripted, tmp_path):
    a, b = scripted("a"), scripted("b")
    admitted: list[str] = []
    replicas, balancer = balancer_on(tmp_path / "run.json", [a], admit=admitted.append)
    try:
        wait_for(lambda: replicas.ready_urls() == [a], "a to be admitted")
        assert {text for _, text in asyncio.run(generate(balancer.url, 6))} == {"a"}
        write_config(tmp_path / "run.json", [a, b])
        wait_for(lambda: b in replicas.ready_urls(), "b to be admitted")
        results = asyncio.run(generate(balancer.url, 20))
    finally:
        balancer.stop()
    assert admitted == [a, b]  # b was caught up (the weight sync's catch-up) before it was in the pool
    assert [status for status, _ in results] == [200] * 20 and {text for _, text in results} == {"a", "b"}
    report = {replica.url: replica for replica in replicas.report()}
    assert report[b].state == ReplicaState.SERVING and report[b].replica == 1 and report[b].samples > 0


def test_a_joining_server_is_reported_joining_and_gets_nothing_until_it_generates(tmp_path):
    # Nothing listens on port 9: the new server is still loading its model.
    a_replicas = ServerSet(["http://127.0.0.1:9"])
    change = a_replicas.apply(["http://127.0.0.1:9", "http://127.0.0.1:10/"])
    assert change.joined == ("http://127.0.0.1:10",) and not change.draining
    assert set(states(a_replicas).values()) == {ReplicaState.JOINING}
    assert a_replicas.acquire() is None and a_replicas.ready_urls() == []


def test_a_removed_server_finishes_its_requests_in_flight_gets_no_new_ones_then_leaves(scripted, tmp_path):
    a, b = scripted("a"), scripted("b", "--delay", "1.5")
    replicas, balancer = balancer_on(tmp_path / "run.json", [a, b])
    try:
        wait_for(lambda: len(replicas.ready_urls()) == 2, "both servers to be admitted")
        loop, first = in_background(generate(balancer.url, 4))  # least outstanding: two land on b and take 1.5 s
        wait_for(lambda: replicas.in_flight(b) == 2,
                 "two requests in flight on b")
        write_config(tmp_path / "run.json", [a])
        wait_for(lambda: states(replicas).get(b) == ReplicaState.DRAINING, "b to drain")
        during = asyncio.run(generate(balancer.url, 10))  # while b drains
        assert b in replicas.urls  # still reported: its two requests are in flight
        first_results = first.result(timeout=30)
        wait_for(lambda: b not in replicas.urls, "b to leave the report")
        loop.call_soon_threadsafe(loop.stop)
    finally:
        balancer.stop()
    assert [text for _, text in first_results].count("b") == 2  # its requests in flight finished there
    assert [status for status, _ in first_results + during] == [200] * 14
    assert {text for _, text in during} == {"a"}  # no new request went to b
    assert [replica.url for replica in replicas.report()] == [a]


def _b_draining_with_two_in_flight(replicas, balancer, run_json, a: str, b: str):
    """Both servers admitted, four requests sent (two in flight on b), then b taken out of the run config: b drains.
    Returns the generation's loop and its future."""
    wait_for(lambda: len(replicas.ready_urls()) == 2, "both servers to be admitted")
    loop, first = in_background(generate(balancer.url, 4))
    wait_for(lambda: replicas.in_flight(b) == 2, "two requests in flight on b")
    write_config(run_json, [a])
    wait_for(lambda: states(replicas).get(b) == ReplicaState.DRAINING, "b to drain")
    return loop, first


def test_a_removed_server_that_dies_with_requests_in_flight_has_them_sent_again(scripted, tmp_path):
    a = scripted("a")
    b_process = subprocess.Popen([sys.executable, SERVER, "b", "--delay", "30"], stdout=subprocess.PIPE, text=True)
    try:
        b = b_process.stdout.readline().strip()
        replicas, balancer = balancer_on(tmp_path / "run.json", [a, b])
        try:
            loop, first = _b_draining_with_two_in_flight(replicas, balancer, tmp_path / "run.json", a, b)
            b_process.kill()  # its pod deleted before it drained (the operator's drain deadline)
            results = first.result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
        finally:
            balancer.stop()
    finally:
        b_process.kill()
        b_process.wait()
    assert [status for status, _ in results] == [200] * 4 and {text for _, text in results} == {"a"}
    report = {replica.url: replica for replica in replicas.report()}
    assert list(report) == [a] and report[a].retried == 2  # both were sent again, none lost


def test_a_server_removed_during_a_weight_sync_is_in_none_of_its_steps_and_its_frozen_requests_finish(
        scripted, tmp_path):
    # b would hang the sync had it been sent the reload: it never answers /collective_rpc. Both servers freeze
    # their requests while paused, as vLLM's pause(mode=keep) does.
    a = scripted("a", "--pause-holds")
    b = scripted("b", "--pause-holds", "--delay", "0.5", "--hang", "/collective_rpc")
    replicas, balancer = balancer_on(tmp_path / "run.json", [a, b])
    sync = FilesystemWeightTransfer([a, b], tmp_path / "weights", servers=replicas, timeout_s=5)
    sync.init_weight_transfer()
    try:
        wait_for(lambda: len(replicas.ready_urls()) == 2, "both servers to be admitted")
        loop, first = in_background(generate(balancer.url, 4))
        wait_for(lambda: replicas.in_flight(b) == 2, "two requests in flight on b")
        sync.pause()  # b's two requests are frozen now
        write_config(tmp_path / "run.json", [a])
        wait_for(lambda: states(replicas).get(b) == ReplicaState.DRAINING, "b to drain")
        sync.send_weights(iter([("w", torch.ones(2))]))
        sync.resume()
        results = first.result(timeout=30)  # b was resumed after the sync, outside it
        wait_for(lambda: b not in replicas.urls, "b to leave the report")
        loop.call_soon_threadsafe(loop.stop)
    finally:
        balancer.stop()
    report = {replica.url: replica for replica in replicas.report()}
    assert list(report) == [a] and report[a].weight_version == "v1"
    # Had the reload gone to b, it would have failed on b after 5 s (a failure, and a sync that waited on it).
    assert b not in replicas.urls and report[a].failures == 0
    assert [status for status, _ in results] == [200] * 4 and [text for _, text in results].count("b") == 2


def test_a_replica_that_leaves_during_a_weight_sync_step_on_it_stays_reported_until_the_step_ends():
    replicas = ServerSet(["http://a", "http://b", "http://c"])
    for url in ("http://a", "http://b"):
        assert replicas.admitted(url)
    with replicas.sync_step("http://c") as held:
        assert not held  # not in the pool yet: a sync leaves it out
    with replicas.sync_step("http://c", admitting=True) as held:
        assert held  # its catch-up
        change = replicas.apply(["http://a"])
        assert change.draining == ("http://b", "http://c") and change.left == ("http://b",)
        assert replicas.urls == ["http://a", "http://c"]
    assert replicas.urls == ["http://a"] and not replicas.admitted("http://c")
    replicas.apply(["http://a", "http://b"])
    assert replicas.admitted("http://b")
    with replicas.sync_step("http://b") as held:
        assert held
        replicas.apply(["http://a"])
        assert states(replicas)["http://b"] == ReplicaState.DRAINING
        with replicas.sync_step("http://b") as again:
            assert not again  # draining: the next step of the sync leaves it out
    assert replicas.urls == ["http://a"]


def test_a_server_removed_while_a_sync_step_is_on_it_is_stopped_only_after_the_step(scripted, tmp_path, caplog):
    # `grporun local` and the operator stop a removed server once the learner's report no longer lists it. A
    # `/resume` under way on it when it left was cut off by that stop: a failed step and a warning naming a server
    # the run had let go.
    a = scripted("a")
    b_process = subprocess.Popen([sys.executable, SERVER, "b", "--slow", "/resume"], stdout=subprocess.PIPE,
                                 text=True)
    caplog.set_level(logging.WARNING, logger="grpo_trainer.rollout.weight_sync")
    try:
        b = b_process.stdout.readline().strip()
        # b's admission posts /resume too: the sync's is the one after those, so its lines are counted.
        b_lines: list[str] = []
        DaemonCall(lambda: b_lines.extend(line.strip() for line in b_process.stdout), "test-b-stdout")
        replicas, balancer = balancer_on(tmp_path / "run.json", [a, b])
        sync = FilesystemWeightTransfer([a, b], tmp_path / "weights", servers=replicas, timeout_s=30)
        sync.init_weight_transfer()
        try:
            wait_for(lambda: len(replicas.ready_urls()) == 2, "both servers to be admitted")
            sync.pause()
            sync.send_weights(iter([("w", torch.ones(2))]))
            admission_resumes = b_lines.count("began /resume")
            resume = DaemonCall(sync.resume, "test-resume")
            wait_for(lambda: b_lines.count("began /resume") > admission_resumes, "the sync's /resume on b")
            write_config(tmp_path / "run.json", [a])
            wait_for(lambda: states(replicas).get(b) != ReplicaState.SERVING, "the balancer to apply the new set")
            wait_for(lambda: b not in replicas.urls, "the report to drop b", timeout_s=20)
            stopped_while_resuming = not resume.join(0)
            b_process.kill()  # as the supervisor does the moment the report drops it
            assert resume.join(30)
        finally:
            balancer.stop()
    finally:
        b_process.kill()
        b_process.wait()
    assert not stopped_while_resuming  # the report kept b until its /resume was answered
    assert [record.getMessage() for record in caplog.records if b in record.getMessage()] == []
    assert [replica.url for replica in replicas.report()] == [a]


def test_a_server_that_comes_back_while_draining_is_admitted_again_before_traffic(scripted, tmp_path):
    a, b = scripted("a"), scripted("b", "--delay", "1.0")
    admitted: list[str] = []
    replicas, balancer = balancer_on(tmp_path / "run.json", [a, b], admit=admitted.append)
    try:
        loop, first = _b_draining_with_two_in_flight(replicas, balancer, tmp_path / "run.json", a, b)
        write_config(tmp_path / "run.json", [a, b])
        wait_for(lambda: states(replicas).get(b) == ReplicaState.SERVING, "b to serve again")
        first.result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
    finally:
        balancer.stop()
    assert sorted(admitted) == sorted([a, b, b])  # it missed syncs while draining: caught up again


def test_an_empty_set_is_refused_and_the_last_set_kept():
    replicas = ServerSet(["http://a", "http://b"])
    with pytest.raises(EmptyRolloutSet):
        replicas.apply([])
    assert replicas.urls == ["http://a", "http://b"]


def test_a_torn_or_invalid_or_empty_config_keeps_the_last_good_set_with_one_warning(tmp_path, caplog):
    path = tmp_path / "run.json"
    write_config(path, ["http://a"])
    watch = RolloutUrlsWatch(path, ["http://a"])
    assert watch.poll() is None  # the set it started with
    caplog.set_level(logging.WARNING, logger="grpo_trainer.rollout.run_config_watch")
    good = path.read_text()
    path.write_text(good[: len(good) // 2])  # caught mid-write
    assert watch.poll() is None and watch.poll() is None
    assert len(caplog.records) == 1
    assert str(path) in caplog.text and "not a valid run config" in caplog.text and "http://a" in caplog.text
    write_config(path, ["http://a", "http://b"])
    assert watch.poll() == ["http://a", "http://b"]
    caplog.clear()
    path.write_text(good.replace('"urls": ["http://a"]', '"urls": "http://c"'))
    assert watch.poll() is None
    assert "rollout.urls" in caplog.text  # names the field
    caplog.clear()
    write_config(path, [])
    assert watch.poll() is None and watch.poll() is None
    assert len(caplog.records) == 1 and "rollout.urls is empty" in caplog.text
    path.unlink()
    assert watch.poll() is None and "cannot read it" in caplog.text
    write_config(path, ["http://b/", "http://b"])
    assert watch.poll() == ["http://b"] and watch.current == ["http://b"]


def test_a_draining_server_exports_not_ready_and_never_a_second_series_for_its_ordinal():
    from grpo_trainer.learner.exporter import render_metrics

    report = ProgressReport(rollout=[
        RolloutReplicaReport(replica=0, url="http://a", ready=True, state=ReplicaState.SERVING),
        RolloutReplicaReport(replica=1, url="http://old", ready=True, state=ReplicaState.DRAINING, samples=9),
        RolloutReplicaReport(replica=1, url="http://new", ready=True, state=ReplicaState.SERVING, samples=2),
        RolloutReplicaReport(replica=2, url="http://c", ready=True, state=ReplicaState.DRAINING),
    ])
    text = render_metrics(lambda: report).decode()
    assert f'{METRIC_REPLICA_READY}{{replica="2"}} 0.0' in text  # takes no new request
    assert text.count(f'{METRIC_REPLICA_SAMPLES}{{replica="1"}}') == 1
    assert f'{METRIC_REPLICA_SAMPLES}{{replica="1"}} 2.0' in text
