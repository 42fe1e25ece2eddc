"""The builds a test run needs, started once the tests are collected and run in the background while the tests that
need none of them run (registered as a plugin in conftest.py, so there is one set of builds per run).

`BUILDS` names each build, the fixture that stands for its output, and its lane: a test whose fixture closure holds
that fixture needs the build. The Go builds run one after the other in one lane (they share the Go build cache and
the cores), the image builds in another (buildah's store), the tiny tool model's training in a third. A test that
needs a build waits for it before its set-up, outside its pytest-timeout; a failed build makes every test that needs
it fail with the build's log tail, never skip; only a missing prerequisite (no Go, not root) skips, saying which.

The builds run in the process that owns the terminal, so their progress lines reach it: the pytest process itself,
or pytest-xdist's controller, which hands its workers the board the outcomes go to. Under xdist the tests that
share an expensive session fixture (the control plane, the node, the vLLM server) form one scheduling group, so
that each is started once per run; a free worker gets the longest group whose builds are done, else a test whose
builds are done, and waits for a build only when nothing else is left (`next_unit`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import actionlint, tiny_models
from tests.support.builds import Board, Build, Builds, Outcome, Poller, Report, Unavailable
from tests.support.controlplane import control_plane, kueue_manager
from tests.support.node import images, node, operator_release
from tests.support.servers import s3_server


@dataclass(frozen=True)
class BuildKind:
    name: str  # the build's name in hack/lib/build-times and its progress lines
    fixture: str  # the fixture that stands for its output
    plan: Callable[[], Build | str]  # the build (not started), or its result where nothing needs building


# In the order they start in their lane and the order of the tests that wait for them: the tool model's tests first
# (a lane of its own: it takes a minute or two of CPU), then the control plane's, then the images' (the CUDA
# variant's only when asked: images.CUDA_IMAGE_ENV), then the node's (they need everything but Kueue), then the
# workflow linter's (seconds), the S3 server's, then Kueue's.
BUILDS = (
    BuildKind(tiny_models.TOOL_MODEL_BUILD, "tiny_tool_model_dir", tiny_models.build),
    BuildKind(tiny_models.HIGHER_LOWER_MODEL_BUILD, "tiny_higher_lower_model_dir",
              lambda: tiny_models.build(tiny_models.HIGHER_LOWER)),
    BuildKind(control_plane.BUILD_NAME, "control_plane_binaries", control_plane.build),
    BuildKind(images.OPERATOR_BUILD, "operator_image", lambda: images.build(images.OPERATOR_BUILD)),
    BuildKind(images.TRAINER_BUILD, "trainer_image", lambda: images.build(images.TRAINER_BUILD)),
    BuildKind(images.TRAINER_CUDA_BUILD, "trainer_cuda_image", lambda: images.build(images.TRAINER_CUDA_BUILD)),
    BuildKind(node.BUILD_NAME, "node_binaries", node.build),
    BuildKind(operator_release.HELM_BUILD, "helm_binary", operator_release.helm_build),
    BuildKind(actionlint.BUILD_NAME, "actionlint_binary", actionlint.build),
    BuildKind(s3_server.BUILD_NAME, "seaweedfs_binaries", s3_server.build),
    BuildKind(kueue_manager.BUILD_NAME, "kueue_binaries", kueue_manager.build),
)
# The session fixtures that make a test part of a group under xdist: each is started by the worker that runs it.
# Longest first, so that the two longest go to different workers: measured alone on the 2-core machine, the
# vLLM server's 16 tests took 1031 s, the node's 11 942 s, the control plane's 155 258 s; the S3 server's few take
# seconds, but grouped they start one server per run rather than one per worker.
GROUPS = {"vllm_server": "vllm-server", "node": "node", "control_plane": "control-plane", "s3_server": "s3-server"}
BOARD_INPUT = "grpo_builds_board"  # the key of xdist's workerinput that names the board
COLLECTED_FILE = "collected.json"  # what a worker's collection needs and its groups, for the controller

_RUN = pytest.StashKey["BuildRun"]()


def _fixtures(item: pytest.Item) -> set[str]:
    """The fixtures a test uses, not its parameters (a schema test's parameter may be called `node`)."""
    callspec = getattr(item, "callspec", None)
    return set(getattr(item, "fixturenames", ())) - set(callspec.params if callspec else ())


def _needs(item: pytest.Item) -> list[BuildKind]:
    names = _fixtures(item)
    return [kind for kind in BUILDS if kind.fixture in names]


def _group(item: pytest.Item) -> str | None:
    names = _fixtures(item)
    return next((group for fixture, group in GROUPS.items() if fixture in names), None)


def _order(item: pytest.Item) -> int:
    return max((BUILDS.index(kind) + 1 for kind in _needs(item)), default=0)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _is_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


@dataclass
class BuildRun:
    """This run's builds and the board their outcomes go to. `builds` is None in an xdist worker: the controller
    runs them."""

    board: Board
    builds: Builds | None = None
    poller: Poller | None = None
    lines: list[str] | None = None  # progress waiting for the main thread to print it (no xdist)

    def start(self, needed: list[str], report: Report) -> None:
        """Plan the builds of `needed` (those with no outcome yet) and start them."""
        assert self.builds is not None
        for kind in BUILDS:
            if kind.name not in needed or self.board.outcome(kind.name) or self.builds.get(kind.name):
                continue
            try:
                planned = kind.plan()
            except Unavailable as why:
                self.board.publish(kind.name, Outcome(unavailable=str(why)))
                continue
            if isinstance(planned, Build):
                self.builds.queue.append(planned)
            else:
                self.board.publish(kind.name, Outcome(result=planned))
        if self.builds.queue and self.poller is None:
            lanes = {build.lane for build in self.builds.queue}
            order = ", one at a time per lane" if len(self.builds.queue) > len(lanes) else ""
            report(f"builds: {', '.join(build.name for build in self.builds.queue)} in the background{order} "
                   f"(logs in {self.builds.logs})")
            self.poller = Poller(self.builds, self._collect if self.lines is not None else report)
            self.poller.start()

    def _collect(self, line: str) -> None:
        self.lines.append(line)

    def flush(self, report: Report) -> None:
        """Print the progress lines the poller collected (no xdist: the main thread prints, past the capture)."""
        while self.lines:
            report(self.lines.pop(0))

    def wait(self, name: str, report: Report) -> Outcome:
        return self.board.wait(name, lambda: self.flush(report))

    def stop(self, report: Report) -> None:
        if self.poller is not None:
            self.poller.stop()
        if self.builds is None:
            return
        for build in self.builds.stop():
            report(f"builds: stopped {build.name}: the run ended before it finished")
        if self.lines is not None:
            self.builds.poll(self._collect)
            self.flush(report)
        if all(build.result_ok for build in self.builds.queue if build.started):
            shutil.rmtree(self.builds.logs, ignore_errors=True)


def _new_run(keep_lines: bool) -> BuildRun:
    folder = Path(tempfile.mkdtemp(prefix="grpo-builds-"))
    (folder / "board").mkdir()
    board = Board(folder / "board")
    return BuildRun(board, Builds(folder / "logs", board), lines=[] if keep_lines else None)


def _reporter(config: pytest.Config) -> Report:
    """Writes a line to the terminal, also from inside a test's set-up (past pytest's output capture)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def report(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            if terminal is not None:
                terminal.write_line(line)
            else:
                print(line, file=sys.stderr, flush=True)
    return report


@pytest.hookimpl(trylast=True)  # after xdist's, which registers its controller's session
def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Order(), "grpo-build-order")
    if _is_worker(config):
        config.stash[_RUN] = BuildRun(Board(Path(config.workerinput[BOARD_INPUT])))
    elif _is_controller(config):
        config.stash[_RUN] = _new_run(keep_lines=False)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller: its workers wait on its board."""
    node.workerinput[BOARD_INPUT] = str(node.config.stash[_RUN].board.folder)


class _Order:
    """The tests that need no build first, then by the builds they wait for (a stable sort, after pytest's own
    reordering by fixture scope, which it keeps within each part)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=_order)


@pytest.hookimpl(tryfirst=True)  # a worker writes what it needs before xdist's hook tells the controller it collected
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the builds the selected tests need, in the background (a build already in the cache only prints its
    result); the tests that need none of them run meanwhile. An xdist worker tells the controller instead."""
    config = session.config
    needed = sorted({kind.name for item in session.items for kind in _needs(item)})
    if config.option.collectonly:
        return
    if _is_worker(config):
        groups = {item.nodeid: group for item in session.items if (group := _group(item))}
        needs = {item.nodeid: [kind.name for kind in kinds] for item in session.items if (kinds := _needs(item))}
        slow = [item.nodeid for item in session.items if item.get_closest_marker("slow")]
        board = config.stash[_RUN].board
        partial = board.folder / f".{COLLECTED_FILE}.{config.workerinput['workerid']}"
        partial.write_text(json.dumps({"needed": needed, "groups": groups, "needs": needs, "slow": slow}))
        partial.replace(board.folder / COLLECTED_FILE)
        return
    if not needed:
        return
    run = config.stash.setdefault(_RUN, _new_run(keep_lines=True))
    first = sum(1 for item in session.items if not _needs(item))
    run.start(needed, _reporter(config))
    if first:
        _reporter(config)(f"builds: the {first} tests that need none of them run first")


def _collected(board: Board) -> dict:
    return json.loads((board.folder / COLLECTED_FILE).read_text())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """xdist's controller: start the builds the first worker's collection needs (the workers collect alike)."""
    run = node.config.stash[_RUN]
    needed = _collected(run.board)["needed"]
    if needed:
        run.start(needed, _reporter(node.config))


@dataclass(frozen=True)
class Unit:
    """What xdist's scheduler hands a worker at once: a group's tests, or one test."""

    scope: str  # a group's name, or the test's nodeid
    needs: frozenset[str]  # the builds its tests wait for
    slow: bool = False  # a test marked `slow` (a real run, a server): minutes where the others take seconds


def next_unit(queue: list[Unit], built: set[str], idle: bool) -> Unit | None:
    """The unit a worker gets next: the first group, then the first slow test, then the first other test, whose
    builds all have an outcome. With none, an idle worker gets the first unit of the queue anyway (it waits for its
    builds), and a busy one gets nothing until it finishes a test. The slow tests go before the quick ones so that
    the run ends on tests of seconds on both workers: a run of minutes handed out last kept one worker busy for
    minutes after the other had finished."""
    ready = [unit for unit in queue if unit.needs <= built]
    ready.sort(key=lambda unit: (unit.scope not in GROUPS.values(), not unit.slow))  # stable: in the queue's order
    if ready:
        return ready[0]
    return queue[0] if idle and queue else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N` (xdist's `load` distribution), each of `GROUPS` goes to one worker as one unit, and every other
    test to whichever worker is free, each in the order `next_unit` chooses."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    board = config.stash[_RUN].board

    class GroupScheduling(LoadScopeScheduling):
        collected: dict | None = None  # read once the workers have collected

        def _split_scope(self, nodeid: str) -> str:
            if self.collected is None:
                self.collected = _collected(board)
            return self.collected["groups"].get(nodeid, nodeid)

        def _queue(self) -> list[Unit]:
            """The work queue's units, the groups first in `GROUPS`' order (xdist puts the most tests first)."""
            order = list(GROUPS.values())
            needs, slow = self.collected["needs"], set(self.collected["slow"])
            units = [Unit(scope, frozenset(name for nodeid in tests for name in needs.get(nodeid, ())),
                          slow=bool(slow.intersection(tests)))
                     for scope, tests in self.workqueue.items()]
            return sorted(units, key=lambda unit: order.index(unit.scope) if unit.scope in order else len(order))

        def _choose(self, idle: bool) -> bool:
            """Put the unit `next_unit` chooses first in the work queue; False when it chooses none."""
            built = {kind.name for kind in BUILDS if board.outcome(kind.name) is not None}
            unit = next_unit(self._queue(), built, idle)
            if unit is not None:
                self.workqueue.move_to_end(unit.scope, last=False)
            return unit is not None

        def _assign_work_unit(self, node) -> None:
            self._choose(idle=True)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # xdist's, but a worker still running tests does not take a unit whose builds are not done
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test only once it holds the next one (or is told to stop): with one left it is idle.
            pending = self._pending_of(self.assigned_work[node])
            if pending <= 2 and self._choose(idle=pending <= 1):
                super()._assign_work_unit(node)

    return GroupScheduling(config, log)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Before a test that needs a build, wait for it here, outside the test's timeout (pytest-timeout starts its
    timer inside this); after every test, print the builds' progress (without xdist)."""
    run = item.config.stash.get(_RUN, None)
    report = _reporter(item.config)
    if run is not None:
        for kind in _needs(item):
            run.wait(kind.name, report)
    try:
        return (yield)
    finally:
        if run is not None and run.lines is not None:
            run.flush(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_RUN, None)
    if run is not None:
        run.stop(_reporter(session.config))


def _outcome(config: pytest.Config, kind: BuildKind) -> str:
    """Build `kind`'s result, once built: skips where it cannot exist, raises BuildFailed (with the build's log
    tail) where the build failed."""
    run = config.stash.get(_RUN, None)
    if run is None:  # not selected at collection: a fixture asked for it on the way (no xdist)
        run = config.stash.setdefault(_RUN, _new_run(keep_lines=True))
    if run.builds is not None and run.board.outcome(kind.name) is None:
        run.start([kind.name], _reporter(config))
    outcome = run.wait(kind.name, _reporter(config))
    try:
        return outcome.value()
    except Unavailable as why:
        pytest.skip(f"no {kind.name}: {why}")


def _kind(fixture: str) -> BuildKind:
    return next(kind for kind in BUILDS if kind.fixture == fixture)


@pytest.fixture(scope="session")
def tiny_tool_model_dir(request: pytest.FixtureRequest) -> str:
    """The tiny tool model (grpo_trainer.testing.tiny_assets.build_tiny_tool_model, on the guess game's prompts),
    in the cache folder (tests/support/tiny_models.py)."""
    return _outcome(request.config, _kind("tiny_tool_model_dir"))


@pytest.fixture(scope="session")
def tiny_higher_lower_model_dir(request: pytest.FixtureRequest) -> str:
    """The tiny tool model taught the higher/lower game (build_tiny_higher_lower_model), in the cache folder."""
    return _outcome(request.config, _kind("tiny_higher_lower_model_dir"))


@pytest.fixture(scope="session")
def control_plane_binaries(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("control_plane_binaries")))


@pytest.fixture(scope="session")
def kueue_binaries(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("kueue_binaries")))


@pytest.fixture(scope="session")
def node_binaries(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("node_binaries")))


@pytest.fixture(scope="session")
def helm_binary(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("helm_binary"))) / "helm"


@pytest.fixture(scope="session")
def seaweedfs_binaries(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("seaweedfs_binaries")))


@pytest.fixture(scope="session")
def actionlint_binary(request: pytest.FixtureRequest) -> Path:
    return Path(_outcome(request.config, _kind("actionlint_binary"))) / "actionlint"


@pytest.fixture(scope="session")
def operator_image(request: pytest.FixtureRequest) -> images.BuiltImage:
    return images.BuiltImage.parse(_outcome(request.config, _kind("operator_image")))


@pytest.fixture(scope="session")
def trainer_image(request: pytest.FixtureRequest) -> images.BuiltImage:
    return images.BuiltImage.parse(_outcome(request.config, _kind("trainer_image")))


@pytest.fixture(scope="session")
def trainer_cuda_image(request: pytest.FixtureRequest) -> images.BuiltImage:
    return images.BuiltImage.parse(_outcome(request.config, _kind("trainer_cuda_image")))

