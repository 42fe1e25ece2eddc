"""The tiny tool model's chat template and taught rows against TRL's multi-turn reconciler: a conversation played as
taught (a guess and the closing turn, or the closing turn alone) is one training row whose trained tokens are exactly
the taught ones (the tool call included). With Qwen3's own template the re-render after the tool answer drops the
tool call's think block, the reconciler "realigns", and the tool call became untrained context: the agentic run's
reward could not rise."""

from __future__ import annotations

import pytest
from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

from grpo_trainer.testing.tiny_assets import (
    _tool_conversations,
    _tool_schema,
    build_tool_tokenizer,
    guess_prompts,
    tool_chat_template,
    tool_training_row,
)
from tests.support.paths import REPO

PROMPTS = REPO / "examples" / "tiny-guess.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tool model's tokenizer as the worker and the vLLM server load it (Qwen3's own chat template)."""
    return build_tool_tokenizer(_tool_conversations(guess_prompts(PROMPTS)), tmp_path_factory.mktemp("tool-tokenizer"))


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for index, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = index
        elif not bit and start is not None:
            spans.append((start, index))
            start = None
    return spans


def test_a_conversation_played_as_taught_is_one_row_training_every_taught_token(tokenizer):
    tools = _tool_schema()
    conversations = _tool_conversations(guess_prompts(PROMPTS))[:10]
    assert any(len(conversation) == 2 for conversation in conversations)  # one answered without a guess
    for conversation in conversations:
        ids, mask = tool_training_row(tokenizer, conversation, tools)
        spans = _spans(mask)
        # Each assistant turn: the tool call and the closing turn, or the closing turn alone (no guess).
        histories = [conversation[:index] for index, message in enumerate(conversation)
                     if message["role"] == "assistant"]
        assert len(spans) == len(histories)
        turns = []
        for (start, end), history in zip(spans, histories, strict=True):
            # The worker renders the conversation so far with the generation prompt, and the policy generates
            # the taught span.
            prompt = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, return_dict=False,
                                                   chat_template=tool_chat_template(tokenizer))
            assert prompt == ids[:start]
            turns.append(TurnRecord(prompt, ids[start:end], [0.0] * (end - start)))
        rows, tally = _chain_to_sequences(turns, "rollout", fork_threshold=1024)
        assert tally["realign"] == tally["fork"] == 0 and tally["clean"] == len(spans) - 1  # each later turn appends
        (row,) = rows
        assert row.input_ids == ids[:spans[-1][1]] and row.completion_mask == mask[:spans[-1][1]]
        first_turn = tokenizer.decode(ids[spans[0][0]:spans[0][1]])
        assert ('"name": "guess"' in first_turn) == (len(spans) == 2), first_turn


def test_the_tool_models_tokenizer_keeps_a_template_trl_parses_responses_with(tokenizer):
    """TRL's worker parses each turn with the response schema it knows for the tokenizer's template; its training
    variant has none (the worker swaps that in for rendering only)."""
    from trl.chat_template_utils import add_response_schema

    assert add_response_schema(tokenizer).response_template is not None
