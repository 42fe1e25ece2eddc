"""Session fixtures for the real control plane (registered as a plugin in conftest.py, so there is one per run).

`control_plane`: etcd + kube-apiserver with the GRPORun CRD installed; skips, saying why, where it cannot run.
`control_plane_binaries`, `kueue_binaries`: the folders their builds put the binaries in. The builds start in the
background once the tests are collected, and the tests that need none of them run first (tests/support/builds.py);
a test that needs one waits for it, outside its timeout, and fails with the build's log tail if the build failed.
`admin`: a client with system:masters. `garbage_collector`: kube-controller-manager running its garbage collector
for one test. `operator_account`: the chart's ServiceAccount, ClusterRole and binding
(default values) applied, and a token for that account. `namespace`: a fresh namespace per test.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.builds import Build, BuildFailed, Builds, Report
from tests.support.chart_render import RELEASE_NAMESPACE, render_objects
from tests.support.control_plane import ADMIN_TOKEN, REPO, ControlPlane, Unavailable, assets
from tests.support.control_plane import BUILD_NAME as CONTROL_PLANE_BUILD
from tests.support.control_plane import build as build_control_plane
from tests.support.control_plane_client import Client
from tests.support.kueue_manager import BUILD_NAME as KUEUE_BUILD
from tests.support.kueue_manager import build as build_kueue

_names = itertools.count()
_BUILDS = pytest.StashKey[Builds]()
_FOUND = pytest.StashKey[dict[str, Path | Unavailable]]()  # what needs no build: assets, or why there is none
# The fixture that stands for each build's binaries: a test whose fixture closure holds it needs that build.
NEEDS = {CONTROL_PLANE_BUILD: "control_plane_binaries", KUEUE_BUILD: "kueue_binaries"}


def _needs(item: pytest.Item) -> list[str]:
    names = getattr(item, "fixturenames", ())
    return [build for build, fixture in NEEDS.items() if fixture in names]


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope, which this keeps within each part
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that need no built binaries first, then those that need the control plane, then Kueue's: they run
    while the binaries build (a stable sort: the order within each part stays)."""
    items.sort(key=lambda item: len(_needs(item)))


def _plan(name: str) -> Build | Path | Unavailable:
    """Build `name` (not started), or the folder that needs no build, or why there can be none."""
    try:
        if name == CONTROL_PLANE_BUILD:
            return assets() or build_control_plane()
        return build_kueue()
    except Unavailable as why:
        return why


def _planned(config: pytest.Config, names: set[str]) -> tuple[Builds, dict[str, Path | Unavailable]]:
    """This run's builds and what needed none, planning those of `names` not planned yet (started by the caller)."""
    if _BUILDS not in config.stash:
        config.stash[_BUILDS] = Builds(Path(tempfile.mkdtemp(prefix="grpo-builds-")))
        config.stash[_FOUND] = {}
    builds, found = config.stash[_BUILDS], config.stash[_FOUND]
    for name in NEEDS:  # in this order: Kueue's build waits for the control plane's
        if name in names and name not in found and builds.get(name) is None:
            planned = _plan(name)
            if isinstance(planned, Build):
                builds.queue.append(planned)
            else:
                found[name] = planned
    return builds, found


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the builds the selected tests need, in the background (a build already in the cache only prints its
    folder); the tests that need none of them run meanwhile."""
    config = session.config
    wanted = {name for item in session.items for name in _needs(item)}
    if config.option.collectonly or not wanted:
        return
    builds, _ = _planned(config, wanted)
    if builds.queue:
        order = ", one after the other" if len(builds.queue) > 1 else ""
        first = sum(1 for item in session.items if not _needs(item))
        meanwhile = f"; the {first} tests that need no binaries run first" if first else ""
        _reporter(config)(f"builds: {', '.join(b.name for b in builds.queue)} in the background{order} "
                          f"(logs in {builds.logs}){meanwhile}")
    builds.start()


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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Before a test that needs a build, wait for it here, outside the test's timeout (pytest-timeout starts its
    timer inside this); after every test, report the builds' progress."""
    builds = item.config.stash.get(_BUILDS, None)
    if builds is not None:
        for name in _needs(item):
            if builds.get(name) is not None:
                with contextlib.suppress(BuildFailed):  # the fixture raises it, in the test's report
                    builds.wait(name, _reporter(item.config))
    try:
        return (yield)
    finally:
        if builds is not None:
            builds.poll(_reporter(item.config))


def pytest_sessionfinish(session: pytest.Session) -> None:
    builds = session.config.stash.get(_BUILDS, None)
    if builds is None:
        return
    for build in builds.stop():
        _reporter(session.config)(f"builds: stopped {build.name}: the run ended before it finished")
    if all(build.done and build.result_ok for build in builds.queue if build.started):
        shutil.rmtree(builds.logs, ignore_errors=True)


def _binaries(config: pytest.Config, name: str) -> Path:
    """The folder with build `name`'s binaries, once built; skips where they cannot exist, raises BuildFailed
    (with the build's log tail) where the build failed."""
    builds, found = _planned(config, {name})
    if isinstance(found.get(name), Unavailable):
        pytest.skip(f"no {name} binaries: {found[name]}")
    if name in found:
        return found[name]
    builds.start()
    return builds.wait(name, _reporter(config))


@pytest.fixture(scope="session")
def control_plane_binaries(request: pytest.FixtureRequest) -> Path:
    return _binaries(request.config, CONTROL_PLANE_BUILD)


@pytest.fixture(scope="session")
def kueue_binaries(request: pytest.FixtureRequest) -> Path:
    return _binaries(request.config, KUEUE_BUILD)


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries: Path, tmp_path_factory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), control_plane_binaries)
    try:
        plane.start()
    except Unavailable as why:
        plane.stop()
        pytest.skip(f"no Kubernetes control plane: {why}")
    except BaseException:
        plane.stop()
        raise
    try:
        admin = Client(plane, ADMIN_TOKEN)
        admin.install_crd(yaml.safe_load((REPO / "crds" / "grporun.yaml").read_text()))
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def admin(control_plane: ControlPlane) -> Client:
    return Client(control_plane, ADMIN_TOKEN)


@dataclass
class OperatorAccount:
    namespace: str
    name: str
    token: str
    kubeconfig: Path

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


@pytest.fixture(scope="session")
def operator_account(control_plane: ControlPlane, admin: Client) -> OperatorAccount:
    """The chart's RBAC (default values: cluster-wide) applied as `helm install` would, and a token for its
    ServiceAccount: what the operator's pod would run as."""
    admin.create_namespace(RELEASE_NAMESPACE)
    objects = render_objects()
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
            admin.create_object(obj, RELEASE_NAMESPACE)
    deployment = next(obj for obj in objects if obj["kind"] == "Deployment")
    name = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = admin.service_account_token(RELEASE_NAMESPACE, name)
    kubeconfig = control_plane.write_kubeconfig(control_plane.workdir / "operator.kubeconfig", token)
    return OperatorAccount(RELEASE_NAMESPACE, name, token, kubeconfig)


@pytest.fixture()
def namespace(admin: Client) -> str:
    name = f"t{next(_names)}"
    admin.create_namespace(name)
    return name


@pytest.fixture()
def garbage_collector(control_plane: ControlPlane) -> Iterator[None]:
    """kube-controller-manager with the garbage collector alone, for one test: the other tests rely on dependents of
    a deleted owner staying put (a real cluster's collector is asynchronous; here it is absent)."""
    try:
        process = control_plane.start_controller_manager("garbagecollector")
    except Unavailable as why:
        pytest.skip(f"no garbage collector: {why}")
    try:
        yield
    finally:
        control_plane.stop_process(process)
