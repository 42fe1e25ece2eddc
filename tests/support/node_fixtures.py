"""The `node` session fixture: one real node (tests/support/node.py) per pytest run, started by the first test that
asks for it. Its binaries are found or built (hack/node/build.sh) right after collection, when a `node` test was
collected, so the build is not charged to the first test's timeout and says what it builds while it builds.

Skips, with the reason, only where a node cannot exist (not root, no cgroups, no overlay). A missing Debian package
or a failed build is an error: `make setup-node-apt` installs the packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.control_plane import Unavailable
from tests.support.node import DEBIAN_PACKAGES, Node, missing_prerequisites, node_binaries, unavailable_reason

_NODE_BINARIES = pytest.StashKey[Path | BaseException]()


def _find(report) -> Path | BaseException:
    try:
        return node_binaries(report)
    except (Unavailable, RuntimeError) as why:
        return why


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not any(item.get_closest_marker("node") for item in session.items):
        return
    if unavailable_reason() is not None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    write("node: finding or building kubelet, kube-scheduler, kube-proxy, CoreDNS and the node's images (hack/node)")
    session.config.stash[_NODE_BINARIES] = _find(write)


@pytest.fixture(scope="session")
def node(request: pytest.FixtureRequest, tmp_path_factory, control_plane_binaries: Path) -> Iterator[Node]:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"no node: {why}")
    missing = missing_prerequisites()
    if missing:
        raise RuntimeError(f"the node needs {', '.join(missing)}: `{DEBIAN_PACKAGES}` installs them")
    found = request.config.stash.get(_NODE_BINARIES, None) or _find(None)
    if isinstance(found, BaseException):
        raise found
    node = Node(tmp_path_factory.mktemp("node"), control_plane_binaries, found)
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
