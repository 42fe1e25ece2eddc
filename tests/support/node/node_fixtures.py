"""The `node` session fixture: one real node (tests/support/node/node.py) per pytest run, started by the first test that
asks for it. Its binaries come from the `node_binaries` build (build_fixtures.py: built in the background once the
tests are collected, and waited for outside the first test's timeout).

Skips, with the reason, only where a node cannot exist (not root, no cgroups, no overlay). A missing Debian package
or a failed build is an error: `make setup-node-apt` installs the packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.node.node import DEBIAN_PACKAGES, Node, missing_prerequisites, unavailable_reason


@pytest.fixture(scope="session")
def node(request: pytest.FixtureRequest, tmp_path_factory, control_plane_binaries: Path,
         node_binaries: Path) -> Iterator[Node]:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"no node: {why}")
    missing = missing_prerequisites()
    if missing:
        raise RuntimeError(f"the node needs {', '.join(missing)}: `{DEBIAN_PACKAGES}` installs them")
    node = Node(tmp_path_factory.mktemp("node"), control_plane_binaries, node_binaries)
    try:
        node.start()
        yield node
    finally:
        node.stop()
        _print(request.config, [*node.report_lines,
                                ", ".join(f"{name} {seconds:.1f}" for name, seconds in node.timings.items())])


def _print(config: pytest.Config, lines: list[str]) -> None:
    """Lines on the terminal even while pytest captures the teardown's output."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(f"node: {line}")
