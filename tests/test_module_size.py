"""No module of the operator or the trainer grows past what one reader holds in mind: a module over the limit is a
room's worth of concerns, to be split along them."""

from __future__ import annotations

import pytest

from tests.support.paths import REPO

MAX_MODULE_LINES = 700
PACKAGES = [REPO / "operator" / "grpo_operator", REPO / "trainer_image" / "grpo_trainer"]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda package: package.name)
def test_no_module_is_over_the_line_limit(package):
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    assert sizes, f"no module under {package}"
    over = {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"
