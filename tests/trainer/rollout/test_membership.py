"""The learner's set of rollout servers follows `rollout.urls` in its run config file while it runs.

Scripted servers in their own processes (tests/support/servers/completions_server.py) stand behind the real
supervision, server set and filesystem weight sync, with the worker's router in a process of its own; the run config
file is written as the operator or `grporun local scale` would. The same change with real vLLM servers under
`grporun local` is in tests/operator/cli/test_local_scale.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import torch

from grpo_trainer.contract.codes import ReplicaState
from grpo_trainer.contract.metrics import METRIC_REPLICA_READY, METRIC_REPLICA_SAMPLES
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport
from grpo_trainer.rollout.route_board import Routes, SlotTally
from grpo_trainer.rollout.run_config_watch import RolloutUrlsWatch
from grpo_trainer.rollout.server_set import DRAIN_SETTLE_S, EmptyRolloutSet, ServerSet
from grpo_trainer.rollout.sync_watchdog import DaemonCall
from grpo_trainer.rollout.weight_sync import FilesystemWeightTransfer
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.routing import Routing, routing

SERVER = str(COMPLETIONS_SERVER)


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


@contextlib.contextmanager
def watching(config: Path, urls: list[str], admit=None) -> Iterator[Routing]:
    """The supervision following `config`'s rollout.urls (written here first), and the router."""
    write_config(config, urls)
    with routing(urls, admit=admit, watch=RolloutUrlsWatch(config, urls)) as pool:
        yield pool


def test_a_server_added_to_the_config_is_admitted_then_gets_traffic(scripted, tmp_path):
    a, b = scripted("a"), scripted("b")
    admitted: list[str] = []
    with watching(tmp_path / "run.json", [a], admit=admitted.append) as pool:
        pool.wait_for(lambda: pool.servers.ready_urls() == [a], "a to be admitted")
        assert {text for _, text in pool.send(6)} == {"a"}
        write_config(tmp_path / "run.json", [a, b])
        pool.wait_for(lambda: b in pool.servers.ready_urls(), "b to be admitted")
        results = pool.send(20)
        report = pool.report()
    assert admitted == [a, b]  # b was caught up (the weight sync's catch-up) before it was in the pool
    assert [status for status, _ in results] == [200] * 20 and {text for _, text in results} == {"a", "b"}
    assert report[b].state == ReplicaState.SERVING and report[b].replica == 1 and report[b].samples > 0


def test_a_joining_server_is_reported_joining_and_the_router_is_given_no_route_to_it(tmp_path):
    # Nothing listens on port 9: the new server is still loading its model.
    a_replicas = ServerSet(["http://127.0.0.1:9"])
    change = a_replicas.apply(["http://127.0.0.1:9", "http://127.0.0.1:10/"])
    assert change.joined == ("http://127.0.0.1:10",) and not change.draining
    assert set(states(a_replicas).values()) == {ReplicaState.JOINING}
    assert [route.state.value for route in a_replicas.routes().servers] == ["out", "out"]
    assert a_replicas.ready_urls() == []


def test_a_removed_server_finishes_its_requests_in_flight_gets_no_new_ones_then_leaves(scripted, tmp_path):
    a, b = scripted("a"), scripted("b", "--pause-holds")
    with watching(tmp_path / "run.json", [a, b]) as pool:
        first = _b_draining_with_two_in_flight(pool, tmp_path / "run.json", a, b)
        during = pool.send(10)  # while b drains
        assert b in pool.servers.urls  # still reported: its two requests are in flight
        requests.post(f"{b}/resume", timeout=10)
        first_results = first.result()
        pool.wait_for(lambda: b not in pool.servers.urls, "b to leave the report")
        report = pool.report()
    assert [text for _, text in first_results].count("b") == 2  # its requests in flight finished there
    assert [status for status, _ in first_results + during] == [200] * 14
    assert {text for _, text in during} == {"a"}  # no new request went to b
    assert list(report) == [a]


def _b_draining_with_two_in_flight(pool: Routing, run_json: Path, a: str, b: str,
                                   sync: FilesystemWeightTransfer | None = None):
    """Both servers admitted, b paused (it holds its completions: started with --pause-holds), four requests sent
    (least outstanding: two in flight on b), then b taken out of the run config: b drains. With `sync`, that sync
    pauses both servers before b leaves. Returns the requests being sent; b's two finish once it is resumed."""
    pool.wait_ready(2)
    requests.post(f"{b}/pause", timeout=10)
    first = pool.start_sending(4)
    pool.wait_for(lambda: pool.report()[b].ready and pool.servers.in_flight(b) == 2, "two requests in flight on b")
    if sync is not None:
        pool.wait_for(lambda: pool.report()[a].samples == 2, "a's two completions")
        sync.pause()
    write_config(run_json, [a])
    pool.wait_for(lambda: states(pool.servers).get(b) == ReplicaState.DRAINING, "b to drain")
    return first


def test_a_removed_server_that_dies_with_requests_in_flight_has_them_sent_again(scripted, tmp_path):
    a = scripted("a")
    b_process = subprocess.Popen([sys.executable, SERVER, "b", "--pause-holds"], stdout=subprocess.PIPE, text=True)
    try:
        b = b_process.stdout.readline().strip()
        with watching(tmp_path / "run.json", [a, b]) as pool:
            first = _b_draining_with_two_in_flight(pool, tmp_path / "run.json", a, b)
            b_process.kill()  # its pod deleted before it drained (the operator's drain deadline)
            results = first.result()
            pool.wait_for(lambda: b not in pool.servers.urls, "b to leave the report")
            report = pool.report()
    finally:
        b_process.kill()
        b_process.wait()
    assert [status for status, _ in results] == [200] * 4 and {text for _, text in results} == {"a"}
    assert list(report) == [a] and report[a].retried == 2  # both were sent again, none lost


def test_a_server_removed_during_a_weight_sync_is_in_none_of_its_steps_and_its_frozen_requests_finish(
        scripted, tmp_path):
    # b would hang the sync had it been sent the reload: it never answers /collective_rpc. Both servers freeze
    # their requests while paused, as vLLM's pause(mode=keep) does.
    a = scripted("a", "--pause-holds")
    b = scripted("b", "--pause-holds", "--hang", "/collective_rpc")
    with watching(tmp_path / "run.json", [a, b]) as pool:
        sync = FilesystemWeightTransfer([a, b], tmp_path / "weights", servers=pool.servers, timeout_s=5)
        sync.init_weight_transfer()
        first = _b_draining_with_two_in_flight(pool, tmp_path / "run.json", a, b, sync=sync)
        sync.send_weights(iter([("w", torch.ones(2))]))
        sync.resume()
        results = first.result()  # b was resumed after the sync, outside it
        pool.wait_for(lambda: b not in pool.servers.urls, "b to leave the report")
        report = pool.report()
    assert list(report) == [a] and report[a].weight_version == "v1"
    # Had the reload gone to b, it would have failed on b after 5 s (a failure, and a sync that waited on it).
    assert report[a].failures == 0
    assert [status for status, _ in results] == [200] * 4 and [text for _, text in results].count("b") == 2


def shown_the_drain(replicas: ServerSet) -> None:
    """The routes handed to the router, long enough ago for its count of the requests in flight to be trusted."""
    replicas.published(replicas.routes())
    time.sleep(DRAIN_SETTLE_S)


def test_a_server_that_leaves_during_a_weight_sync_step_on_it_stays_reported_until_the_step_ends():
    replicas = ServerSet(["http://a", "http://b", "http://c"])
    for url in ("http://a", "http://b"):
        assert replicas.admitted(url)
    with replicas.sync_step("http://c") as held:
        assert not held  # not in the pool yet: a sync leaves it out
    with replicas.sync_step("http://c", admitting=True) as held:
        assert held  # its catch-up
        change = replicas.apply(["http://a"])
        assert change.draining == ("http://b", "http://c")
        assert replicas.absorb({}).left == ()  # the router has not been shown the drain: its count is not trusted
        shown_the_drain(replicas)
        assert replicas.absorb({}).left == ("http://b",)  # nothing in flight on it
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
        shown_the_drain(replicas)
    assert replicas.urls == ["http://a"]


def test_a_draining_server_is_forgotten_only_once_the_routers_count_shows_nothing_in_flight():
    replicas = ServerSet(["http://a", "http://b"])
    for url in ("http://a", "http://b"):
        assert replicas.admitted(url)
    slot = replicas.slots()
    b = next(index for index, url in slot.items() if url == "http://b")
    replicas.apply(["http://a"])
    shown_the_drain(replicas)
    assert replicas.absorb({b: SlotTally(sent=3, ended=1)}).left == ()  # two in flight there
    assert replicas.urls == ["http://a", "http://b"] and replicas.in_flight("http://b") == 2
    assert replicas.absorb({b: SlotTally(sent=3, ended=3, done=3)}).left == ("http://b",)
    assert [route.url for route in replicas.routes().servers] == ["http://a"]
    assert replicas.routes() != Routes(version=0)


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
        with watching(tmp_path / "run.json", [a, b]) as pool:
            sync = FilesystemWeightTransfer([a, b], tmp_path / "weights", servers=pool.servers, timeout_s=30)
            sync.init_weight_transfer()
            pool.wait_ready(2)
            sync.pause()
            sync.send_weights(iter([("w", torch.ones(2))]))
            admission_resumes = b_lines.count("began /resume")
            resume = DaemonCall(sync.resume, "test-resume")
            pool.wait_for(lambda: b_lines.count("began /resume") > admission_resumes, "the sync's /resume on b")
            write_config(tmp_path / "run.json", [a])
            pool.wait_for(lambda: states(pool.servers).get(b) != ReplicaState.SERVING,
                          "the supervision to apply the new set")
            pool.wait_for(lambda: b not in pool.servers.urls, "the report to drop b", timeout_s=20)
            stopped_while_resuming = not resume.join(0)
            b_process.kill()  # as the supervisor does the moment the report drops it
            assert resume.join(30)
            report = pool.report()
    finally:
        b_process.kill()
        b_process.wait()
    assert not stopped_while_resuming  # the report kept b until its /resume was answered
    assert [record.getMessage() for record in caplog.records if b in record.getMessage()] == []
    assert list(report) == [a]


def test_a_server_that_comes_back_while_draining_is_admitted_again_before_traffic(scripted, tmp_path):
    a, b = scripted("a"), scripted("b", "--pause-holds")
    admitted: list[str] = []
    with watching(tmp_path / "run.json", [a, b], admit=admitted.append) as pool:
        first = _b_draining_with_two_in_flight(pool, tmp_path / "run.json", a, b)
        write_config(tmp_path / "run.json", [a, b])
        pool.wait_for(lambda: states(pool.servers).get(b) == ReplicaState.SERVING, "b to serve again")
        first.result()
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
