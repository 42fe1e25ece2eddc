"""An environment with no ready server: the pool leaves out servers that refuse connections, episodes wait at the gate
for a ready one (the real guess game, stopped and started again), and the learner's watch names the wait and ends the
run past unavailableSeconds."""

from __future__ import annotations

import threading
import time

import pytest

from grpo_trainer.agentic.availability import AvailabilityGate, EnvironmentWatch, WatchedEnvironment
from grpo_trainer.agentic.servers import Readiness, Server, ServerPool
from grpo_trainer.agentic.tools import CallBounds, episode_of, load_environment_factory
from grpo_trainer.agentic.transport import EnvironmentClient, EnvironmentFailure
from grpo_trainer.contract.codes import StallCause
from grpo_trainer.contract.config import EnvironmentServersConfig
from grpo_trainer.progress import RolloutProgress, RolloutStop, StopCode
from grpo_trainer.testing.guess_env import make_server

A, B = Server("http://10.0.0.1:80", "env:80"), Server("http://10.0.0.2:80", "env:80")


def test_a_server_that_refused_a_connection_gets_no_episode_until_a_probe_connects_again():
    now, up = [0.0], {A: True, B: True}
    pool = ServerPool("http://env:80", resolve=lambda address: [A, B], clock=lambda: now[0], interval_s=5.0,
                      probe=lambda server: up[server])
    assert pool.readiness() == Readiness(2, 2) and pool.has_ready_server()
    up[B] = False
    pool.mark_unreachable(B)  # a call could not connect to it
    assert {pool.acquire() for _ in range(4)} == {A}
    up[A] = False
    pool.mark_unreachable(A)
    assert not pool.has_ready_server()
    up[B] = True
    now[0] = 5.0  # resolved again: B is probed, and back
    assert pool.has_ready_server() and pool.acquire() == B
    assert pool.readiness() == Readiness(1, 2)


def test_the_first_episode_waits_for_a_probe_to_find_a_ready_server():
    pool = ServerPool("http://env:80", resolve=lambda address: [A], clock=lambda: 0.0, probe=lambda server: True)
    assert not pool.has_ready_server()  # resolved, never probed: the pods may not listen yet
    assert pool.readiness().ready == 1 and pool.has_ready_server()


BOUNDS = CallBounds(call_timeout_s=5.0, episode_timeout_s=10.0)


def test_a_reset_waits_while_the_environment_has_no_server_and_plays_once_one_is_back():
    server = make_server(0)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{port}"
    gate = AvailabilityGate((("guess", address),), poll_s=0.1)
    factory = load_environment_factory("grpo_trainer.testing.guess_env:make_environment", BOUNDS, gate)
    environment = factory()
    environment.server = EnvironmentClient(address)
    environment.reset(target=1)
    server.shutdown()
    server.server_close()
    with pytest.raises(EnvironmentFailure):  # refused: the episode is the environment's failure
        environment.guess(number=1)
    assert "ConnectError" in episode_of(environment).failure
    assert environment.get_reward() is None

    played = threading.Event()

    def next_episode() -> None:
        environment.reset(target=2)
        environment.guess(number=2)
        played.set()

    threading.Thread(target=next_episode, daemon=True).start()
    assert not played.wait(1.0)  # no server: the reset waits, and no episode is burnt
    back = make_server(port)
    threading.Thread(target=back.serve_forever, daemon=True).start()
    try:
        assert played.wait(10.0)
        assert environment.get_reward() == 1.0 and episode_of(environment).failure is None
    finally:
        back.shutdown()
        back.server_close()


class FakePools:
    def __init__(self):
        self.ready = {"http://guess:80": 2}

    def __call__(self, address):
        test = self

        class Pool:
            def readiness(self):
                return Readiness(test.ready[address], 2)

        return Pool()


def test_the_watch_names_the_wait_and_ends_the_run_as_stalled_past_unavailable_seconds_after_a_ready_server():
    now, pools = [100.0], FakePools()
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=4, epochs=1)
    environment = WatchedEnvironment("guess", "http://guess:80", EnvironmentServersConfig(replicas=2,
                                                                                          unavailable_seconds=5))
    expired = []
    watch = EnvironmentWatch([environment], on_expired=lambda m: (expired.append(m), progress.stop_unavailable(m)),
                             pool_of=pools, clock=lambda: now[0])
    pools.ready["http://guess:80"] = 0
    watch.poll()  # never ready yet: the start, which startupDeadlineSeconds bounds
    assert watch.waiting() == "waiting for environment guess: 0/2 ready (its servers have not been ready yet)"
    now[0] += 60
    watch.poll()
    assert watch.expired() is None and not expired
    pools.ready["http://guess:80"] = 1
    watch.poll()
    assert watch.waiting() is None
    pools.ready["http://guess:80"] = 0
    watch.poll()
    assert watch.waiting() == "waiting for environment guess: 0/2 ready"
    now[0] += 5
    watch.poll()
    assert not expired and progress.stall_verdict() is None  # at the bound, not past it
    progress.check()
    now[0] += 0.5
    watch.poll()
    watch.poll()
    assert expired == ["environment guess had no ready server for 6 s (spec.environments[].unavailableSeconds 5; "
                       "0/2 server(s) accept connections)"]
    with pytest.raises(RolloutStop) as stop:
        progress.check()
    assert stop.value.code == StopCode.STALLED and stop.value.cause == StallCause.ENVIRONMENT_UNAVAILABLE
    assert "environment guess had no ready server" in stop.value.error
    report = progress.report(phase="running", global_step=0)
    assert report.stalled and report.stall_cause == StallCause.ENVIRONMENT_UNAVAILABLE


def test_the_watch_polls_on_its_thread_until_stopped():
    pools = FakePools()
    environment = WatchedEnvironment("guess", "http://guess:80", EnvironmentServersConfig())
    watch = EnvironmentWatch([environment], on_expired=lambda m: None, pool_of=pools, poll_s=0.05)
    pools.ready["http://guess:80"] = 0
    watch.start()
    deadline = time.monotonic() + 5
    while watch.waiting() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.waiting() is not None
    watch.stop()
