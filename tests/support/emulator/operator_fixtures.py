"""Fixtures for running the real kopf operator against the API emulator, and a kubelet stand-in to drive pods.

Import the fixtures a test module uses by name (`from operator_fixtures import cluster`); importing the module
and also naming it in `pytest_plugins` makes pytest warn that it cannot rewrite its asserts.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kopf
import kubernetes_validate
import pytest
import yaml
from kopf._cogs.structs.credentials import Vault

import grpo_operator.cluster.handlers  # noqa: F401  (registers the handlers with kopf's default registry)
from grpo_operator.cluster.reconcile import OperatorContext
from grpo_operator.metric_names import RECONCILE_SECONDS
from grpo_trainer.contract.report import ProgressReport
from grpo_trainer.learner.exporter import ProgressServer
from tests.support.emulator.kube_emulator import (
    CONFIGMAPS,
    DEFAULT_RESOURCES,
    EVENTS,
    GRPORUNS,
    PODS,
    SCHEDULING_RESOURCES,
    SERVICES,
    EmulatorThread,
    Fault,
    KubeClient,
    KubeEmulator,
    ResourceDef,
)
from tests.support.paths import REPO
from tests.support.specs import NAMESPACE, status_errors

CRDS = ResourceDef("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                   namespaced=False, subresources=("status",))
TEST_IMAGE = "grpo-trainer:test"
#: The digest the emulated node reports for TEST_IMAGE once a container started from it (a kubelet's imageID).
TEST_IMAGE_ID = "docker.io/library/grpo-trainer@sha256:" + "7" * 64
#: The learner's answers by which what it reported is in the run's status (Cluster.wait_trained).
READS_TO_LAND = 10
#: The operator's passes by which what it decides is in the API server (Cluster.wait_passes): a pass writes the status,
#: then acts; passes go on while kopf's watch brings what the test changed into its pod index (milliseconds quiet, a
#: real API server's watch under load longer); and the passes of every run the operator watches count. 50 passes are
#: 10 s at the tests' 0.2 s reconcile interval, and proportionally longer on a loaded machine.
PASSES_TO_LAND = 50
KUBERNETES_VERSION = "1.33"


def schema_validators() -> dict[str, Callable[[dict[str, Any]], list[str]]]:
    """Reject (422) what a real API server would refuse: a GRPORun status the CRD does not declare (the server
    would prune it silently), and children that break the Kubernetes API schemas."""
    def grporun_status(obj: dict[str, Any]) -> list[str]:
        return status_errors(obj["status"]) if "status" in obj else []

    def kubernetes_schema(obj: dict[str, Any]) -> list[str]:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            return [f"{'.'.join(map(str, error.path))}: {error.message}"]
        return []
    return {"grporuns": grporun_status, "pods": kubernetes_schema, "services": kubernetes_schema,
            "configmaps": kubernetes_schema}


class OperatorThread:
    """The real kopf operator (handlers.py) in a thread of its own, logged in to the emulator."""

    def __init__(self, url: str, context: OperatorContext, namespaces: tuple[str, ...] = (NAMESPACE,),
                 clusterwide: bool = False, liveness_endpoint: str | None = None):
        self.url, self.context, self.namespaces, self.clusterwide = url, context, namespaces, clusterwide
        self.liveness_endpoint = liveness_endpoint
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)

    def _run(self) -> None:
        vault = Vault({"emulator": kopf.ConnectionInfo(server=self.url, default_namespace=NAMESPACE)})
        try:
            asyncio.run(kopf.operator(
                standalone=True, memo=kopf.Memo(context=self.context), clusterwide=self.clusterwide,
                namespaces=[] if self.clusterwide else list(self.namespaces), liveness_endpoint=self.liveness_endpoint,
                vault=vault, stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as error:  # noqa: BLE001 - surfaced by stop()
            self.error = error

    def start(self) -> OperatorThread:
        self._thread.start()
        if not self.ready_flag.wait(20):
            raise RuntimeError(f"the operator did not get ready within 20 s: {self.error!r}")
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop within 30 s"


class Kubelet:
    """Moves pods through their lives the way the kubelet reports them: PATCH /status, and the Events it posts."""

    namespace = NAMESPACE

    def __init__(self, client: KubeClient):
        self.client = client

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.client.get(PODS, NAMESPACE, name)

    def _status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.client.patch(PODS, NAMESPACE, name, {"status": status}, subresource="status")

    def run(self, name: str, *, ready: bool = True, ip: str = "127.0.0.1",
            image_id: str = TEST_IMAGE_ID) -> dict[str, Any]:
        """The main container started from `image_id` (the digest the node pulled), ready or not."""
        role = name.rsplit("-", 2)[-2]
        return self._status(name, {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": role, "ready": ready, "restartCount": 0, "image": TEST_IMAGE,
                                   "imageID": image_id, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}],
        })

    def wait(self, name: str, reason: str, message: str = "") -> dict[str, Any]:
        role = name.rsplit("-", 2)[-2]
        return self._status(name, {
            "phase": "Pending",
            "containerStatuses": [{"name": role, "ready": False, "restartCount": 0, "image": TEST_IMAGE,
                                   "imageID": "", "state": {"waiting": {"reason": reason, "message": message}}}],
        })

    def exit(self, name: str, code: int, message: str = "", reason: str | None = None) -> dict[str, Any]:
        """The main container terminated with `code`; `reason` as the kubelet says it (default Completed/Error;
        OOMKilled when the kernel killed it for memory)."""
        role = name.rsplit("-", 2)[-2]
        reason = reason or ("Completed" if code == 0 else "Error")
        return self._status(name, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": role, "ready": False, "restartCount": 0, "image": TEST_IMAGE, "imageID": "",
                                   "state": {"terminated": {"exitCode": code, "reason": reason,
                                                            "message": message}}}],
        })


    def disrupt(self, name: str, reason: str = "PreemptionByScheduler") -> dict[str, Any]:
        """What the control plane and kubelet report for an evicted or preempted pod: DisruptionTarget, then killed."""
        role = name.rsplit("-", 2)[-2]
        return self._status(name, {
            "phase": "Failed", "reason": reason,
            "conditions": [{"type": "Ready", "status": "False"},
                           {"type": "DisruptionTarget", "status": "True", "reason": reason,
                            "message": f"{reason}: the pod was removed to make room"}],
            "containerStatuses": [{"name": role, "ready": False, "restartCount": 0, "image": TEST_IMAGE, "imageID": "",
                                   "state": {"terminated": {"exitCode": 137, "reason": "Error", "message": ""}}}],
        })

    def probe_failed(self, name: str, message: str, *, count: int, seconds: int) -> dict[str, Any]:
        """The kubelet's `Unhealthy` Event on the pod: `message` (`Readiness probe failed: ...`), counted `count`
        times over `seconds`, the last just now."""
        pod = self.pod(name)
        assert pod is not None, f"no pod {name}"
        last = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        stamp, container = "%Y-%m-%dT%H:%M:%SZ", pod["spec"]["containers"][0]["name"]
        return self.client.create(EVENTS, self.namespace, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": self.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": self.namespace,
                               "uid": pod["metadata"]["uid"], "fieldPath": f"spec.containers{{{container}}}"},
            "type": "Warning", "reason": "Unhealthy", "message": message, "source": {"component": "kubelet"},
            "firstTimestamp": (last - datetime.timedelta(seconds=seconds)).strftime(stamp),
            "lastTimestamp": last.strftime(stamp), "count": count})

    def confirm_deletion(self, name: str) -> None:
        """The kubelet's final delete of a Terminating pod (a dead node never sends it)."""
        self.client.delete(PODS, NAMESPACE, name, grace_period_seconds=0)


class _RawReport:
    """Stands in for a ProgressReport where ProgressServer renders one: a learner answering whatever it likes."""

    def __init__(self, text: str):
        self.text = text

    def model_dump_json(self, **_: Any) -> str:
        return self.text


class FakeLearner:
    """A real ProgressServer on 127.0.0.1 serving a report the test changes as it goes; `reads` counts the reports it
    answered (the operator's polls)."""

    def __init__(self) -> None:
        self.report = ProgressReport(phase="Running", groups_total=40, epochs=1)
        self.raw: str | None = None
        self.reads = 0
        self._lock = threading.Lock()
        self.server = ProgressServer(self._answer, port=0, host="127.0.0.1").start()

    def _answer(self) -> ProgressReport | _RawReport:
        with self._lock:
            self.reads += 1
        return _RawReport(self.raw) if self.raw is not None else self.report

    def update(self, **changes: Any) -> None:
        self.report = ProgressReport.model_validate({**self.report.model_dump(), **changes})
        self.raw = None

    def answer(self, text: str) -> None:
        """Serve `text` as the /progress body, valid or not, until the next update()."""
        self.raw = text

    def url(self) -> str:
        return f"{self.server.url}/progress"


class Cluster:
    """An emulated cluster with the operator running against it, plus the helpers a lifecycle test needs."""

    def __init__(self, emulator_thread: EmulatorThread, context_factory: Callable[[], OperatorContext]):
        self.emulator_thread = emulator_thread
        self.emulator = emulator_thread.emulator
        self.client = KubeClient(emulator_thread.url)
        self.kubelet = Kubelet(self.client)
        self.context_factory = context_factory
        self.operator: OperatorThread | None = None
        self.namespace = NAMESPACE
        self._quota_faults: list[Fault] = []

    # --- operator ---------------------------------------------------------------------------------------------
    def start_operator(self, clusterwide: bool = False, liveness_endpoint: str | None = None) -> OperatorThread:
        self.operator = OperatorThread(self.emulator_thread.url, self.context_factory(), clusterwide=clusterwide,
                                       liveness_endpoint=liveness_endpoint)
        self.operator.start()
        return self.operator

    def stop_operator(self) -> None:
        if self.operator is not None:
            self.operator.stop()
            self.operator = None

    def metric(self, name: str, run: str, **labels: str) -> float | None:
        assert self.operator is not None
        registry = self.operator.context.metrics.registry
        return registry.get_sample_value(name, {"namespace": NAMESPACE, "run": run, **labels})

    # --- API --------------------------------------------------------------------------------------------------
    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.client.create(GRPORUNS, NAMESPACE, copy.deepcopy(body))

    def run(self, name: str) -> dict[str, Any] | None:
        return self.client.get(GRPORUNS, NAMESPACE, name)

    def status(self, name: str) -> dict[str, Any]:
        run = self.run(name)
        return (run or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), None)

    def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> dict[str, Any]:
        return self.client.patch(GRPORUNS, NAMESPACE, name, {"spec": spec_patch})

    def pods(self, run: str, role: str | None = None) -> list[dict[str, Any]]:
        selector = f"grpo.dev/run={run}" + (f",grpo.dev/role={role}" if role else "")
        return sorted(self.client.list(PODS, NAMESPACE, selector), key=lambda p: p["metadata"]["name"])

    def pod_names(self, run: str, role: str | None = None) -> list[str]:
        return [p["metadata"]["name"] for p in self.pods(run, role)]

    def pods_ever_created(self, run: str) -> list[str]:
        """Names of the pods of `run` the API server stored, one entry per pod object (uid) ever created."""
        history = self.emulator_thread.call(lambda: self.emulator.history(PODS))
        return sorted(name for kind, name, _ in history if kind == "ADDED" and name.startswith(f"{run}-"))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.client.list(EVENTS, NAMESPACE) if e["involvedObject"].get("name") == name]

    def event_reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    def wait_event(self, name: str, *reasons: str) -> None:
        """Events are posted after the status write (and may be refused): wait for them rather than race them."""
        self.wait_for(lambda: set(reasons) <= set(self.event_reasons(name)), what=f"events {reasons} on {name}")

    def services(self, run: str) -> list[dict[str, Any]]:
        return self.client.list(SERVICES, NAMESPACE, f"grpo.dev/run={run}")

    def config_maps(self, run: str) -> list[dict[str, Any]]:
        return self.client.list(CONFIGMAPS, NAMESPACE, f"grpo.dev/run={run}")

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
            time.sleep(0.05)

    def passes(self) -> int:
        """The reconcile passes the running operator has made, over every run (its metrics); 0 without one."""
        if self.operator is None:
            return 0
        registry = self.operator.context.metrics.registry
        return int(registry.get_sample_value(f"{RECONCILE_SECONDS}_count", {"handler": "lifecycle"}) or 0)

    def wait_passes(self, predicate: Callable[[], Any], what: str, passes: int = PASSES_TO_LAND) -> Any:
        """`predicate()`'s first true value, for what the operator alone brings about: its passes are the wait's
        clock, not the machine's speed (`passes` passes after the wait began without it is a failure)."""
        operator, first = self.operator, self.passes()
        while not (result := predicate()):
            if self.operator is not operator:  # a new operator counts its passes from its start
                operator, first = self.operator, 0
            made = self.passes() - first
            assert made < passes, f"{what}: not seen in {made} passes of the operator"
            time.sleep(0.05)
        return result

    def wait_trained(self, name: str, learner: FakeLearner, groups: int) -> dict[str, Any]:
        """The run's status once it shows `groups` trained groups, as `learner` reports. A pass that reads the learner
        writes what it read (the tests' specs write progress on every pass), so the learner's answers are the wait's
        clock, not the machine's speed: READS_TO_LAND answers after the wait began without it is a failure (a read
        can be lost to the poll's own timeout on a loaded machine, not that many in a row)."""
        first = learner.reads
        while True:
            status = self.status(name)
            if (status.get("progress") or {}).get("groupsTrained") == groups:
                return status
            answered = learner.reads - first
            assert answered < READS_TO_LAND, (f"{name}: {groups} trained groups not in the status after the learner "
                                              f"answered {answered} reads; the status: {status}")
            time.sleep(0.05)

    def wait_phase(self, name: str, phase: str, timeout: float = 15.0) -> dict[str, Any]:
        return self.wait_for(lambda: self.status(name) if self.status(name).get("phase") == phase else None,
                             timeout, f"{name} to reach phase {phase} (now {self.status(name).get('phase')})")

    def wait_idle(self, name: str) -> None:
        """Wait until the operator has no pass scheduled for the run (a finished run with nothing left to do)."""
        assert self.operator is not None
        uid = self.run(name)["metadata"]["uid"]
        self.wait_for(lambda: uid not in self.operator.context.loops, what=f"the operator to leave {name} alone")

    # --- faults a real cluster produces (tests/support/controlplane/control_plane_cluster.py produces them for real) --
    def evict(self, pod: str) -> None:
        """What the Eviction API does to a pod not bound to a node: it is deleted."""
        self.client.delete(PODS, self.namespace, pod)

    def delete_run(self, name: str) -> None:
        self.client.delete(GRPORUNS, self.namespace, name)

    def collect_garbage(self) -> None:
        """Let the garbage collector catch up (`deferred_gc`): the dependents of deleted owners go."""
        self.emulator_thread.call(self.emulator.collect_garbage)

    def limit_pods(self, hard: int | None) -> None:
        """A ResourceQuota on pods: with `hard` 0, every pod create is refused (403 exceeded quota); None lifts it."""
        if hard is None:
            for fault in self._quota_faults:
                self.emulator_thread.call(lambda fault=fault: setattr(fault, "times", 0))
            return
        assert hard == 0, "the emulator's quota refuses every pod"
        self._quota_faults.append(self.emulator_thread.call(lambda: self.emulator.inject_fault(
            "POST", "pods", 403, "Forbidden", "pods is forbidden: exceeded quota: pods, requested: pods=1, "
            "used: pods=0, limited: pods=0", times=1_000_000)))

    def enforce_restricted_pod_security(self, violating_pod: str, violation: str) -> None:
        """The namespace enforces PodSecurity `restricted`: creating `violating_pod` is refused with 403 Forbidden
        and the admission plugin's message (the real server's PodSecurity admission decides which pods violate)."""
        message = f'pods "{violating_pod}" is forbidden: violates PodSecurity "restricted:latest": {violation}'
        self.emulator_thread.call(lambda: self.emulator.inject_fault(
            "POST", "pods", 403, "Forbidden", message, times=1_000_000, name=violating_pod))

    def refuse_pod(self, pod: str, message: str) -> None:
        """An admission refusal (422 Invalid) of the pod named `pod`, every time it is created."""
        self.emulator_thread.call(lambda: self.emulator.inject_fault(
            "POST", "pods", 422, "Invalid", message, times=1_000_000, name=pod))

    def bring_up(self, name: str, pods: int = 2) -> None:
        """Wait for the run's `pods`, then report them all running and ready."""
        self.wait_for(lambda: len(self.pods(name)) >= pods, what=f"{name}'s {pods} pods")
        for pod in self.pod_names(name):
            self.kubelet.run(pod)


@pytest.fixture()
def learner() -> Iterator[FakeLearner]:
    fake = FakeLearner()
    yield fake
    fake.server.stop()


@pytest.fixture()
def progress_urls() -> dict[str, str]:
    """pod name -> URL of its /progress; the operator's progress_url hook reads it (pods all have IP 127.0.0.1)."""
    return {}


@pytest.fixture()
def emulator_options() -> dict[str, Any]:
    """Extra KubeEmulator arguments; override with `@pytest.mark.parametrize("emulator_options", [...])`."""
    return {}


@pytest.fixture()
def cluster(progress_urls: dict[str, str], emulator_options: dict[str, Any]) -> Iterator[Cluster]:
    crd = yaml.safe_load((REPO / "crds" / "grporun.yaml").read_text())
    emulator = KubeEmulator(resources=DEFAULT_RESOURCES + (CRDS,) + SCHEDULING_RESOURCES,
                            validators=schema_validators(), **emulator_options)
    emulator_thread = EmulatorThread(emulator).start()
    KubeClient(emulator_thread.url).create(CRDS, None, crd)

    def context_factory() -> OperatorContext:
        return OperatorContext(
            trainer_image=TEST_IMAGE, reconcile_interval=0.2,
            progress_url=lambda namespace, pod, ip: progress_urls.get(pod, f"http://{ip}:9/progress"))

    cluster = Cluster(emulator_thread, context_factory)
    cluster.start_operator()
    try:
        yield cluster
    finally:
        cluster.stop_operator()
        emulator_thread.stop()
