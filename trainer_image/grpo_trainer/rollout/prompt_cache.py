"""The worker child's rendering of a group's prompt, once per group instead of once per completion.

TRL's rollout loop renders each conversation through the chat template before its first turn
(`_AsyncRolloutLoop._generate_one`, trl/experimental/async_grpo/async_rollout_worker.py:917 (trl 1.16.0)), once per
completion: a group of `numGenerations` renders the same prompt that many times (0.12 ms each with the tiny model's
template). `CachedChatTemplate` stands in for the tokenizer's `apply_chat_template` in the child and answers a call
it has seen from a small cache: only for calls without tools (a tool conversation's later turns differ, and tool
callables have no stable key), with every argument in the key, each answer a fresh copy (TRL keeps the list). An
answer is used for `max_age_s` at most, so a template that prints the date is never more than that behind.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: Prompts kept: more than the groups a worker has in flight (TRL's `max_inflight_tasks` completions at a time).
CACHE_SIZE = 256
#: How long an answer is used: a group's completions start within it.
MAX_AGE_S = 60.0


class CachedChatTemplate:
    def __init__(self, render: Callable[..., Any], size: int = CACHE_SIZE, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.render = render
        self.size = size
        self.max_age_s = max_age_s
        self._clock = clock
        self._answers: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()
        self.hits = 0

    def __call__(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        key = self._key(conversation, args, kwargs)
        if key is None:
            return self.render(conversation, *args, **kwargs)
        now = self._clock()
        kept = self._answers.get(key)
        if kept is not None and now - kept[0] <= self.max_age_s:
            self.hits += 1
            self._answers.move_to_end(key)
            return list(kept[1])
        answer = self.render(conversation, *args, **kwargs)
        if not isinstance(answer, list) or not all(isinstance(token, int) for token in answer):
            return answer  # text or a dict (tokenize=False, return_dict=True): not what the loop's first turn asks
        self._answers[key] = (now, answer)
        self._answers.move_to_end(key)
        if len(self._answers) > self.size:
            self._answers.popitem(last=False)
        return list(answer)

    @staticmethod
    def _key(conversation: Any, args: tuple, kwargs: dict) -> str | None:
        if args or kwargs.get("tools"):
            return None
        try:
            return json.dumps([conversation, kwargs], sort_keys=True)
        except (TypeError, ValueError):
            return None  # something without a stable text form (an image, a callable): rendered every time
