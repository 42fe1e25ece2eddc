"""The tiny models the tests use (grpo_trainer.testing.tiny_assets), each built once per recipe into the cache folder
`${XDG_CACHE_HOME:-~/.cache}/grpo-operator/models/` (`GRPO_MODELS_CACHE` moves it), like the Go builds and images.

A `Recipe` names a model by what makes it: its kind, seed and inputs (the tool model's prompts), the builder's source
(tiny_assets.py, and for the tool model the guess game's tool, whose schema it is taught to call) and the versions of
the libraries that decide its bytes (torch's initialisation and training, tokenizers' BPE, transformers'
serialisation, TRL's chat templates). Its folder is `<kind>-<hash of all that>`: a changed recipe builds a new folder,
the same recipe finds the old one. A build holds a lock beside the folder (flock: xdist's workers and other runs wait
for it, then find the model) and publishes the folder in one rename, so nobody ever reads half a model.

The tool model is taught for a minute of CPU (minutes on a loaded machine): build_fixtures.py builds it in the
background like the Go builds (`python -m tests.support.tiny_models tool`, which prints its folder); the others take
seconds and are built where a fixture first asks for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.builds import PROGRESS_PREFIX, Build
from tests.support.paths import REPO

#: The libraries whose versions decide a model's bytes.
LIBRARIES = ("torch", "transformers", "tokenizers", "trl", "safetensors")
GUESS_PROMPTS = REPO / "examples" / "tiny-guess.jsonl"
HIGHER_LOWER_PROMPTS = REPO / "examples" / "tiny-higher-lower.jsonl"


def guess_prompts_played_in_turn(environments: Sequence[str]) -> str:
    """The guess game's prompts (what the tool model was taught on) as JSON lines, each row naming in `environment`
    the spec.environments[] entry it plays: `environments` in turn."""
    rows = [json.loads(line) for line in GUESS_PROMPTS.read_text().splitlines() if line.strip()]
    return "".join(json.dumps({**row, "environment": environments[index % len(environments)]}) + "\n"
                   for index, row in enumerate(rows))
#: The tool models' names in hack/lib/build-times and their progress lines (build_name).
TOOL_MODEL_BUILD = "tool-model"
HIGHER_LOWER_MODEL_BUILD = "higher-lower-model"
BUILD_TIMES = REPO / "hack" / "lib" / "build-times"
PROGRESS_INTERVAL_S = float(os.environ.get("BUILD_PROGRESS_INTERVAL_S", "30"))


def cache_root() -> Path:
    if os.environ.get("GRPO_MODELS_CACHE"):
        return Path(os.environ["GRPO_MODELS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-operator" / "models"


@dataclass(frozen=True)
class Recipe:
    """One tiny model: `kind` is "policy", "reward", "tool" (the guess game's) or "higher-lower" (the higher/lower
    game's tool model); `prompts` the tool model's game."""

    kind: str
    seed: int
    prompts: Path | None = None
    nan_everywhere: bool = False

    def key(self) -> str:
        digest = hashlib.sha256()
        for part in (self.kind, str(self.seed), str(self.nan_everywhere)):
            digest.update(part.encode() + b"\0")
        digest.update(builder_source() + b"\0")
        if self.kind in GAME_TOOLS:
            digest.update(tool_source(self.kind).encode() + b"\0")
        if self.prompts is not None:
            digest.update(Path(self.prompts).read_bytes() + b"\0")
        for library in LIBRARIES:
            digest.update(f"{library}=={importlib.metadata.version(library)}".encode() + b"\0")
        return digest.hexdigest()[:12]

    def folder(self) -> Path:
        name = f"{self.kind}-nan" if self.nan_everywhere else self.kind
        return cache_root() / f"{name}-{self.key()}"

    def build_into(self, out: Path) -> Path:
        from grpo_trainer.testing import tiny_assets

        if self.kind == "policy":
            return tiny_assets.build_tiny_model(out, seed=self.seed)
        if self.kind == "reward":
            return tiny_assets.build_tiny_reward_model(out, seed=self.seed, nan_everywhere=self.nan_everywhere)
        assert self.kind in GAME_TOOLS and self.prompts is not None
        if self.kind == "higher-lower":
            return tiny_assets.build_tiny_higher_lower_model(out, self.prompts, seed=self.seed)
        return tiny_assets.build_tiny_tool_model(out, self.prompts, seed=self.seed)


def builder_source() -> bytes:
    """The builder's source: what the models are made of and how the tool model is taught."""
    from grpo_trainer.testing import tiny_assets

    return Path(tiny_assets.__file__).read_bytes()


def tool_source(kind: str) -> str:
    """What a tool model is taught of its game: its tool's signature and docstring, the schema the chat template
    shows (the rest of the game's module may change without a new recipe)."""
    module, environment = GAME_TOOLS[kind]
    return inspect.getsource(getattr(importlib.import_module(module), environment).guess)


#: Each tool model's kind -> its game's module and environment class.
GAME_TOOLS = {"tool": ("grpo_trainer.testing.guess_env", "GuessEnvironment"),
              "higher-lower": ("grpo_trainer.testing.higher_lower_env", "HigherLowerEnvironment")}


POLICY = Recipe("policy", seed=0)
REWARD = Recipe("reward", seed=1)
NAN_REWARD = Recipe("reward", seed=1, nan_everywhere=True)
TOOL = Recipe("tool", seed=0, prompts=GUESS_PROMPTS)
HIGHER_LOWER = Recipe("higher-lower", seed=0, prompts=HIGHER_LOWER_PROMPTS)


def is_built(folder: Path) -> bool:
    return (folder / "config.json").is_file()


@contextlib.contextmanager
def _locked(folder: Path, say: Callable[[str], None]) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build of {folder.name} to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached(recipe: Recipe, say: Callable[[str], None] = lambda _: None) -> Path:
    """The recipe's model folder in the cache, built first if no run has built it yet (one build at a time)."""
    folder = recipe.folder()
    if is_built(folder):
        return folder
    with _locked(folder, say):
        if not is_built(folder):
            # The builders write beside `folder` and rename into it when done; what a killed build left goes first.
            for staging in folder.parent.glob(f"{folder.name}.tmp-*"):
                shutil.rmtree(staging, ignore_errors=True)
            recipe.build_into(folder)
    return folder


def _duration(seconds: float) -> str:
    """754 -> 12m34s, as hack/lib/progress.sh writes it."""
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def recorded(name: str) -> str:
    """How long a cold build took on the development machine (hack/lib/build-times), as words."""
    for line in BUILD_TIMES.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == name:
            return f"a cold build took {_duration(int(fields[1]))} on the 2-core development machine"
    return "no recorded time for it in hack/lib/build-times"


def build(recipe: Recipe = TOOL) -> Build | str:
    """A tool model's background build (build_fixtures.py), or its folder where it is built already."""
    folder = recipe.folder()
    if is_built(folder):
        return str(folder)
    command = [sys.executable, "-m", "tests.support.tiny_models", recipe.kind]
    return Build(build_name(recipe.kind), command, {**os.environ, "PYTHONPATH": str(REPO)}, lane="models")


def build_name(kind: str) -> str:
    """A model's name in hack/lib/build-times and its progress lines: tool-model, higher-lower-model, ..."""
    return f"{kind}-model"


def _build_with_progress(recipe: Recipe, name: str) -> Path:
    """cached(recipe), saying on stderr what it builds, every PROGRESS_INTERVAL_S how long so far, and how long it
    took (hack/lib/progress.sh's lines, which builds.py shows)."""
    def say(text: str) -> None:
        print(f"{PROGRESS_PREFIX}{name}: {text}", file=sys.stderr, flush=True)

    folder, started, done = recipe.folder(), time.monotonic(), threading.Event()
    what = f"the tiny {recipe.kind} model into {folder} ({recorded(name)})"

    def tick() -> None:
        while not done.wait(PROGRESS_INTERVAL_S):
            say(f"building {what}, {_duration(time.monotonic() - started)} so far")

    if is_built(folder):
        return folder
    say(f"building {what}")
    threading.Thread(target=tick, daemon=True).start()
    try:
        cached(recipe, say)
    finally:
        done.set()
    say(f"built {what} in {_duration(time.monotonic() - started)}")
    return folder


RECIPES = {"policy": POLICY, "reward": REWARD, "tool": TOOL, "higher-lower": HIGHER_LOWER}

if __name__ == "__main__":
    (kind,) = sys.argv[1:]
    print(_build_with_progress(RECIPES[kind], build_name(kind)))
