"""What the node tier's run tests share: the tiny model and prompts, and the tiny tool model and the guess game's
prompts, each in one folder the pods can read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import tiny_models
from tests.support.node.node_runs import GUESS_GAME, OPENENV_GAME, TWO_GAMES_PROMPTS, shared_folder
from tests.support.paths import REPO


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_model_dir: str) -> Path:
    """The model and the prompts, in one folder readable by the pods' user."""
    data = tmp_path_factory.mktemp("tiny-data")
    shutil.copytree(tiny_model_dir, data / "model")
    shutil.copy(REPO / "examples" / "tiny-prompts.jsonl", data / "tiny-prompts.jsonl")
    return shared_folder(data, writable=False)


@pytest.fixture(scope="session")
def tiny_tool_data(tmp_path_factory, tiny_tool_model_dir: str) -> Path:
    """The tool model (taught offline to call the guess game's tool) and the game's prompts, in one folder readable
    by the pods' user: TWO_GAMES_PROMPTS sends every other row to the game served over OpenEnv (a row's
    `environment` names the spec.environments[] entry it plays)."""
    data = tmp_path_factory.mktemp("tiny-tool-data")
    shutil.copytree(tiny_tool_model_dir, data / "model")
    (data / TWO_GAMES_PROMPTS).write_text(tiny_models.guess_prompts_played_in_turn((GUESS_GAME, OPENENV_GAME)))
    return shared_folder(data, writable=False)
