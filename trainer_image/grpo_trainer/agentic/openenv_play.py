"""Environments that speak OpenEnv (spec.environments[].protocol: openenv): the learner plays them itself, with
OpenEnv's client, and the user writes no environment factory.

An OpenEnv server (openenv-core's `create_app`) gives each WebSocket connection an environment of its own: a session.
The learner opens one session per episode on the server the episode is pinned to (grpo_trainer.agentic.servers: the
one with the fewest episodes in flight when the episode resets), so every call of the episode reaches the environment
its reset made. An episode is:
- `reset(**row)`: a new session, reset with the dataset row's columns (the server passes on those its environment's
  `reset` takes). The reset's observation is not shown to the policy: the row's prompt is the task;
- each tool call: one MCP `call_tool` step of the session (OpenEnv's CallToolAction);
- `get_reward()`: the last reward the environment reported (a step's observation, else the reset's), as OpenEnv's own
  harness scores an episode; then the session closes. An environment that reported none leaves the episode
  unscorable.

Tools: the environment's own MCP tools, listed once when the learner starts (`list_tools`, a `list_tools` step of a
session of its own), each a method of a class made for the environment: the tool's name, its description as the
docstring, its JSON-schema arguments as the signature's types and text as what it returns (TRL shows the policy a
tool's result as text), which is how TRL renders a tool for the model (TRL's OpenEnv harness hands the model the same
name, description and argument schema).

Failures are judged as the HTTP transport judges them (grpo_trainer.agentic.transport): no connection, no answer
within the call's bound, a session the server refused or closed, an error message of OpenEnv's protocol, an answer
that is not OpenEnv's: EnvironmentFailure, and the episode is unscorable. A tool call the environment answers with a
tool error (an unknown tool, invalid arguments, the tool raised: MCP reports those to the model) is the policy's
mistake: ToolCallRejected, shown to it; a tool that timed out inside the server, or that the server could not reach,
is the environment's. Every call of the environment is guarded as a user's environment's is (grpo_trainer.agentic.
tools: its deadline, its failures counted against the environment), each exchange is bounded by that deadline
(transport.seconds_left), and a failed exchange ends the session.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import keyword
import logging
import math
import threading
import time
import typing
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from openenv.core.client_types import StepResult
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    ToolErrorType,
)
from openenv.core.mcp_client import MCPToolClient

from ..contract.config import RunConfig
from .servers import EpisodePins, NoServer, check_address, current_pins, pool_for
from .tools import CallBounds, GuardedEnvironmentFactory, ToolError
from .transport import REJECTION_CHARS, DeadlinePassed, EnvironmentFailure, ToolCallRejected, seconds_left

logger = logging.getLogger(__name__)

#: How long the learner waits at start for a server of an OpenEnv environment to list its tools: its pods may still
#: be pulling their image or starting.
TOOL_LISTING_WAIT_S = 600.0
#: Seconds between tries to list the tools of an environment that has no server answering yet.
TOOL_LISTING_RETRY_S = 2.0
#: How long closing a session may take (in the background: no call of the learner waits on it).
CLOSE_TIMEOUT_S = 10.0
#: Tool errors that are the environment's, not the policy's: the server's tool timed out, or it could not reach it.
ENVIRONMENT_TOOL_ERRORS = frozenset({ToolErrorType.TIMEOUT, ToolErrorType.TRANSPORT_ERROR})
#: Method names a tool cannot take: TRL calls them itself.
RESERVED_METHODS = frozenset({"reset", "get_reward"})


@dataclass(frozen=True)
class OpenEnvTarget:
    """An OpenEnv environment of the run: its name (spec.environments[].name), its address (the run config's URL,
    which may name several servers) and the bound of one exchange when no call's deadline is shorter."""

    name: str
    address: str
    timeout_s: float

    @property
    def label(self) -> str:
        """What its episodes' failures are counted under (a reported name: '-' as '_')."""
        return self.name.replace("-", "_")

    @property
    def class_name(self) -> str:
        """Its environment class's name, which is also its reward's name in TRL's logs (`rewards/<name>`)."""
        return "".join(part.capitalize() for part in self.name.split("-")) + "OpenEnv"


@dataclass(frozen=True)
class ToolSpec:
    """One tool an OpenEnv environment declared: its MCP name, description and input JSON schema (as JSON text, so
    the spec is hashable)."""

    name: str
    description: str
    input_schema: str


# ---------------------------------------------------------------------------------------------------------------------
# The sessions' event loop
# ---------------------------------------------------------------------------------------------------------------------
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for every OpenEnv session: OpenEnv's client is asynchronous and a WebSocket belongs to the
    loop that opened it; TRL calls an environment from threads of its own."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="grpo-openenv-sessions", daemon=True).start()
        return _loop


def _exchange(where: str, timeout_s: float, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine `make()` makes on the sessions' loop within `timeout_s` and the running call's deadline;
    its answer. Any failure of the exchange is the environment's (EnvironmentFailure; DeadlinePassed when the call's
    deadline ended it): what the learner sends is OpenEnv's protocol, so an error answer is the server's."""
    timeout, by_deadline = seconds_left(timeout_s)
    if timeout <= 0:
        raise DeadlinePassed(f"{where}: the call's deadline had passed")
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make(), timeout), _event_loop())
    try:
        return future.result(timeout + CLOSE_TIMEOUT_S)  # wait_for ends it at `timeout`; this only guards the loop
    except TimeoutError:
        future.cancel()
        raise (DeadlinePassed if by_deadline else EnvironmentFailure)(
            f"{where}: no answer within {timeout:.3g} s") from None
    except Exception as error:  # noqa: BLE001 - a refused or broken exchange, whatever the client raised
        raise EnvironmentFailure(f"{where}: {type(error).__name__}: {str(error)[:REJECTION_CHARS]}") from None


def _close_in_background(client: MCPToolClient) -> None:
    """End the session: ask the server to close it (OpenEnv's `close` message) and let the server close the
    connection. The client's own `close` closes it at once after the message, which races the server's close of the
    same connection, and openenv-core 0.3.0's server logs each lost race as an error."""
    async def close() -> None:
        try:
            connection = client._ws  # the open WebSocket, which the client does not expose
            if connection is not None:
                await connection.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(connection.wait_closed(), CLOSE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the session is given up either way
            logger.debug("closing an OpenEnv session: %s: %s", type(error).__name__, error)
        try:
            await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)  # the client's own resources
        except Exception as error:  # noqa: BLE001
            logger.debug("closing an OpenEnv client: %s: %s", type(error).__name__, error)

    asyncio.run_coroutine_threadsafe(close(), _event_loop())


def _reward_of(result: StepResult[Any], where: str) -> float | None:
    """The reward an answer reported: None for none; a wrong type or a non-finite number is the environment's
    failure."""
    reward = result.reward
    if reward is None:
        return None
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise EnvironmentFailure(f"{where}: reported reward {reward!r}, not a finite number")
    return float(reward)


def _tool_result(result: Any) -> Any:
    """What the policy is shown of a tool's result: its data (FastMCP's CallToolResult), else its text content."""
    if isinstance(result, dict):
        if "data" in result:
            return result["data"]
        content = result.get("content")
        if isinstance(content, list):
            return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The environment TRL plays
# ---------------------------------------------------------------------------------------------------------------------
class OpenEnvEnvironment:
    """One instance of TRL's pool of an OpenEnv environment: each episode a session of its own. Its tools are the
    methods `environment_class` adds; it has no other public method (TRL offers every public method as a tool)."""

    _target: typing.ClassVar[OpenEnvTarget]

    def __init__(self) -> None:
        self._client: MCPToolClient | None = None
        self._own_pins: EpisodePins | None = None
        self._server = ""
        self._reward: float | None = None

    def reset(self, **row: Any) -> None:
        """Open the episode's session on its server and reset it with the row's columns."""
        self._end_session()
        self._reward = None
        pins = current_pins()
        if pins is None:  # outside a guarded call: the instance holds its server until the episode ends
            pins = self._own_pins = EpisodePins()
        try:
            server = pins.server(pool_for(self._target.address))
        except NoServer as error:
            raise EnvironmentFailure(f"reset: {error}") from None
        self._server = server.url
        client = self._client = MCPToolClient(base_url=server.url, connect_timeout_s=self._target.timeout_s,
                                              message_timeout_s=self._target.timeout_s)
        where = f"reset on {server.url}"
        self._reward = _reward_of(self._send(where, lambda: client.reset(**row)), where)
        return None  # the row's prompt is the task

    def get_reward(self) -> float:
        """The last reward the environment reported in the episode; the episode's session ends."""
        try:
            if self._reward is None:
                raise EnvironmentFailure(f"environment {self._target.name!r} on {self._server or 'no server'} "
                                         "reported no reward for the episode")
            return self._reward
        finally:
            self._end_session()

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        client = self._client
        where = f"tool {name} on {self._server}"
        if client is None:
            raise EnvironmentFailure(f"{where}: the episode has no session (its reset failed)")
        result = self._send(where, lambda: client.step(CallToolAction(tool_name=name, arguments=arguments)))
        if (reward := _reward_of(result, where)) is not None:
            self._reward = reward
        observation = result.observation
        if not isinstance(observation, CallToolObservation):
            raise EnvironmentFailure(f"{where}: the answer is no tool result")
        if observation.error is not None:
            problem = f"{observation.error.error_type.value}: {observation.error.message}"[:REJECTION_CHARS]
            if observation.error.error_type in ENVIRONMENT_TOOL_ERRORS:
                raise EnvironmentFailure(f"{where}: {problem}")
            raise ToolCallRejected(problem)
        return _tool_result(observation.result)

    def _send(self, where: str, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        try:
            return _exchange(where, self._target.timeout_s, make)
        except EnvironmentFailure:
            self._end_session()  # the server's environment is in whatever state the failed exchange left it
            raise

    def _end_session(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_in_background(client)
        pins, self._own_pins = self._own_pins, None
        if pins is not None:
            pins.release()


_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
                               "object": dict, "null": type(None)}


def _python_type(schema: Any) -> Any:
    """A JSON schema's type as the Python type hint TRL (transformers' get_json_schema) turns back into it; Any for
    what has none."""
    if not isinstance(schema, dict):
        return Any
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, (str, int, float, bool)) for v in values):
        return Literal[tuple(values)]
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [_JSON_TYPES[k] for k in kind if k in _JSON_TYPES]
        return typing.Union[tuple(kinds)] if kinds else Any  # noqa: UP007 - built from a list
    if kind == "array" and isinstance(schema.get("items"), dict):
        return list[_python_type(schema["items"])]
    if kind in _JSON_TYPES:
        return _JSON_TYPES[kind]
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        return typing.Union[tuple(_python_type(option) for option in options)]  # noqa: UP007
    return Any


def _one_line(text: Any) -> str:
    return " ".join(str(text or "").split())


def _tool_method(environment: str, tool: ToolSpec) -> Callable[..., Any]:
    """The method TRL offers the policy as `tool`: its signature and docstring say the tool's arguments."""
    where = f"environment {environment!r}: tool {tool.name!r}"
    if not tool.name.isidentifier() or keyword.iskeyword(tool.name) or tool.name.startswith("_") \
            or tool.name in RESERVED_METHODS:
        raise ToolError(f"{where}: TRL offers a tool as a method of that name, and this one cannot be (a Python "
                        f"identifier, not starting with '_', not {' or '.join(sorted(RESERVED_METHODS))})")
    schema = json.loads(tool.input_schema)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    described = []
    for argument, argument_schema in (properties or {}).items():
        if not argument.isidentifier() or keyword.iskeyword(argument) or argument == "self":
            raise ToolError(f"{where}: argument {argument!r} is not a name TRL can pass (a Python identifier)")
        annotations[argument] = _python_type(argument_schema)
        default = inspect.Parameter.empty
        if argument not in required:
            default = argument_schema.get("default") if isinstance(argument_schema, dict) else None
        parameters.append(inspect.Parameter(argument, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotations[argument]))
        description = argument_schema.get("description") if isinstance(argument_schema, dict) else None
        described.append(f"    {argument}: {_one_line(description) or argument}")
    name = tool.name

    def call(self: OpenEnvEnvironment, **arguments: Any) -> Any:
        return self._call_tool(name, arguments)

    call.__name__ = call.__qualname__ = name
    # The result is shown to the policy as text (TRL's tool message), whatever the tool's own output schema.
    call.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    call.__annotations__ = {**annotations, "return": str}
    summary = _one_line(tool.description) or f"The environment's {name} tool."
    call.__doc__ = summary + ("\n\nArgs:\n" + "\n".join(described) if described else "")
    return call


@functools.cache
def environment_class(target: OpenEnvTarget, tools: tuple[ToolSpec, ...]) -> type[OpenEnvEnvironment]:
    """The environment class of `target`, with a method per tool. Raises ToolError for a tool TRL cannot offer."""
    namespace: dict[str, Any] = {"_target": target, "__module__": __name__}
    for tool in tools:
        namespace[tool.name] = _tool_method(target.name, tool)
    return type(target.class_name, (OpenEnvEnvironment,), namespace)


class OpenEnvFactory:
    """TRL's environment factory of an OpenEnv environment, whose tools were listed when the learner started.
    Picklable (a module-level class of plain values) for TRL's child."""

    def __init__(self, target: OpenEnvTarget, tools: tuple[ToolSpec, ...]):
        self.target = target
        self.tools = tools
        environment_class(target, tools)  # a tool TRL cannot offer is refused here, at start

    def __call__(self) -> OpenEnvEnvironment:
        return environment_class(self.target, self.tools)()


# ---------------------------------------------------------------------------------------------------------------------
# Listing an environment's tools
# ---------------------------------------------------------------------------------------------------------------------
def list_tools(target: OpenEnvTarget) -> tuple[ToolSpec, ...]:
    """The tools `target`'s servers declare, asked of one of them in a session of its own. Raises
    EnvironmentFailure naming the environment."""
    pins = EpisodePins()
    client: MCPToolClient | None = None
    try:
        try:
            server = pins.server(pool_for(target.address))
        except NoServer as error:
            raise EnvironmentFailure(f"listing its tools: {error}") from None
        client = MCPToolClient(base_url=server.url, connect_timeout_s=target.timeout_s,
                               message_timeout_s=target.timeout_s)
        where = f"listing its tools on {server.url}"
        result = _exchange(where, target.timeout_s, lambda: client.step(ListToolsAction()))
        observation = result.observation
        if not isinstance(observation, ListToolsObservation):
            raise EnvironmentFailure(f"{where}: the answer lists no tools (is the server an MCP environment?)")
        if error := (observation.metadata or {}).get("error"):
            raise EnvironmentFailure(f"{where}: {str(error)[:REJECTION_CHARS]}")
        return tuple(ToolSpec(tool.name, tool.description or "", json.dumps(tool.input_schema or {}, sort_keys=True))
                     for tool in observation.tools)
    finally:
        if client is not None:
            _close_in_background(client)
        pins.release()


def wait_for_tools(target: OpenEnvTarget, *, wait_s: float = TOOL_LISTING_WAIT_S,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> tuple[ToolSpec, ...]:
    """`list_tools`, tried again while no server answers, for up to `wait_s`. Raises EnvironmentFailure with the
    last try's problem."""
    deadline = clock() + wait_s
    while True:
        try:
            tools = list_tools(target)
        except EnvironmentFailure as error:
            if clock() >= deadline:
                raise EnvironmentFailure(f"environment {target.name!r} ({target.address}): no server listed its "
                                         f"tools within {wait_s:g} s: {error}") from None
            logger.info("environment %r: waiting for a server to list its tools (%s)", target.name, error)
            sleep(TOOL_LISTING_RETRY_S)
            continue
        if not tools:
            logger.warning("environment %r declares no tools: its episodes are the model's answer alone",
                           target.name)
        logger.info("environment %r (openenv): tools %s", target.name, ", ".join(t.name for t in tools) or "none")
        return tools


def with_openenv_environments(
    factories: GuardedEnvironmentFactory | dict[str, GuardedEnvironmentFactory] | None, config: RunConfig,
    bounds: CallBounds,
) -> GuardedEnvironmentFactory | dict[str, GuardedEnvironmentFactory] | None:
    """The run's environment factories as TRL takes them: the user's (`factories`, from the training config) and one
    per OpenEnv environment of the run, each guarded like the user's. One OpenEnv environment alone plays every row;
    beside others, the rows choose by the environment's name (the dataset's `environment` column; the run config's
    rules keep the names apart). Lists each OpenEnv environment's tools (waiting for its servers). Raises ToolError
    for a tool TRL cannot offer, EnvironmentFailure for an environment whose servers never listed their tools."""
    names = config.openenv_environments()
    if not names:
        return factories
    openenv: dict[str, GuardedEnvironmentFactory] = {}
    for name in names:
        address = config.environments[name]
        check_address(address)
        target = OpenEnvTarget(name, address, bounds.call_timeout_s)
        factory = OpenEnvFactory(target, wait_for_tools(target))
        openenv[name] = GuardedEnvironmentFactory(factory, target.label, f"openenv environment {name!r}", bounds)
    if factories is None and len(openenv) == 1:
        return next(iter(openenv.values()))
    return {**(factories or {}), **openenv}
