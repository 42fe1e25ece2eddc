"""A group's prompt rendered through the chat template once in the worker child, not once per completion."""

from __future__ import annotations

import threading

from grpo_trainer.rollout.prompt_cache import CachedChatTemplate

PROMPT = [{"role": "user", "content": "write a"}]


class Renders:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, conversation, tokenize=True, **kwargs):
        self.calls += 1
        text = "|".join(message["content"] for message in conversation)
        return [ord(c) for c in text] if tokenize else text


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_is_rendered_once_and_each_caller_gets_its_own_copy():
    render = Renders()
    cached = CachedChatTemplate(render)
    first = cached(PROMPT, return_dict=False, add_generation_prompt=True, tools=None, chat_template=None)
    first.append(0)  # TRL keeps the list it is given: a change to it is not the next caller's
    again = cached(PROMPT, return_dict=False, add_generation_prompt=True, tools=None, chat_template=None)
    assert again == first[:-1] and render.calls == 1 and cached.hits == 1
    cached(PROMPT, return_dict=False, add_generation_prompt=False, tools=None, chat_template=None)
    cached([{"role": "user", "content": "write b"}], return_dict=False, add_generation_prompt=True)
    assert render.calls == 3  # every argument is in the key


def test_calls_with_tools_text_answers_or_no_text_form_are_rendered_every_time():
    render = Renders()
    cached = CachedChatTemplate(render)
    for _ in range(2):
        cached(PROMPT, tools=[{"type": "function"}])
        assert cached(PROMPT, tokenize=False) == "write a"
        cached(PROMPT, chat_template_kwargs=threading.Lock())
    assert render.calls == 6 and cached.hits == 0


def test_an_answer_is_used_for_its_age_and_the_oldest_prompt_leaves_a_full_cache():
    render, clock = Renders(), Clock()
    cached = CachedChatTemplate(render, size=2, max_age_s=60.0, clock=clock)
    cached(PROMPT)
    clock.now = 60.0
    cached(PROMPT)
    clock.now = 60.5
    cached(PROMPT)  # rendered at 0, used until 60: rendered again then
    assert render.calls == 2
    cached([{"role": "user", "content": "b"}])
    cached([{"role": "user", "content": "c"}])  # the cache holds 2: the first prompt leaves
    cached(PROMPT)
    assert render.calls == 5
