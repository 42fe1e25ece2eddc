"""Session fixtures for the real control plane (registered as a plugin in conftest.py, so there is one per run).

`control_plane`: etcd + kube-apiserver with the GRPORun CRD installed; skips, saying why, where it cannot run.
`admin`: a client with system:masters. `garbage_collector`: kube-controller-manager running its garbage collector
for one test. `operator_account`: the chart's ServiceAccount, ClusterRole and binding
(default values) applied, and a token for that account. `namespace`: a fresh namespace per test.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.chart_render import RELEASE_NAMESPACE, render_objects
from tests.support.control_plane import ADMIN_TOKEN, REPO, ControlPlane, Unavailable, binaries
from tests.support.control_plane_client import Client
from tests.support.kueue_manager import kueue_binaries

_names = itertools.count()
_BINARIES = pytest.StashKey[Path | Unavailable]()


def _find_binaries() -> Path | Unavailable:
    try:
        return binaries()
    except Unavailable as why:
        return why


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries (first time only: tens of minutes) before any test runs, so the build is not charged to
    the first test's timeout."""
    if session.config.option.collectonly or not any(item.get_closest_marker("controlplane") for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("control plane: finding or building kube-apiserver, etcd, kubectl and "
                            "kube-controller-manager (hack/controlplane)")
    session.config.stash[_BINARIES] = _find_binaries()
    if any("kueue_manager" in getattr(item, "fixturenames", ()) for item in session.items):
        if reporter is not None:
            reporter.write_line("Kueue: finding or building its manager (hack/kueue)")
        with contextlib.suppress(Unavailable, RuntimeError):  # the fixture says why (it skips, or raises the error)
            kueue_binaries()


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[ControlPlane]:
    found = request.config.stash.get(_BINARIES, None) or _find_binaries()
    if isinstance(found, Unavailable):
        pytest.skip(f"no Kubernetes control plane: {found}")
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), found)
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
