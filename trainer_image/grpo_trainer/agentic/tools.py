"""Tools and environments: `training.tools` and `training.environmentFactory`, loaded as rewards are.

A tool is a module-level function: TRL's rollout worker runs in a spawned child, pickles what it is given, and
registers a tool under its `__name__`; the function's signature and docstring are the schema the chat template
shows the policy. An environment factory is a module-level callable returning one environment: an object with
`reset(**row)` (its return, when not None, is appended to the prompt's last message), public methods the policy may
call as tools, and optionally `get_reward()` (the episode's reward, one more reward column). TRL keeps a pool of
instances and resets one per episode.

Environments are often servers of their own, and a server that is down must not end the run nor vanish from the
count. Every environment this module makes is guarded: an exception from `reset` or `get_reward`, or an `OSError`
(connection refused, a timeout) from a tool method, marks the episode failed. The episode still runs (its rows keep
the group's accounting whole), and the rollout loop (grpo_trainer.rollout.worker) makes it unscorable and counts it
by environment. A tool method's other errors are the policy's (bad arguments): TRL returns them to the policy as
the tool's result and counts a tool failure.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..contract.config import TrainingConfig
from ..learner.rewards import UserCodeError, import_function


class ToolError(UserCodeError):
    """A tool or environment factory named in the config cannot be loaded. One line naming it."""


def load_tools(specs: Sequence[str]) -> list[Callable[..., Any]]:
    """The functions `training.tools` names. Raises ToolError (one line) for one that does not import."""
    tools = []
    for spec in specs:
        tool = import_function(spec, "tool", ToolError)
        if not inspect.isfunction(tool):
            raise ToolError(f"tool {spec!r}: must be a function (TRL registers a tool under its __name__)")
        tools.append(tool)
    return tools


class EpisodeRecord:
    """One episode of one environment: which environment, and why it failed (None: it did not)."""

    __slots__ = ("environment", "failure")

    def __init__(self, environment: str):
        self.environment = environment
        self.failure: str | None = None

    def fail(self, what: str, error: BaseException) -> None:
        if self.failure is None:  # the first failure is the cause; later ones follow from it
            self.failure = f"{what} raised {type(error).__name__}: {error}"


#: The attribute a guarded environment keeps its current episode's record in.
EPISODE_ATTRIBUTE = "_grpo_episode"


def episode_of(environment: Any) -> EpisodeRecord | None:
    return getattr(environment, EPISODE_ATTRIBUTE, None)


def _guard_tool(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def guarded_async(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except OSError as error:
                episode_of(self).fail(method.__name__, error)
                raise
        return guarded_async

    @functools.wraps(method)
    def guarded(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as error:
            episode_of(self).fail(method.__name__, error)
            raise
    return guarded


@functools.cache
def _guarded_class(cls: type, label: str) -> type:
    """`cls` with its reset, get_reward and tool methods guarded; same name, schema and tool set for TRL."""
    namespace: dict[str, Any] = {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    user_reset = cls.reset

    def reset(self, **kwargs: Any) -> Any:
        episode = EpisodeRecord(label)
        setattr(self, EPISODE_ATTRIBUTE, episode)
        try:
            return user_reset(self, **kwargs)
        except Exception as error:  # noqa: BLE001 - the environment failed: its episode is unscorable, the run goes on
            episode.fail("reset", error)
            return None

    namespace["reset"] = functools.wraps(user_reset)(reset)
    if callable(getattr(cls, "get_reward", None)):
        user_get_reward = cls.get_reward

        def get_reward(self) -> float | None:
            episode = episode_of(self)
            if episode is not None and episode.failure is not None:
                return None
            try:
                return user_get_reward(self)
            except Exception as error:  # noqa: BLE001 - the environment failed: its episode is unscorable
                if episode is not None:
                    episode.fail("get_reward", error)
                return None

        namespace["get_reward"] = functools.wraps(user_get_reward)(get_reward)
    for name, member in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name not in ("reset", "get_reward") and not name.startswith("_"):
            namespace[name] = _guard_tool(member)
    return type(cls.__name__, (cls,), namespace)


class GuardedEnvironmentFactory:
    """The user's factory, returning guarded environments. Picklable (a module-level class) for TRL's child."""

    def __init__(self, factory: Callable[[], Any], label: str, spec: str):
        self.factory = factory
        self.label = label
        self.spec = spec

    def __call__(self) -> Any:
        environment = self.factory()
        if not callable(getattr(environment, "reset", None)):
            raise ToolError(f"environment factory {self.spec!r} returned {type(environment).__name__}, which has no "
                            "reset method")
        environment.__class__ = _guarded_class(type(environment), self.label)
        return environment


def load_environment_factory(
    value: str | dict[str, str] | None,
) -> GuardedEnvironmentFactory | dict[str, GuardedEnvironmentFactory] | None:
    """`training.environmentFactory` (one factory) or `training.environmentFactories` (one per value of the
    dataset's `environment` column) as TRL takes it. Raises ToolError (one line) for one that does not import."""
    if value is None:
        return None
    if isinstance(value, str):
        factory = import_function(value, "environment factory", ToolError)
        return GuardedEnvironmentFactory(factory, value.rpartition(":")[2], value)
    return {name: GuardedEnvironmentFactory(import_function(spec, f"environment factory {name!r}", ToolError),
                                            name, spec)
            for name, spec in value.items()}


def environment_factories(training: TrainingConfig) -> str | dict[str, str] | None:
    """The config's environment factory, or its factories by name (the spec allows one of the two)."""
    return training.environment_factory or training.environment_factories


def check_tool_chat_template(tokenizer: Any, model: str) -> None:
    """Raise ToolError (one line) when TRL's worker could not play a tool-using conversation with `model`'s chat
    template: it parses each turn's tool calls with a response schema it knows per template, and renders the
    conversation with a prefix-preserving template (the model's own, or TRL's training variant of it). Checked before
    the worker starts: its child would otherwise die at start, and the learner be restarted for a mistake that stays."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
    )

    if not getattr(tokenizer, "chat_template", None):
        raise ToolError(f"model {model!r}: its tokenizer has no chat template, and tools need one")
    try:
        if not any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema")):
            add_response_schema(copy.copy(tokenizer))  # the worker's own call, on a copy it may annotate
        if not is_chat_template_prefix_preserving(tokenizer):
            get_training_chat_template(tokenizer)
    except ValueError as error:
        raise ToolError(f"model {model!r}: TRL cannot run tool calls with its chat template: "
                        f"{str(error).splitlines()[0]}") from None
