"""The lifecycle scenarios' `cluster` on the real control plane: the same methods as operator_fixtures.Cluster, backed
by kube-apiserver, with the real kopf operator logged in as the chart's ServiceAccount (a TokenRequest token), so
every request it makes goes through the real RBAC authorizer.

The operator watches every namespace, as the chart runs it (`--all-namespaces`; its default RBAC does not let kopf
list namespaces, which watching named ones needs). Each test gets its own namespace and deletes its runs before
the operator stops, so the next test's operator finds no leftovers. Pods are moved by a status writer standing in
for the kubelet (PATCH pods/status as the admin), exactly as on the emulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kopf
import pytest
import requests
from kopf._cogs.structs.credentials import Vault

from grpo_operator.cluster.reconcile import OperatorContext
from tests.support.controlplane.control_plane import ControlPlane
from tests.support.controlplane.control_plane_client import Client
from tests.support.controlplane.control_plane_faults import NODE_FINALIZER, ClusterFaults
from tests.support.emulator.kube_emulator import CONFIGMAPS, EVENTS, GRPORUNS, PODS, SERVICES
from tests.support.emulator.operator_fixtures import TEST_IMAGE, Cluster, Kubelet, OperatorThread

# The scenarios' waits were sized for the in-memory emulator; the real server on a busy 2-core machine is slower.
TIMEOUT_SCALE = 3.0


class AccountOperatorThread(OperatorThread):
    """OperatorThread logged in with a bearer token and the server's CA instead of the emulator's open HTTP."""

    def __init__(self, plane: ControlPlane, token: str, context: OperatorContext):
        super().__init__(plane.url, context, namespaces=(), clusterwide=True)
        self.plane, self.token = plane, token

    def _run(self) -> None:
        info = kopf.ConnectionInfo(server=self.url, token=self.token, ca_path=str(self.plane.ca))
        try:
            asyncio.run(kopf.operator(
                standalone=True, memo=kopf.Memo(context=self.context), clusterwide=True,
                vault=Vault({"service-account": info}),
                stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as error:  # noqa: BLE001 (surfaced by stop())
            self.error = error


class PodRecorder:
    """Every pod object the server stores in a namespace, from a watch opened before the test starts. The watch
    ends every few seconds and resumes from its last resourceVersion, so stop() never has to close a stream
    another thread is reading (that blocked)."""

    def __init__(self, admin: Client, namespace: str):
        self.added: list[tuple[str, str]] = []  # (name, uid)
        self.admin, self.path = admin, f"{admin.url}/api/v1/namespaces/{namespace}/pods"
        self._stop = threading.Event()
        self._version = admin.session.get(self.path, timeout=10).json()["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._read, name="pod-recorder", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            params = {"watch": "1", "resourceVersion": self._version, "timeoutSeconds": "2"}
            try:
                with self.admin.session.get(self.path, params=params, stream=True, timeout=10) as response:
                    for line in response.iter_lines():
                        event = json.loads(line)
                        metadata = event["object"]["metadata"]
                        self._version = metadata["resourceVersion"]
                        if event["type"] == "ADDED":
                            self.added.append((metadata["name"], metadata["uid"]))
            except (requests.RequestException, ValueError, KeyError):
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


class StatusKubelet(Kubelet):
    """operator_fixtures.Kubelet (the same status documents) for a namespace of the real server.

    With `hold_deleted_pods` it plays a node that never confirms a deletion: a pod it runs gets a finalizer, so the
    real server keeps it Terminating after a delete (the server deletes an unbound or finished pod at once
    otherwise), until confirm_deletion() removes it."""

    def __init__(self, client: Client, namespace: str, hold_deleted_pods: bool = False):
        super().__init__(client)
        self.namespace, self.hold_deleted_pods = namespace, hold_deleted_pods

    def _status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.client.patch(PODS, self.namespace, name, {"status": status}, subresource="status")

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.client.get(PODS, self.namespace, name)

    def run(self, name: str, *, ready: bool = True, ip: str = "127.0.0.1") -> dict[str, Any]:
        if self.hold_deleted_pods:
            self.client.patch(PODS, self.namespace, name, {"metadata": {"finalizers": [NODE_FINALIZER]}})
        return super().run(name, ready=ready, ip=ip)

    def confirm_deletion(self, name: str) -> None:
        self.client.patch(PODS, self.namespace, name, {"metadata": {"finalizers": None}})

    def release_all(self) -> None:
        for pod in self.client.list(PODS, self.namespace):
            if NODE_FINALIZER in pod["metadata"].get("finalizers", []):
                self.confirm_deletion(pod["metadata"]["name"])


class RealCluster(Cluster):
    """operator_fixtures.Cluster's methods on the real server, in `namespace`."""

    def __init__(self, plane: ControlPlane, admin: Client, operator_token: str, namespace: str,
                 context_factory: Callable[[], OperatorContext], hold_deleted_pods: bool = False):
        self.plane, self.client, self.namespace = plane, admin, namespace
        self.operator_token = operator_token
        self.kubelet = StatusKubelet(admin, namespace, hold_deleted_pods)
        self.faults = ClusterFaults(admin, namespace)
        self.context_factory = context_factory
        self.operator = None
        self.recorder = PodRecorder(admin, namespace)

    def start_operator(self, clusterwide: bool = False, liveness_endpoint: str | None = None) -> OperatorThread:
        assert not clusterwide and liveness_endpoint is None, "not offered on the real control plane"
        self.operator = AccountOperatorThread(self.plane, self.operator_token, self.context_factory())
        self.operator.start()
        return self.operator

    def metric(self, name: str, run: str, **labels: str) -> float | None:
        assert self.operator is not None
        return self.operator.context.metrics.registry.get_sample_value(
            name, {"namespace": self.namespace, "run": run, **labels})

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"]["namespace"] = self.namespace
        return self.client.create(GRPORUNS, self.namespace, body)

    def run(self, name: str) -> dict[str, Any] | None:
        return self.client.get(GRPORUNS, self.namespace, name)

    def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> dict[str, Any]:
        return self.client.patch(GRPORUNS, self.namespace, name, {"spec": spec_patch})

    def pods(self, run: str, role: str | None = None) -> list[dict[str, Any]]:
        selector = f"grpo.dev/run={run}" + (f",grpo.dev/role={role}" if role else "")
        return sorted(self.client.list(PODS, self.namespace, selector), key=lambda p: p["metadata"]["name"])

    def pods_ever_created(self, run: str) -> list[str]:
        return sorted(name for name, _ in self.recorder.added if name.startswith(f"{run}-"))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.client.list(EVENTS, self.namespace) if e["involvedObject"].get("name") == name]

    def services(self, run: str) -> list[dict[str, Any]]:
        return self.client.list(SERVICES, self.namespace, f"grpo.dev/run={run}")

    def config_maps(self, run: str) -> list[dict[str, Any]]:
        return self.client.list(CONFIGMAPS, self.namespace, f"grpo.dev/run={run}")

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
        return super().wait_for(predicate, timeout * TIMEOUT_SCALE, what)

    # --- the faults, made by the real server's own machinery -------------------------------------------------
    def evict(self, pod: str) -> None:
        self.faults.evict(pod)

    def collect_garbage(self) -> None:
        self.faults.collect_garbage()

    def limit_pods(self, hard: int | None) -> None:
        self.faults.limit_pods(hard)

    def refuse_pod(self, pod: str, message: str) -> None:
        self.faults.refuse_pod(pod, message)

    def enforce_restricted_pod_security(self, violating_pod: str, violation: str) -> None:
        self.faults.enforce_restricted_pod_security()  # the real admission plugin finds the violation itself

    def close(self) -> None:
        if self.operator is not None:  # the next test's operator finds no leftover runs
            for run in self.client.list(GRPORUNS, self.namespace):
                self.client.delete(GRPORUNS, self.namespace, run["metadata"]["name"])
            self.wait_for(lambda: not self.client.list(GRPORUNS, self.namespace), what="the test's runs deleted")
        self.stop_operator()
        self.recorder.stop()
        self.kubelet.release_all()
        self.faults.close()


def context_factory(progress_urls: dict[str, str]) -> Callable[[], OperatorContext]:
    def make() -> OperatorContext:
        return OperatorContext(
            trainer_image=TEST_IMAGE, reconcile_interval=0.2,
            progress_url=lambda namespace, pod, ip: progress_urls.get(pod, f"http://{ip}:9/progress"))
    return make


@contextlib.contextmanager
def real_cluster(control_plane: ControlPlane, admin: Client, operator_account, namespace: str,
                 progress_urls: dict[str, str], emulator_options: dict[str, Any]) -> Iterator[RealCluster]:
    """The lifecycle scenarios' `cluster` on the real server. Of the emulator's stricter modes, a real server always
    has `deferred_gc` (no garbage collector runs unless a test starts one: dependents stay until collect_garbage()),
    and `graceful_pod_deletion` is a kubelet that never confirms a deletion (StatusKubelet.hold_deleted_pods)."""
    unknown = set(emulator_options) - {"graceful_pod_deletion", "deferred_gc"}
    assert not unknown, f"emulator options with no real-server counterpart: {sorted(unknown)}"
    real = RealCluster(control_plane, admin, operator_account.token, namespace, context_factory(progress_urls),
                       hold_deleted_pods=emulator_options.get("graceful_pod_deletion", False))
    real.start_operator()
    try:
        yield real
    finally:
        real.close()


@pytest.fixture()
def cluster(control_plane, admin, operator_account, namespace, progress_urls,
            emulator_options) -> Iterator[RealCluster]:
    with real_cluster(control_plane, admin, operator_account, namespace, progress_urls, emulator_options) as real:
        yield real
