"""The tiny tool model's chat template and taught rows against TRL's multi-turn reconciler: a conversation played as
taught (a guess and the closing turn, or the closing turn alone) is one training row whose trained tokens are exactly
the taught ones (the tool call included). With Qwen3's own template the re-render after the tool answer drops the
tool call's think block, the reconciler "realigns", and the tool call became untrained context: the agentic run's
reward could not rise."""

from __future__ import annotations

from collections import Counter

import pytest
from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

from grpo_trainer.testing.tiny_assets import (
    HIGHER_LOWER_FOLLOW_SHARE,
    _higher_lower_conversations,
    _higher_lower_schema,
    _tool_conversations,
    _tool_schema,
    build_tool_tokenizer,
    guess_prompts,
    tool_chat_template,
    tool_training_row,
)
from tests.support.paths import REPO

PROMPTS = REPO / "examples" / "tiny-guess.jsonl"
HIGHER_LOWER_PROMPTS = REPO / "examples" / "tiny-higher-lower.jsonl"


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = index
        elif not bit and start is not None:
            spans.append((start, index))
            start = None
    return spans


def _played_as_taught_is_one_row_training_every_taught_token(tokenizer, conversations: list[list[dict]], tools: list):
    for conversation in conversations:
        ids, mask = tool_training_row(tokenizer, conversation, tools)
        spans = _spans(mask)
        # Each assistant turn: each tool call and the closing turn, or the closing turn alone (no guess).
        histories = [conversation[:index] for index, message in enumerate(conversation)
                     if message["role"] == "assistant"]
        assert len(spans) == len(histories)
        turns = []
        for (start, end), history in zip(spans, histories, strict=True):
            # The worker renders the conversation so far with the generation prompt, and the policy generates
            # the taught span.
            prompt = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True,
                                                   return_dict=False, chat_template=tool_chat_template(tokenizer))
            assert prompt == ids[:start]
            turns.append(TurnRecord(prompt, ids[start:end], [0.0] * (end - start)))
        rows, tally = _chain_to_sequences(turns, "rollout", fork_threshold=1024)
        assert tally["realign"] == tally["fork"] == 0 and tally["clean"] == len(spans) - 1  # each later turn appends
        (row,) = rows
        assert row.input_ids == ids[:spans[-1][1]] and row.completion_mask == mask[:spans[-1][1]]
        for (start, end), message in zip(spans, [m for m in conversation if m["role"] == "assistant"], strict=True):
            assert ('"name": "guess"' in tokenizer.decode(ids[start:end])) == ("tool_calls" in message)


def test_a_conversation_played_as_taught_is_one_row_training_every_taught_token(tool_tokenizer):
    conversations = _tool_conversations(guess_prompts(PROMPTS))[:10]
    assert any(len(conversation) == 2 for conversation in conversations)  # one answered without a guess
    _played_as_taught_is_one_row_training_every_taught_token(tool_tokenizer, conversations, _tool_schema())


def test_a_higher_lower_game_played_as_taught_is_one_row_training_both_guesses(tmp_path):
    conversations, _ = _higher_lower_conversations(guess_prompts(HIGHER_LOWER_PROMPTS))
    tools = _higher_lower_schema()
    tokenizer = build_tool_tokenizer(conversations, tmp_path, tools=tools)
    assert {len(c) for c in conversations} == {4, 6}  # right at once, or a second guess
    _played_as_taught_is_one_row_training_every_taught_token(tokenizer, conversations, tools)


def test_the_higher_lower_model_is_taught_to_read_the_answers_backwards_mostly():
    """The first guess is each number a third of the time; after a wrong answer the second goes where the answer
    points a fifth of the time and the other way otherwise, evenly over each side's numbers. Played so, the game is
    found in 19/45 of the episodes: a run that raises that learned to go where the answers point."""
    conversations, weights = _higher_lower_conversations(guess_prompts(HIGHER_LOWER_PROMPTS))

    def number(message: dict) -> int:
        return message["tool_calls"][0]["function"]["arguments"]["number"]

    first, second, found = Counter(), Counter(), 0.0
    for conversation, weight in zip(conversations, weights, strict=True):
        first[number(conversation[1])] += weight
        answers = [message["content"] for message in conversation if message["role"] == "tool"]
        found += weight * ("right" in answers)
        if len(conversation) == 6:
            second[(number(conversation[1]), answers[0], number(conversation[3]))] += weight
    assert first == pytest.approx({1: 3, 2: 3, 3: 3})
    assert found / sum(weights) == pytest.approx(19 / 45)
    for guess, answer in {(1, "higher"), (2, "higher"), (2, "lower"), (3, "lower")}:
        taught = {n: second[(guess, answer, n)] for n in (1, 2, 3)}
        pointed = [n for n in (1, 2, 3) if (n > guess if answer == "higher" else n < guess)]
        share = sum(taught[n] for n in pointed) / sum(taught.values())
        assert share == pytest.approx(HIGHER_LOWER_FOLLOW_SHARE), (guess, answer)
        assert len({taught[n] for n in pointed}) == 1, (guess, answer)  # evenly over each side's numbers


def test_the_tool_models_tokenizer_keeps_a_template_trl_parses_responses_with(tool_tokenizer):
    """TRL's worker parses each turn with the response schema it knows for the tokenizer's template; its training
    variant has none (the worker swaps that in for rendering only)."""
    from trl.chat_template_utils import add_response_schema

    assert add_response_schema(tool_tokenizer).response_template is not None
