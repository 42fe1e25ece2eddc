"""The tiny models' cache (tests/support/tiny_models.py): a folder per recipe, built once and reused by the next
caller, rebuilt when the recipe changes (its kind, seed, prompts, builder source, library versions), one build at a
time across threads and processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support import tiny_models
from tests.support.builds import PROGRESS_PREFIX, Build
from tests.support.paths import REPO


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_MODELS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def builds(monkeypatch) -> list[tuple[tiny_models.Recipe, Path]]:
    """Each build's recipe and folder: a stand-in builder that writes a config.json beside the folder and renames it
    into place, as tiny_assets' builders do, after a pause that lets a second caller meet the lock."""
    made = []

    def build_into(recipe: tiny_models.Recipe, out: Path) -> Path:
        made.append((recipe, out))
        staging = out.with_name(out.name + ".tmp-1")
        staging.mkdir()
        (staging / "config.json").write_text(json.dumps({"seed": recipe.seed}))
        time.sleep(0.3)
        staging.rename(out)
        return out

    monkeypatch.setattr(tiny_models.Recipe, "build_into", build_into)
    return made


def test_the_same_recipe_is_built_once_and_reused(cache, builds):
    first = tiny_models.cached(tiny_models.TOOL)
    assert tiny_models.cached(tiny_models.TOOL) == first and len(builds) == 1
    assert first.parent == cache and first.name == f"tool-{tiny_models.TOOL.key()}"
    assert tiny_models.build() == str(first)  # the background build finds it and builds nothing


def test_a_changed_recipe_is_built_again_in_a_folder_of_its_own(cache, builds, tmp_path, monkeypatch):
    original = tiny_models.cached(tiny_models.TOOL)
    prompts = tmp_path / "guess.jsonl"
    prompts.write_text(tiny_models.GUESS_PROMPTS.read_text() + '{"prompt": "one more", "target": 1}\n')
    folders = [tiny_models.cached(replace(tiny_models.TOOL, seed=1)),
               tiny_models.cached(replace(tiny_models.TOOL, prompts=prompts))]
    source = tiny_models.builder_source()
    monkeypatch.setattr(tiny_models, "builder_source", lambda: source + b"\nTOOL_SFT_STEPS = 151\n")
    folders.append(tiny_models.cached(tiny_models.TOOL))
    assert len({original, *folders}) == 4 and len(builds) == 4
    policy = tiny_models.POLICY.folder()
    monkeypatch.setattr(tiny_models, "tool_source", lambda kind: "def guess(self, number: str): ...")
    assert tiny_models.TOOL.folder() != folders[-1]  # the tool's schema changed
    assert tiny_models.POLICY.folder() == policy  # which the policy model is not taught
    monkeypatch.setattr(tiny_models.importlib.metadata, "version", lambda name: "0.0.0")
    assert tiny_models.TOOL.folder() != folders[-1]  # another torch, transformers, ...: another recipe


def test_callers_at_once_wait_for_one_build(cache, builds):
    said: list[str] = []
    folders: list[Path] = []
    callers = [threading.Thread(target=lambda: folders.append(tiny_models.cached(tiny_models.REWARD, said.append)))
               for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1 and len(set(folders)) == 1 and tiny_models.is_built(folders[0])
    assert said and all("waiting for another build" in line for line in said)
    assert [path.name for path in cache.iterdir() if not path.name.startswith(".")] == [folders[0].name]


def test_what_a_killed_build_left_is_removed_before_the_next(cache, builds):
    folder = tiny_models.POLICY.folder()
    leftover = folder.with_name(folder.name + ".tmp-4242")
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_text("half")
    tiny_models.cached(tiny_models.POLICY)
    assert not leftover.exists() and tiny_models.is_built(folder)


def test_the_tool_models_background_build_is_the_command_line_in_a_lane_of_its_own(cache):
    planned = tiny_models.build()
    assert isinstance(planned, Build) and planned.lane == "models" and planned.name == tiny_models.TOOL_MODEL_BUILD
    assert planned.command == [sys.executable, "-m", "tests.support.tiny_models", "tool"]


def test_the_command_line_builds_into_the_cache_says_so_and_prints_the_folder(cache):
    """What the background build runs (`python -m tests.support.tiny_models KIND`, from any folder), on the policy
    model (seconds; the tool model's minute of training is the test run's own build): progress lines, then the
    folder as its last line; a second call only prints the folder."""
    planned = tiny_models.build()
    command = [*planned.command[:-1], "policy"]
    result = subprocess.run(command, env=planned.env, capture_output=True, text=True, timeout=600, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert folder == tiny_models.POLICY.folder() and tiny_models.is_built(folder)
    assert json.loads((folder / "grpo_tiny.json").read_text())["seed"] == 0
    assert not any(path.name.startswith(".") or ".tmp-" in path.name for path in folder.iterdir())
    progress = [line for line in result.stderr.splitlines() if line.startswith(PROGRESS_PREFIX)]
    assert progress[0].startswith(f"{PROGRESS_PREFIX}policy-model: building the tiny policy model into {folder}")
    assert progress[-1].startswith(f"{PROGRESS_PREFIX}policy-model: built the tiny policy model")
    again = subprocess.run(command, env=planned.env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert again.stdout.strip() == str(folder) and PROGRESS_PREFIX not in again.stderr
