"""Tools and environments: `training.tools` and `training.environmentFactory`, loaded as rewards are.

A tool is a module-level function: TRL's rollout worker runs in a spawned child, pickles what it is given, and
registers a tool under its `__name__`; the function's signature and docstring are the schema the chat template
shows the policy. An environment factory is a module-level callable returning one environment: an object with
`reset(**row)` (its return, when not None, is appended to the prompt's last message), public methods the policy may
call as tools, and optionally `get_reward()` (the episode's reward, one more reward column). TRL keeps a pool of
instances and resets one per episode.

Environments are often servers of their own, and a server that is down or hung must not end the run, hold it, nor
vanish from the count. Every environment this module makes is guarded:
- an exception from `reset` or `get_reward`, or a reward that is None, NaN or infinite, fails the episode;
- a tool method fails the episode when the environment failed the call: an `EnvironmentFailure` from the transport
  (grpo_trainer.agentic.transport: no connection, a timeout, a 5xx, an answer that is not JSON). A tool method's
  other errors (a 4xx the server answered, bad arguments) are the policy's: TRL returns them to the policy as the
  tool's result and counts a tool failure;
- every call is bounded (`CallBounds`): by `training.callTimeoutSeconds`, and by the episode's deadline
  (`training.episodeTimeoutSeconds` after its reset). A call past its deadline is abandoned: TRL's tool thread is
  free at once, the episode fails naming the environment and the call, and the instance is not used again
  (grpo_trainer.rollout.worker drops it from TRL's pool; the call's own thread ends when the call does, which a
  request through the transport does at the deadline).
A failed episode still runs (its rows keep the group's accounting whole), and the rollout loop makes it unscorable
and counts it by environment.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..contract.config import TrainingConfig
from ..learner.rewards import UserCodeError, import_function
from ..rollout.sync_watchdog import DaemonCall
from .availability import NO_ENVIRONMENTS, AvailabilityGate
from .servers import EpisodePins, episode_scope
from .transport import DeadlinePassed, EnvironmentFailure, call_deadline

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class CallBounds:
    """How long an environment's calls may take (training.callTimeoutSeconds, training.episodeTimeoutSeconds)."""

    call_timeout_s: float
    episode_timeout_s: float

    @classmethod
    def of(cls, training: TrainingConfig) -> CallBounds:
        return cls(float(training.call_timeout_seconds), float(training.episode_timeout_seconds))


class EpisodeRecord:
    """One episode of one environment: which environment, its deadline, why it failed (None: it did not), and the
    servers its calls go to (`pins`: the one each environment address gave its first call, until `end`)."""

    __slots__ = ("deadline", "environment", "failure", "pins")

    def __init__(self, environment: str, deadline: float):
        self.environment = environment
        self.deadline = deadline  # time.monotonic()
        self.failure: str | None = None
        self.pins = EpisodePins()

    def end(self) -> None:
        """The episode made its last call: its servers count it in flight no more."""
        self.pins.release()

    def fail(self, what: str, error: BaseException) -> None:
        self.fail_because(f"{what} raised {type(error).__name__}: {error}")

    def fail_because(self, failure: str) -> None:
        if self.failure is None:  # the first failure is the cause; later ones follow from it
            self.failure = failure
            logger.warning("environment %r failed an episode (unscorable): %s", self.environment, failure)


#: The attribute a guarded environment keeps its current episode's record in.
EPISODE_ATTRIBUTE = "_grpo_episode"
#: A guarded environment class's attribute: the environment it is (what its failures are counted under).
LABEL_ATTRIBUTE = "_grpo_environment"
#: How often a call still running asks whether its episode's server has gone (a deleted pod's connections hang until
#: the call's deadline: nothing answers, and nothing resets them).
LOST_SERVER_CHECK_S = 2.0
#: The attribute set on a guarded environment one of whose calls was abandoned still running: it is not reused.
ABANDONED_ATTRIBUTE = "_grpo_abandoned"


def episode_of(environment: Any) -> EpisodeRecord | None:
    return getattr(environment, EPISODE_ATTRIBUTE, None)


def failed_reward_environment(reward: tuple[type, Any] | None) -> str | None:
    """The environment whose episode failed, from TRL's record of one episode's environment reward (its class and
    what its get_reward returned): a guarded get_reward returns None exactly when the episode failed. None when the
    episode did not fail or its environment is not ours."""
    if reward is None or reward[1] is not None:
        return None
    return getattr(reward[0], LABEL_ATTRIBUTE, None)


def is_abandoned(environment: Any) -> bool:
    """Whether a call of this environment instance passed its deadline still running (the instance's state is then
    whatever that call leaves it in, whenever it ends)."""
    return bool(getattr(environment, ABANDONED_ATTRIBUTE, False))


def _is_environment_failure(error: BaseException) -> bool:
    """The transport's judgement, wherever the user's code wrapped it (raise ... from, or raised while handling)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, EnvironmentFailure):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _timeout(environment: Any, what: str, bounds: CallBounds) -> float:
    """Seconds `what` may take: the call's bound, or less when the episode's deadline comes first. Raises DeadlinePassed
    (failing the episode) when the episode's deadline has passed."""
    episode = episode_of(environment)
    timeout = min(bounds.call_timeout_s, episode.deadline - time.monotonic())
    if timeout <= 0:
        episode.fail_because(f"{what} was called after the episode's {bounds.episode_timeout_s:g} s deadline")
        raise DeadlinePassed(episode.failure)
    return timeout


def _past_deadline(environment: Any, what: str, timeout: float, bounds: CallBounds, *,
                   abandoned: bool) -> DeadlinePassed:
    """Fail the episode for `what`, which passed its deadline; `abandoned`: still running (the instance is not used
    again)."""
    episode = episode_of(environment)
    if abandoned:
        _abandon(environment)
    bound = (f"within {bounds.call_timeout_s:g} s (training.callTimeoutSeconds)" if timeout >= bounds.call_timeout_s
             else f"by the episode's deadline, {bounds.episode_timeout_s:g} s after its reset "
                  "(training.episodeTimeoutSeconds)")
    left = "; abandoned" if abandoned else ""
    episode.fail_because(f"{what} did not return {bound}{left}")
    return DeadlinePassed(episode.failure)


def _server_lost(environment: Any, what: str, lost: str) -> DeadlinePassed:
    """Fail the episode for `what`, still running on a server that has gone (the instance is not used again)."""
    _abandon(environment)
    episode = episode_of(environment)
    episode.fail_because(f"{what} was abandoned: {lost}")
    return DeadlinePassed(episode.failure)


def _abandon(environment: Any) -> None:
    """A call of `environment` left running: the instance is not used again, and its episode makes no other call."""
    setattr(environment, ABANDONED_ATTRIBUTE, True)
    episode_of(environment).end()


def _call_bounded(environment: Any, what: str, bounds: CallBounds, call: Callable[[], Any]) -> Any:
    """`call()` within its deadline, in a thread of its own: the caller (one of TRL's tool threads) is free at the
    deadline whether or not the call ends. Raises DeadlinePassed past it (the call's own request may see the
    deadline first: the transport bounds it by the same one)."""
    timeout = _timeout(environment, what, bounds)
    deadline = time.monotonic() + timeout
    pins = episode_of(environment).pins

    def within_deadline() -> Any:
        with call_deadline(deadline), episode_scope(pins):
            return call()

    running = DaemonCall(within_deadline, f"grpo-env-{what}")
    while not running.join(min(LOST_SERVER_CHECK_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise _past_deadline(environment, what, timeout, bounds, abandoned=True)
        if (lost := pins.lost()) is not None:
            raise _server_lost(environment, what, lost)
    try:
        return running.result()
    except DeadlinePassed as error:
        raise _past_deadline(environment, what, timeout, bounds, abandoned=False) from error


async def _await_bounded(environment: Any, what: str, bounds: CallBounds, call: Callable[[], Any]) -> Any:
    timeout = _timeout(environment, what, bounds)
    pins = episode_of(environment).pins

    async def pinned() -> Any:
        with episode_scope(pins):
            return await call()

    try:
        return await asyncio.wait_for(pinned(), timeout)
    except TimeoutError:
        raise _past_deadline(environment, what, timeout, bounds, abandoned=True) from None


def _guard_tool(method: Callable[..., Any], bounds: CallBounds) -> Callable[..., Any]:
    what = method.__name__
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def guarded_async(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await _await_bounded(self, what, bounds, lambda: method(self, *args, **kwargs))
            except Exception as error:
                if _is_environment_failure(error):
                    episode_of(self).fail(what, error)
                raise
        return guarded_async

    @functools.wraps(method)
    def guarded(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return _call_bounded(self, what, bounds, lambda: method(self, *args, **kwargs))
        except Exception as error:
            if _is_environment_failure(error):
                episode_of(self).fail(what, error)
            raise
    return guarded


def _checked_reward(episode: EpisodeRecord, reward: Any) -> float | None:
    """The reward when it is a finite number; else None, the episode failed (an environment that could not score its
    episode: summed beside other rewards, a NaN would vanish and the episode score as the others did)."""
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward):
        return float(reward)
    episode.fail_because(f"get_reward returned {reward!r}, not a finite number")
    return None


@functools.cache
def _guarded_class(cls: type, label: str, bounds: CallBounds, gate: AvailabilityGate) -> type:
    """`cls` with its reset, get_reward and tool methods guarded; same name, schema and tool set for TRL. A reset
    first waits at `gate` for the run's environments to have a ready server (grpo_trainer.agentic.availability)."""
    namespace: dict[str, Any] = {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                 LABEL_ATTRIBUTE: label}
    user_reset = cls.reset

    def reset(self, **kwargs: Any) -> Any:
        if (previous := episode_of(self)) is not None:
            previous.end()  # an environment without get_reward ends its episode here
        try:
            gate.wait()  # before the episode's deadline starts: a wait for a server is no episode's time
        except OSError as error:  # the rollout loop stopped while waiting: this episode is never played out
            gate_error: OSError | None = error
        else:
            gate_error = None
        episode = EpisodeRecord(label, time.monotonic() + bounds.episode_timeout_s)
        setattr(self, EPISODE_ATTRIBUTE, episode)
        if gate_error is not None:
            episode.fail("reset", gate_error)
            return None
        try:
            return _call_bounded(self, "reset", bounds, lambda: user_reset(self, **kwargs))
        except Exception as error:  # noqa: BLE001 - the environment failed: its episode is unscorable, the run goes on
            episode.fail("reset", error)
            return None

    namespace["reset"] = functools.wraps(user_reset)(reset)
    if callable(getattr(cls, "get_reward", None)):
        namespace["get_reward"] = _guard_get_reward(cls.get_reward, bounds)
    for name, member in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name not in ("reset", "get_reward") and not name.startswith("_"):
            namespace[name] = _guard_tool(member, bounds)
    return type(cls.__name__, (cls,), namespace)


def _guard_get_reward(user_get_reward: Callable[..., Any], bounds: CallBounds) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(user_get_reward):
        @functools.wraps(user_get_reward)
        async def get_reward_async(self) -> float | None:
            episode = episode_of(self)
            try:
                if episode.failure is not None:
                    return None
                return _checked_reward(episode, await _await_bounded(self, "get_reward", bounds,
                                                                     lambda: user_get_reward(self)))
            except Exception as error:  # noqa: BLE001 - the environment failed: its episode is unscorable
                episode.fail("get_reward", error)
                return None
            finally:
                episode.end()
        return get_reward_async

    @functools.wraps(user_get_reward)
    def get_reward(self) -> float | None:
        episode = episode_of(self)
        try:
            if episode.failure is not None:
                return None
            return _checked_reward(episode, _call_bounded(self, "get_reward", bounds, lambda: user_get_reward(self)))
        except Exception as error:  # noqa: BLE001 - the environment failed: its episode is unscorable
            episode.fail("get_reward", error)
            return None
        finally:
            episode.end()  # its last call
    return get_reward


class GuardedEnvironmentFactory:
    """The user's factory, returning guarded environments. Picklable (a module-level class) for TRL's child."""

    def __init__(self, factory: Callable[[], Any], label: str, spec: str, bounds: CallBounds,
                 gate: AvailabilityGate = NO_ENVIRONMENTS):
        self.factory = factory
        self.label = label
        self.spec = spec
        self.bounds = bounds
        self.gate = gate

    def __call__(self) -> Any:
        environment = self.factory()
        if not callable(getattr(environment, "reset", None)):
            raise ToolError(f"environment factory {self.spec!r} returned {type(environment).__name__}, which has no "
                            "reset method")
        environment.__class__ = _guarded_class(type(environment), self.label, self.bounds, self.gate)
        return environment


def load_environment_factory(
    value: str | dict[str, str] | None, bounds: CallBounds, gate: AvailabilityGate = NO_ENVIRONMENTS,
) -> GuardedEnvironmentFactory | dict[str, GuardedEnvironmentFactory] | None:
    """`training.environmentFactory` (one factory) or `training.environmentFactories` (one per value of the
    dataset's `environment` column) as TRL takes it, its calls within `bounds`, each episode started once `gate` lets
    it. Raises ToolError (one line) for one that does not import."""
    if value is None:
        return None
    if isinstance(value, str):
        factory = import_function(value, "environment factory", ToolError)
        return GuardedEnvironmentFactory(factory, value.rpartition(":")[2], value, bounds, gate)
    return {name: GuardedEnvironmentFactory(import_function(spec, f"environment factory {name!r}", ToolError),
                                            name, spec, bounds, gate)
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
