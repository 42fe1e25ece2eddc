"""actionlint, the linter of GitHub Actions workflows, built from hack/actionlint's Go module (hack/actionlint/build.sh
prints the folder that holds it)."""

from __future__ import annotations

from tests.support.builds import Build
from tests.support.controlplane.control_plane import go_build
from tests.support.paths import REPO

BUILD_NAME = "actionlint"
BUILD_SCRIPT = REPO / "hack" / "actionlint" / "build.sh"


def build() -> Build:
    """hack/actionlint/build.sh (not started); Unavailable without Go (the tests that need it skip)."""
    return go_build(BUILD_NAME, [str(BUILD_SCRIPT)], "actionlint is")
