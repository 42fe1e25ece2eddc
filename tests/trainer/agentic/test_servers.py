"""Pinning an episode to one environment server: the chooser, the pool's resolution, and guarded episodes playing the
real guess game against several servers, which each hold their own episodes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_trainer.agentic.servers import (
    NoServer,
    Server,
    ServerChooser,
    ServerPool,
    check_address,
    pool_for,
    resolve_servers,
)
from grpo_trainer.agentic.tools import CallBounds, episode_of, is_abandoned, load_environment_factory
from grpo_trainer.agentic.transport import EnvironmentClient
from grpo_trainer.contract.pod_env import ENVIRONMENT_URL_SEPARATOR
from grpo_trainer.testing.guess_env import WRONG_GUESS_REWARD, make_server


def test_the_chooser_gives_the_server_with_the_fewest_episodes_in_flight_and_idle_ones_take_turns():
    chooser = ServerChooser(["a", "b", "c"])
    assert [chooser.choose() for _ in range(3)] == ["a", "b", "c"]
    chooser.release("b")
    assert chooser.choose() == "b"  # the one with none in flight
    for server in "abc":
        chooser.release(server)
    assert [chooser.in_flight(server) for server in "abc"] == [0, 0, 0]
    assert [chooser.choose() for _ in range(3)] == ["a", "c", "b"]  # all idle: the one chosen longest ago first


def test_a_server_that_left_gets_no_new_episode_and_its_episodes_in_flight_still_end():
    chooser = ServerChooser(["a", "b"])
    assert [chooser.choose() for _ in range(4)] == ["a", "b", "a", "b"]
    chooser.update(["a"])
    assert [chooser.choose() for _ in range(3)] == ["a", "a", "a"]
    chooser.release("b")
    chooser.release("b")
    assert chooser.in_flight("b") == 0 and chooser.servers == ["a"]
    chooser.update([])
    assert chooser.choose() is None


def test_a_new_server_takes_episodes_until_it_has_as_many_in_flight_as_the_others():
    chooser = ServerChooser(["a", "b"])
    for _ in range(6):
        chooser.choose()
    chooser.update(["a", "b", "c", "a"])  # a repeat counts once
    assert chooser.servers == ["a", "b", "c"]
    assert [chooser.choose() for _ in range(4)] == ["c", "c", "c", "a"]


def servers(*names: str) -> list[Server]:
    return [Server(f"http://{name}:80", "env.ns.svc:80") for name in names]


class Resolver:
    """The address's answer, as a test sets it (an OSError raised when it is one)."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def __call__(self, address: str) -> list[Server]:
        self.calls += 1
        if isinstance(self.answer, OSError):
            raise self.answer
        return self.answer


def test_the_pool_resolves_its_address_again_after_its_interval_so_a_scale_down_gets_no_new_episodes():
    now = [0.0]
    resolver = Resolver(servers("10.0.0.1", "10.0.0.2"))
    pool = ServerPool("http://env.ns.svc:80", resolve=resolver, clock=lambda: now[0], interval_s=5.0)
    first, second = pool.acquire(), pool.acquire()
    assert {first.url, second.url} == {"http://10.0.0.1:80", "http://10.0.0.2:80"}
    resolver.answer = servers("10.0.0.1")  # 10.0.0.2 turned unready, or was deleted
    now[0] = 4.9
    pool.acquire()
    assert resolver.calls == 1  # within the interval: the servers as last resolved
    now[0] = 5.0
    assert [pool.acquire().url for _ in range(3)] == ["http://10.0.0.1:80"] * 3
    assert resolver.calls == 2
    pool.release(second)  # an episode that was in flight on the server that left ends


def test_a_name_with_no_ready_server_fails_the_episode_and_is_resolved_again_on_the_next():
    resolver = Resolver(OSError("Name or service not known"))
    pool = ServerPool("http://env.ns.svc:80", resolve=resolver, clock=lambda: 0.0)
    with pytest.raises(NoServer, match=r"env\.ns\.svc:80: no ready server .*Name or service not known"):
        pool.acquire()
    resolver.answer = servers("10.0.0.3")
    assert pool.acquire().url == "http://10.0.0.3:80" and resolver.calls == 2


def test_an_address_is_one_url_or_a_list_of_them_each_name_resolved_to_its_servers():
    address = ENVIRONMENT_URL_SEPARATOR.join(["http://127.0.0.1:8001", "http://localhost:8002/"])
    assert resolve_servers(address) == [Server("http://127.0.0.1:8001", "127.0.0.1:8001"),
                                        Server("http://127.0.0.1:8002", "localhost:8002")]  # IPv4 only
    assert resolve_servers("https://[::1]:8443/api") == [Server("https://[::1]:8443/api", "[::1]:8443")]
    for bad in ("", "127.0.0.1:8000", "http://a:1,ftp://b"):
        with pytest.raises(ValueError, match="must be http"):
            check_address(bad)


# ------------------------------------------------------------------------- the real game, several servers
@pytest.fixture()
def game_servers():
    started = [make_server(0) for _ in range(3)]
    for server in started:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


BOUNDS = CallBounds(call_timeout_s=30.0, episode_timeout_s=60.0)


def play(address: str, target: int) -> tuple[float | None, str | None]:
    """One guarded episode of the guess game (reset, four guesses, the reward), as TRL's pool plays it."""
    environment = load_environment_factory("grpo_trainer.testing.guess_env:make_environment", BOUNDS)()
    environment.server = EnvironmentClient(address)
    environment.reset(target=target)
    for number in range(4):
        environment.guess(number=number)
    reward = environment.get_reward()
    return reward, episode_of(environment).failure


def test_every_call_of_an_episode_reaches_the_server_that_holds_it_and_the_episodes_spread(game_servers):
    """Each server holds its own episodes: a guess or a reward that reached another server is a 400 there (no such
    episode), the guess the policy's mistake and the reward the environment's failure."""
    address = ENVIRONMENT_URL_SEPARATOR.join(f"http://127.0.0.1:{server.server_address[1]}" for server in game_servers)
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda i: play(address, i % 4), range(96)))
    assert outcomes == [(1.0 if i % 4 == 3 else WRONG_GUESS_REWARD, None) for i in range(96)]
    opened = [server.game.opened for server in game_servers]
    assert sum(opened) == 96 and min(opened) >= 16, opened  # fewest in flight: none idles while others queue
    assert set(pool_for(address).in_flight().values()) == {0}  # each episode released its server at get_reward


def test_an_ended_episode_releases_its_server_and_a_call_still_running_starts_no_other(game_servers):
    """An episode ends at get_reward, at the next reset, or when a call is abandoned at its deadline (which may still
    make a request afterwards)."""
    address = ENVIRONMENT_URL_SEPARATOR.join(f"http://127.0.0.1:{server.server_address[1]}" for server in game_servers)
    environment = load_environment_factory("grpo_trainer.testing.guess_env:make_environment", BOUNDS)()
    environment.server = EnvironmentClient(address)
    environment.reset(target=1)
    assert sorted(pool_for(address).in_flight().values()) == [0, 0, 1]
    episode = episode_of(environment)
    episode.end()
    assert set(pool_for(address).in_flight().values()) == {0}
    with pytest.raises(NoServer, match="the episode has ended"):
        episode.pins.server(pool_for(address))


def test_a_call_waiting_on_a_server_that_left_and_refuses_connections_fails_at_once_not_at_its_deadline(
        monkeypatch):
    """A deleted pod's connections hang (nothing answers, nothing resets them): the call waiting on it ends once the
    name no longer lists the server and it accepts no connection, its episode failed as the environment's, naming
    the server. A server only out of the name (its readiness failing) still finishes what it holds."""
    from grpo_trainer.agentic import servers as servers_module
    from grpo_trainer.agentic.transport import DeadlinePassed
    from tests.support.servers.broken_environment import BrokenEnvironmentServer

    hung = BrokenEnvironmentServer({"/guess": "hang"}).start()
    try:
        (server,) = resolve_servers(hung.url)
        resolver, refusing = Resolver([server]), set()
        pool = ServerPool(hung.url, resolve=resolver, interval_s=0.1, probe=lambda s: s not in refusing)
        monkeypatch.setitem(servers_module._pools, hung.url, pool)  # the process's pool of this address
        environment = load_environment_factory("grpo_trainer.testing.guess_env:make_environment", BOUNDS)()
        environment.server = EnvironmentClient(hung.url)
        environment.reset(target=1)
        resolver.answer = []  # out of the name, still accepting connections: the call goes on waiting
        timer = threading.Timer(3.0, refusing.add, args=(server,))  # then gone
        timer.start()
        started = time.monotonic()
        with pytest.raises(DeadlinePassed):
            environment.guess(number=1)
        waited = time.monotonic() - started
        timer.join()
    finally:
        hung.stop()
    assert waited >= 3.0  # not before it refused connections
    assert waited < BOUNDS.call_timeout_s  # and not at the deadline
    assert episode_of(environment).failure == (
        f"guess was abandoned: its server {server.url} left {hung.url} and does not accept connections")
    assert is_abandoned(environment)  # its call may still end: the instance is not played again
