"""The prompt dataset (grpo_trainer.learner.datasets): prompts as chat messages, and mistakes that name the field."""

from __future__ import annotations

import pytest

from grpo_trainer.contract.config import DatasetConfig
from grpo_trainer.learner.datasets import as_messages, load_prompts
from grpo_trainer.learner.errors import ConfigError
from tests.support.paths import REPO


def test_prompts_become_chat_messages():
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert as_messages(chat) == chat
    with pytest.raises(ConfigError):
        as_messages(3)


def test_the_tiny_dataset_loads_with_a_prompt_column():
    dataset = load_prompts(DatasetConfig(path=str(REPO / "examples" / "tiny-prompts.jsonl"), limit=5))
    assert len(dataset) == 5
    assert dataset[0]["prompt"] == [{"role": "user", "content": "say apple"}]


def test_dataset_mistakes_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="dataset.path"):
        load_prompts(DatasetConfig(path=str(tmp_path / "missing.jsonl")))
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q"}\n')
    with pytest.raises(ConfigError, match="dataset.promptField 'prompt' is not a column"):
        load_prompts(DatasetConfig(path=str(data)))
    renamed = load_prompts(DatasetConfig(path=str(data), prompt_field="question"))
    assert renamed.column_names == ["prompt"]
    for name, content in [("blank.jsonl", "\n \n"), ("empty.csv", "")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=r"^dataset.path '.*': the file has no rows$"):
            load_prompts(DatasetConfig(path=str(tmp_path / name)))
