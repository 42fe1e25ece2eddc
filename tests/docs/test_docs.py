"""The repository stands alone: its docs map every module, and nothing points outside it or at how it was built."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support.paths import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
CHECKED = ["operator", "trainer_image", "tests", "bench", "charts", "crds", "README.md", "docs"]
# Pointers outside the repository and words about how it was built. Written so that this file matches nothing.
STRAY = re.compile(r"LEARNER\.md|OPERATOR\.md|ARCHITECTURE\.md|\.\./shared|issue [0-9]|the seed[']s|T:[0-9]|W:[0-9]")


def _tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return [line for line in listed.stdout.splitlines() if (REPO / line).is_file()]


def python_modules() -> list[str]:
    """Dotted names of every Python module the operator and the trainer ship."""
    modules = []
    for path in _tracked("operator", "trainer_image"):
        if path.endswith(".py"):
            parts = path.split("/")[1:]
            parts[-1] = parts[-1].removesuffix(".py")
            if parts[-1] == "__init__" and len(parts) > 2:
                parts = parts[:-1]
            modules.append(".".join(parts))
    return sorted(set(modules) - {"grpo_operator.__init__", "grpo_trainer.__init__"})


def test_the_module_map_names_every_module():
    text = ARCHITECTURE.read_text()
    missing = [module for module in python_modules() if f"`{module}`" not in text]
    assert not missing, f"docs/architecture.md does not map: {', '.join(missing)}"


def test_the_module_map_names_no_module_that_is_gone():
    named = set(re.findall(r"`(grpo_(?:operator|trainer)(?:\.\w+)+)`", ARCHITECTURE.read_text()))
    modules = set(python_modules())
    # A name may also be a module's attribute (`grpo_trainer.contract.RunConfig`): its module must exist.
    gone = [name for name in named if not any(name == m or name.startswith(m + ".") for m in modules)]
    assert not gone, f"docs/architecture.md names modules that do not exist: {', '.join(sorted(gone))}"


@pytest.mark.parametrize("path", _tracked(*CHECKED))
def test_nothing_points_outside_the_repository(path):
    text = (REPO / path).read_text(errors="replace")
    lines = enumerate(text.splitlines(), 1)
    hits = [f"{path}:{number}: {line.strip()}" for number, line in lines if STRAY.search(line)]
    assert not hits, "\n".join(hits)
