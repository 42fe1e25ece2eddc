"""OpenEnv environments played by the learner itself: the guess game on openenv-core's server library (its own
uvicorn server here), its tool listed from the server and offered to the policy as the HTTP game's is, each episode a
session on one server, and failures judged as the HTTP transport judges them."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest
import uvicorn
from openenv.core.client_types import StepResult
from openenv.core.env_server.mcp_types import CallToolObservation, ToolErrorType
from openenv.core.env_server.mcp_types import ToolError as McpToolError
from pydantic import ValidationError
from transformers.utils import get_json_schema

from grpo_trainer.agentic import openenv_play
from grpo_trainer.agentic.openenv_play import (
    OpenEnvFactory,
    OpenEnvTarget,
    ToolSpec,
    environment_class,
    list_tools,
    wait_for_tools,
    with_openenv_environments,
)
from grpo_trainer.agentic.servers import ENVIRONMENT_URL_SEPARATOR, pool_for
from grpo_trainer.agentic.tools import CallBounds, GuardedEnvironmentFactory, ToolError, episode_of
from grpo_trainer.agentic.transport import EnvironmentFailure, ToolCallRejected
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.testing.guess_env import WRONG_GUESS_REWARD, GuessEnvironment
from grpo_trainer.testing.guess_openenv import make_app

#: Bounds no call of a test's healthy server comes near.
BOUNDS = CallBounds(call_timeout_s=30.0, episode_timeout_s=60.0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_game() -> tuple[str, uvicorn.Server]:
    """The OpenEnv guess game on a loopback port, in a thread: the server library's own app under uvicorn."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the game's server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def game_urls():
    """Two servers of the game, as an environment's address under `grporun local` names them."""
    served = [serve_game() for _ in range(2)]
    yield [url for url, _ in served]
    for _, server in served:
        server.should_exit = True


def guarded(address: str, bounds: CallBounds = BOUNDS) -> GuardedEnvironmentFactory:
    """The environment factory the learner makes for an OpenEnv environment named `guess` at `address`."""
    target = OpenEnvTarget("guess", address, bounds.call_timeout_s)
    return GuardedEnvironmentFactory(OpenEnvFactory(target, list_tools(target)), target.label, "openenv 'guess'",
                                     bounds)


def test_the_servers_tool_is_offered_to_the_policy_as_the_http_games_is(game_urls):
    """The model was taught the HTTP game's `guess`: the tool listed from the OpenEnv server renders the same."""
    (tool,) = list_tools(OpenEnvTarget("guess", game_urls[0], 10.0))
    assert tool.name == "guess"
    environment = guarded(game_urls[0])()
    assert type(environment).__name__ == "GuessOpenEnv"
    assert get_json_schema(environment.guess) == get_json_schema(GuessEnvironment("http://x").guess)


def test_an_episode_scores_the_last_reward_the_environment_reported(game_urls):
    environment = guarded(game_urls[0])()
    environment.reset(target=3, prompt=[{"role": "user", "content": "guess the number for apple"}])
    assert environment.guess(number=2) == "wrong" and environment.guess(number=3) == "right"
    assert environment.get_reward() == 1.0 and episode_of(environment).failure is None
    environment.reset(target=3)  # the pool's instance, reused: a new session
    assert environment.guess(number=1) == "wrong" and environment.get_reward() == WRONG_GUESS_REWARD
    environment.reset(target=3)
    assert environment.get_reward() == 0.0  # no guess: the reset's reward


def sessions_closed() -> None:
    """Wait for the sessions' closes the learner left running in the background."""
    async def idle() -> None:
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if running:
            await asyncio.wait(running, timeout=20)

    asyncio.run_coroutine_threadsafe(idle(), openenv_play._event_loop()).result(30)


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_episode_ends_its_session_as_the_server_expects_with_no_error_on_its_side(game_urls):
    """The server closes the session's connection: a client that closes first races it, and the server logs each
    lost race as an exception ("Exception in ASGI application")."""
    errors = Errors()
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(errors)
    try:
        environment = guarded(game_urls[0])()
        for _ in range(3):
            environment.reset(target=3)
            environment.guess(number=3)
            assert environment.get_reward() == 1.0
        sessions_closed()
    finally:
        server_log.removeHandler(errors)
    assert errors.messages == []


def test_each_episode_is_a_session_on_the_server_with_the_fewest_in_flight(game_urls):
    address = ENVIRONMENT_URL_SEPARATOR.join(game_urls)
    factory = guarded(address)
    first, second = factory(), factory()
    first.reset(target=1)
    second.reset(target=2)
    pool = pool_for(address)
    assert pool.in_flight() == {url: 1 for url in game_urls}  # one episode on each server
    # Each episode's calls reach the session its reset opened (the other server never saw its target).
    assert first.guess(number=1) == "right" and second.guess(number=2) == "right"
    assert first.get_reward() == second.get_reward() == 1.0
    assert pool.in_flight() == {url: 0 for url in game_urls}


def test_a_bad_argument_is_the_policys_mistake_shown_to_it_and_the_episode_still_scores(game_urls):
    environment = guarded(game_urls[0])()
    environment.reset(target=3)
    with pytest.raises(ToolCallRejected, match="number"):
        environment.guess(number="three")
    assert episode_of(environment).failure is None and environment.get_reward() == 0.0


class SilentServer:
    """Accepts connections and never answers (a hung environment server)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.held:
            connection.close()


def test_a_server_that_is_down_or_hung_fails_the_episode_as_the_environments():
    down = f"http://127.0.0.1:{free_port()}"
    bounds = CallBounds(call_timeout_s=1.0, episode_timeout_s=10.0)
    tools = (ToolSpec("guess", "Guess the number.", json.dumps({"properties": {"number": {"type": "integer"}}})),)
    factory = GuardedEnvironmentFactory(OpenEnvFactory(OpenEnvTarget("guess", down, 1.0), tools), "guess", "x",
                                        bounds)
    environment = factory()
    assert environment.reset(target=3) is None
    assert "reset raised EnvironmentFailure" in episode_of(environment).failure
    assert environment.get_reward() is None  # unscorable

    silent = SilentServer()
    try:
        hung = GuardedEnvironmentFactory(OpenEnvFactory(OpenEnvTarget("guess", silent.url, 1.0), tools), "guess", "x",
                                         bounds)()
        started = time.monotonic()
        hung.reset(target=3)
        assert time.monotonic() - started < 5
        assert "did not return within 1 s" in episode_of(hung).failure or "no answer within" in episode_of(
            hung).failure
        assert hung.get_reward() is None
    finally:
        silent.close()


@pytest.mark.parametrize("error_type, raised", [
    (ToolErrorType.EXECUTION_ERROR, ToolCallRejected), (ToolErrorType.INVALID_ARGS, ToolCallRejected),
    (ToolErrorType.TOOL_NOT_FOUND, ToolCallRejected), (ToolErrorType.TIMEOUT, EnvironmentFailure),
    (ToolErrorType.TRANSPORT_ERROR, EnvironmentFailure),
])
def test_a_tool_error_is_the_policys_unless_the_server_could_not_run_the_tool(monkeypatch, error_type, raised):
    answer = StepResult(observation=CallToolObservation(
        tool_name="guess", error=McpToolError(error_type=error_type, message="no")), reward=None)
    monkeypatch.setattr(openenv_play, "_exchange", lambda where, timeout_s, make: answer)
    environment = environment_class(OpenEnvTarget("guess", "http://127.0.0.1:1", 1.0), ())()
    environment._client = object()  # a session is open: the exchange is the stand-in above
    with pytest.raises(raised, match="no"):
        environment._call_tool("guess", {"number": 1})


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1.0", True])
def test_a_reported_reward_that_is_no_finite_number_is_the_environments_failure(monkeypatch, reward):
    answer = StepResult(observation=CallToolObservation(tool_name="guess", result={"data": "right"}), reward=reward)
    monkeypatch.setattr(openenv_play, "_exchange", lambda where, timeout_s, make: answer)
    environment = environment_class(OpenEnvTarget("guess", "http://127.0.0.1:1", 1.0), ())()
    environment._client = object()
    with pytest.raises(EnvironmentFailure, match="not a finite number"):
        environment._call_tool("guess", {"number": 1})


def schema_of(properties: dict, required: list[str]) -> dict:
    tool = ToolSpec("pick", "Pick one.", json.dumps({"type": "object", "properties": properties,
                                                       "required": required}))
    environment = environment_class(OpenEnvTarget("menu", "http://127.0.0.1:1", 1.0), (tool,))()
    return get_json_schema(environment.pick)["function"]["parameters"]


def test_tool_arguments_keep_their_json_types_enums_and_descriptions():
    parameters = schema_of({"kind": {"type": "string", "enum": ["a", "b"], "description": "Which one."},
                            "count": {"type": "integer"}, "weights": {"type": "array", "items": {"type": "number"}},
                            "note": {"type": ["string", "null"]}}, ["kind"])
    assert parameters["required"] == ["kind"]
    assert parameters["properties"]["kind"] == {"type": "string", "enum": ["a", "b"], "description": "Which one."}
    assert parameters["properties"]["count"]["type"] == "integer"
    assert parameters["properties"]["weights"] == {"type": "array", "items": {"type": "number"},
                                                   "description": "weights"}
    assert parameters["properties"]["note"] == {"type": "string", "nullable": True, "description": "note"}


@pytest.mark.parametrize("name, arguments, message", [
    ("reset", {}, "cannot be"), ("get_reward", {}, "cannot be"), ("_hidden", {}, "cannot be"),
    ("two words", {}, "cannot be"), ("go", {"class": {"type": "string"}}, "argument 'class'"),
])
def test_a_tool_trl_cannot_offer_is_refused_naming_the_environment_and_the_tool(name, arguments, message):
    tool = ToolSpec(name, "", json.dumps({"properties": arguments}))
    with pytest.raises(ToolError, match=message) as refused:
        OpenEnvFactory(OpenEnvTarget("maze-1", "http://127.0.0.1:1", 1.0), (tool,))
    assert str(refused.value).startswith(f"environment 'maze-1': tool {name!r}")


def test_the_learner_waits_for_a_server_to_list_the_tools_then_names_the_environment():
    now = [0.0]
    target = OpenEnvTarget("guess", f"http://127.0.0.1:{free_port()}", 1.0)
    with pytest.raises(EnvironmentFailure) as never:
        wait_for_tools(target, wait_s=5.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert str(never.value).startswith(f"environment 'guess' ({target.address}): no server listed its tools "
                                       "within 5 s: listing its tools on ")
    assert now[0] >= 5.0


def run_config(environments: dict[str, str], protocols: dict[str, str], training: dict | None = None) -> RunConfig:
    return RunConfig.model_validate({"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "constant"}],
                                     "training": training or {}, "environments": environments,
                                     "environmentProtocols": protocols})


def test_an_openenv_environment_alone_plays_every_row_and_beside_others_the_rows_name_it(game_urls):
    config = run_config({"guess": game_urls[0]}, {"guess": "openenv"})
    alone = with_openenv_environments(None, config, BOUNDS)
    assert isinstance(alone, GuardedEnvironmentFactory) and alone.label == "guess"
    user = {"maze": object()}
    config = run_config({"guess": game_urls[0], "maze": "http://127.0.0.1:1"}, {"guess": "openenv"},
                        {"environmentFactories": {"maze": "mod:make"}})
    beside = with_openenv_environments(user, config, BOUNDS)
    assert list(beside) == ["maze", "guess"] and beside["maze"] is user["maze"]


@pytest.mark.parametrize("training, protocols, message", [
    ({"environmentFactory": "mod:make"}, {"guess": "openenv"}, "training.environmentFactory \\(every row"),
    ({"environmentFactories": {"guess": "mod:make"}}, {"guess": "openenv"}, "also a key of"),
    ({}, {"maze": "openenv"}, "environmentProtocols names maze"),
    ({}, {"guess": "grpc"}, "environmentProtocols.guess"),
])
def test_the_run_config_refuses_protocols_no_row_can_reach(training, protocols, message):
    with pytest.raises(ValidationError, match=message):
        run_config({"guess": "http://127.0.0.1:1"}, protocols, training)
