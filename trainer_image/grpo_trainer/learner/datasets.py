"""The prompt dataset the run config names (`dataset`): a local JSON/JSONL file, a folder saved with `save_to_disk`, or
a hub dataset, with its prompt column as the chat messages TRL's rollout worker renders. Its other columns reach the
rewards as keyword arguments. A mistake in it is a ConfigError naming the field."""

from __future__ import annotations

import os
from typing import Any

from ..contract.config import DatasetConfig
from .errors import ConfigError


# ----------------------------------------------------------------------------------------------------------------------
# Pure pieces
# ----------------------------------------------------------------------------------------------------------------------
def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """TRL's rollout worker renders `prompt` through the chat template: it must be a list of messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return prompt
    raise ConfigError(f"dataset prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


# ----------------------------------------------------------------------------------------------------------------------
# I/O
# ----------------------------------------------------------------------------------------------------------------------
def load_prompts(dataset_config: DatasetConfig):
    """The prompt dataset with a `prompt` column of chat messages; other columns reach the rewards as kwargs."""
    import datasets

    try:
        if dataset_config.path is not None:
            path = dataset_config.path
            if os.path.isdir(path):
                loaded = datasets.load_from_disk(path)
                dataset = loaded[dataset_config.split] if isinstance(loaded, datasets.DatasetDict) else loaded
            elif os.path.isfile(path):
                if _has_no_rows(path):  # datasets' builders fail on it with StopIteration or a bare generation error
                    raise ConfigError(f"dataset.path {path!r}: the file has no rows")
                kind = "json" if path.endswith((".json", ".jsonl")) else path.rsplit(".", 1)[-1]
                dataset = datasets.load_dataset(kind, data_files=path, split="train")
            else:
                raise ConfigError(f"dataset.path {path!r}: no such file or directory")
        else:
            dataset = datasets.load_dataset(dataset_config.name, dataset_config.config, split=dataset_config.split)
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as error:
        source = dataset_config.path or dataset_config.name
        raise ConfigError(f"dataset {source!r}: {str(error).splitlines()[0]}") from None
    field = dataset_config.prompt_field
    if field not in dataset.column_names:
        raise ConfigError(f"dataset.promptField {field!r} is not a column; columns: {dataset.column_names}")
    if dataset_config.limit is not None:
        dataset = dataset.select(range(min(dataset_config.limit, len(dataset))))
    if len(dataset) == 0:
        raise ConfigError("dataset has no rows")
    if field != "prompt" and "prompt" in dataset.column_names:
        dataset = dataset.remove_columns("prompt")
    remove = [field] if field != "prompt" else []
    return dataset.map(lambda row: {"prompt": as_messages(row[field])}, remove_columns=remove)


def _has_no_rows(path: str, sniff_bytes: int = 1 << 16) -> bool:
    """An empty file, or one of blank lines only (read up to its first non-blank byte, at most `sniff_bytes`)."""
    with open(path, "rb") as file:
        head = file.read(sniff_bytes)
    return not head.strip() and len(head) < sniff_bytes
