"""The tiny tool model's tokenizer, as the worker and the vLLM server load it (Qwen3's own chat template)."""

from __future__ import annotations

import pytest

from grpo_trainer.testing.tiny_assets import _tool_conversations, build_tool_tokenizer, guess_prompts
from tests.support.paths import REPO

PROMPTS = REPO / "examples" / "tiny-guess.jsonl"


@pytest.fixture(scope="session")
def tool_tokenizer(tmp_path_factory):
    return build_tool_tokenizer(_tool_conversations(guess_prompts(PROMPTS)), tmp_path_factory.mktemp("tool-tokenizer"))
