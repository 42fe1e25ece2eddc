"""Session fixtures for the real control plane (registered as a plugin in conftest.py, so there is one per run).

`control_plane`: etcd + kube-apiserver with the GRPORun CRD installed, from the `control_plane_binaries` build
(build_fixtures.py); skips, saying why, where it cannot run. `admin`: a client with system:masters.
`garbage_collector`: kube-controller-manager running its garbage collector for one test. `operator_account`: the
chart's ServiceAccount, ClusterRole and binding (default values) applied, and a token for that account.
`namespace`: a fresh namespace per test, its runs deleted after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.builds import Unavailable
from tests.support.chart_render import RELEASE_NAMESPACE, render_objects
from tests.support.controlplane.control_plane import ADMIN_TOKEN, REPO, ControlPlane
from tests.support.controlplane.control_plane_client import Client
from tests.support.emulator.kube_emulator import GRPORUNS

_names = itertools.count()


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
def namespace(admin: Client) -> Iterator[str]:
    """A fresh namespace, whose GRPORuns are deleted when the test ends. The lifecycle scenarios' operator watches
    every namespace: runs an earlier test left (the manifests test_api.py admits, each retrying a PodGroup the server
    has no kind for) took a later test's operator passes, and on a loaded machine its polls of the test's learner
    timed out until the wait for the learner's report gave up."""
    name = f"t{next(_names)}"
    admin.create_namespace(name)
    yield name
    delete_runs(admin, name)


def delete_runs(admin: Client, namespace: str) -> None:
    """Every GRPORun in `namespace`, deleted at once (they hold no finalizer: the operator sets none)."""
    admin.call("DELETE", admin.path(GRPORUNS, namespace)[len(admin.url):])


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
