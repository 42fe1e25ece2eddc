"""Reward functions: built-ins by name, user rewards by `module:function`.

Every reward is a module-level function (or an instance of a module-level class): TRL's rollout worker runs in a
spawned child and pickles its reward functions, and lambdas or closures are refused there. A reward takes TRL's
keyword arguments (`completions`, `prompts`, `completion_ids`, plus the dataset's other columns) and returns one
float (or None: unscorable) per completion.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..contract.config import RewardConfig, UnknownRewardName, check_reward_name

RewardFunc = Callable[..., list[float | None]]


class UserCodeError(ValueError):
    """User code named in the config (a reward, a tool, an environment factory) cannot be loaded. The message is one
    line naming it."""


class RewardError(UserCodeError):
    """A reward named in the config cannot be loaded. The message is one line naming the reward."""


def completion_text(completion: Any) -> str:
    """The generated text of one completion: a plain string, or TRL's list of assistant messages.

    TRL's response parser splits a Qwen3-style `<think>` block into `reasoning_content`; it is generated text too,
    so it counts.
    """
    if isinstance(completion, str):
        return completion
    parts: list[str] = []
    for message in completion or []:
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
            for key in ("reasoning_content", "content"):
                value = message.get(key)
                if isinstance(value, str):
                    parts.append(value)
    return "".join(parts)


TARGET_LETTER = "a"


def letter_a_fraction(completions: Sequence[Any], **_: Any) -> list[float]:
    """Share of the completion's letters that are 'a' (0 for a completion without letters).

    The tiny example's reward: dense (a random policy already scores a spread of values, so groups carry signal from
    the first step) and reachable by a tiny random model, whose only lever is which tokens it emits.
    """
    scores = []
    for completion in completions:
        letters = [ch for ch in completion_text(completion).lower() if ch.isalpha()]
        scores.append(sum(ch == TARGET_LETTER for ch in letters) / len(letters) if letters else 0.0)
    return scores


def constant(completions: Sequence[Any], **_: Any) -> list[float]:
    """Always 1.0: no completion is better than another, so no group has signal (the stall example)."""
    return [1.0] * len(completions)


_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,.]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalise_number(text: str) -> str:
    return text.replace(",", "").rstrip(".").removesuffix(".0")


def accuracy(completions: Sequence[Any], answer: Sequence[str] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the last number in the completion equals the reference answer (GSM8K's `#### N` or a bare number).

    None (unscorable, not wrong) for rows whose reference has no number, so a malformed row does not pull the policy.
    """
    if answer is None:
        raise ValueError("the accuracy reward needs an 'answer' column in the dataset")
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        match = _GSM8K_ANSWER.search(str(reference)) or _NUMBER.search(str(reference))
        if match is None:
            scores.append(None)
            continue
        expected = _normalise_number(match.group(1) if match.re is _GSM8K_ANSWER else match.group(0))
        found = _NUMBER.findall(completion_text(completion))
        scores.append(1.0 if found and _normalise_number(found[-1]) == expected else 0.0)
    return scores


def unscored(completions: Sequence[Any], **_: Any) -> list[None]:
    """None for every completion: the worker's only reward when every configured reward is a reward model.

    TRL's worker needs at least one reward function; None leaves the worker's reward NaN, and the learner's
    reward models (grpo_trainer.learner.scoring) give the score.
    """
    return [None] * len(completions)


#: The functions of the built-in rewards, by the names the contract lists (BUILTIN_REWARD_NAMES).
BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "letter_a_fraction": letter_a_fraction,
    "constant": constant,
    "accuracy": accuracy,
}


class RewardFunctionError(RuntimeError):
    """A reward function raised while scoring. The message names the reward and its error."""


class RewardResultError(ValueError):
    """A reward function returned something other than one number (or None) per completion: the same code will
    return the same shape again, so it is the config's reward that is wrong, not the run."""


class CheckedReward:
    """`weight * reward(...)`, with the reward's result checked where it is called: TRL's worker child dies on a bad
    one ("could not convert string to float", a zip length mismatch) without naming the reward.

    Picklable (a module-level class) for TRL's spawned worker; named after the wrapped reward in TRL's metrics.
    """

    def __init__(self, func: RewardFunc, weight: float = 1.0, label: str | None = None):
        self.func = func
        self.weight = weight
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.label = label or self.__name__

    def __call__(self, **kwargs: Any) -> list[float | None]:
        try:
            scores = self.func(**kwargs)
            if inspect.isawaitable(scores):  # TRL awaits async rewards; this wrapper runs on a worker thread
                scores = asyncio.run(_awaited(scores))
        except Exception as error:  # any error of user code: named, with its own text
            raise RewardFunctionError(f"reward function {self.label!r} raised {type(error).__name__}: "
                                      f"{error}") from error
        expected = len(kwargs.get("completions") or ())
        return [None if score is None else self.weight * score
                for score in checked_scores(self.label, scores, expected)]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def checked_scores(label: str, scores: Any, expected: int) -> list[float | None]:
    """`scores` as floats (None kept), or RewardResultError naming the reward and what is wrong with the result."""
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) and not hasattr(scores, "tolist"):
        raise RewardResultError(f"reward function {label!r} returned {type(scores).__name__}, not a list with one "
                                "score per completion")
    scores = list(scores.tolist() if hasattr(scores, "tolist") else scores)
    if len(scores) != expected:
        raise RewardResultError(f"reward function {label!r} returned {len(scores)} scores for {expected} "
                                "completions: it must return one per completion")
    checked: list[float | None] = []
    for index, score in enumerate(scores):
        if score is not None and not isinstance(score, numbers.Real):
            raise RewardResultError(f"reward function {label!r} returned {score!r} ({type(score).__name__}) for "
                                    f"completion {index}: a score is a number, or None for unscorable")
        checked.append(None if score is None else float(score))
    return checked


def import_function(spec: str, what: str = "reward function",
                    error_class: type[UserCodeError] = RewardError) -> Callable[..., Any]:
    """The callable `spec` ('module:function') names, or `error_class` with one line naming `what` it is."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise error_class(f"{what} {spec!r}: cannot import module {module_name!r} ({error})") from None
    try:
        func = getattr(module, attribute)
    except AttributeError:
        raise error_class(f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(func):
        raise error_class(f"{what} {spec!r}: {attribute!r} is not callable")
    return func


def load_reward(config: RewardConfig) -> RewardFunc:
    """The callable for one configured reward, weighted and checked. Raises RewardError (one line)."""
    if config.name is not None:
        try:
            check_reward_name(config.name)
        except UnknownRewardName as error:
            raise RewardError(str(error)) from None
        func = BUILTIN_REWARDS[config.name]
    else:
        func = import_function(config.function)
    return CheckedReward(func, config.weight, label=config.name or config.function)


def load_rewards(configs: Sequence[RewardConfig]) -> list[RewardFunc]:
    """The worker's reward functions: every reward but the reward models (scored on the learner)."""
    funcs = [load_reward(config) for config in configs if not config.is_model]
    return funcs or [unscored]
