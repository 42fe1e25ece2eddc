"""A GRPORun on the real node, driven as a user drives it: `kubectl apply`, `kubectl get`, `kubectl logs`, and the
run's status. The manifest is examples/tiny.yaml with what a cluster needs instead of `grporun local`'s relative
paths: the model and prompts on a read-only volume both roles mount (`podTemplateOverride`) and a volume for the
filesystem weight sync. The pods run as a non-root user that owns none of the node's files, so the folders a test
hands them are made readable (or writable) by any user, as a user preparing a hostPath would.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_operator.api import RUN_LABEL
from tests.support.node.exported_model_reader import RESULT_PREFIX
from tests.support.node.node import Node
from tests.support.node.operator_release import OperatorRelease
from tests.support.paths import REPO
from tests.support.servers.s3_server import S3Server

RUN = "tiny"
DATA_MOUNT = "/data"
RUN_TIMEOUT_S = 900
#: The tiny agentic run's two environments, the guess game over HTTP and over OpenEnv, and its prompts file, whose
#: rows alternate between them.
GUESS_GAME = "guess"
OPENENV_GAME = "openguess"
TWO_GAMES_PROMPTS = "tiny-two-games.jsonl"
LOG_LINES = 40


def shared_folder(folder: Path, *, writable: bool) -> Path:
    """A folder a pod's non-root user can read (and, when `writable`, write): what the node's root makes for it."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o777 if writable and path.is_dir() else 0o755 if path.is_dir() else 0o644)
    return folder


def host_folder(folder: Path) -> dict:
    return {"hostPath": {"path": str(folder), "type": "Directory"}}


def tiny_manifest(data_volume: dict, weights_volume: dict, *, example: str = "tiny.yaml",
                  prompts: str = "tiny-prompts.jsonl") -> dict:
    """examples/`example`, named RUN, with the model and `prompts` at DATA_MOUNT (from `data_volume`, mounted
    read-only by both roles) and the weight-sync folder on `weights_volume`."""
    manifest = yaml.safe_load((REPO / "examples" / example).read_text())
    manifest["metadata"]["name"] = RUN
    spec = manifest["spec"]
    spec["model"] = f"{DATA_MOUNT}/model"
    spec["dataset"]["path"] = f"{DATA_MOUNT}/{prompts}"
    spec["rollout"]["weightSync"]["volume"] = weights_volume
    for role in ("rollout", "learner"):
        spec[role]["podTemplateOverride"] = {"spec": {
            "volumes": [{"name": "data", **data_volume}],
            "containers": [{"name": role, "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT,
                                                             "readOnly": True}]}]}}
    return manifest


def _json_objects(text: str) -> list[dict]:
    """The objects of a `kubectl get -w -o json` stream (one pretty-printed object after another)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while (at := _skip_space(text, at)) < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break  # the last object, cut off where the watch stopped
        objects.append(value)
    return objects


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


@dataclass
class PodHistory:
    """Every version of the run's pods the API server sent while the run ran (`kubectl get pods -w`): the exits of
    pods the operator deleted and recreated under the same name stay on record, one entry per pod UID."""

    node: Node
    namespace: str
    path: Path
    watch: subprocess.Popen | None = None

    def start(self) -> None:
        self.watch = subprocess.Popen(
            [str(self.node.bin_dir / "kubectl"), f"--kubeconfig={self.node.kubeconfig}", "get", "pods", "-w",
             "-n", self.namespace, "-l", f"{RUN_LABEL}={RUN}", "-o", "json"],
            stdout=self.path.open("w"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.watch is not None and self.watch.poll() is None:
            self.watch.kill()
            self.watch.wait(timeout=10)

    def versions(self) -> list[dict]:
        found = []
        for value in _json_objects(self.path.read_text(errors="replace")):
            found += value.get("items", []) if value.get("kind") == "List" else [value]
        return [o for o in found if o.get("kind", "Pod") == "Pod" and "metadata" in o]

    def exits(self) -> dict[str, dict]:
        """`name/uid` -> the container's terminated state, for each pod whose container ended."""
        ended: dict[str, dict] = {}
        for pod in self.versions():
            for status in pod.get("status", {}).get("containerStatuses", []):
                if "terminated" in status.get("state", {}):
                    ended[f"{pod['metadata']['name']}/{pod['metadata']['uid']}"] = status["state"]["terminated"]
        return ended

    def exits_of(self, name: str) -> list[dict]:
        """The terminated states of the pod `name`'s containers, one per UID it had."""
        return [state for key, state in self.exits().items() if key.startswith(f"{name}/")]

    def uids(self, name: str) -> list[str]:
        """The UIDs the pod `name` had, in the order they appeared."""
        found: list[str] = []
        for pod in self.versions():
            if pod["metadata"]["name"] == name and pod["metadata"]["uid"] not in found:
                found.append(pod["metadata"]["uid"])
        return found

    def containers(self) -> dict[str, dict]:
        """Each pod's latest container status with an ID, and the image its spec names."""
        seen: dict[str, dict] = {}
        for pod in self.versions():
            for status in pod.get("status", {}).get("containerStatuses", []):
                if status.get("containerID"):
                    seen[pod["metadata"]["name"]] = {**status, "podImage": pod["spec"]["containers"][0]["image"]}
        return seen


@dataclass
class NodeRun:
    """The tiny run in `namespace`, applied and watched through the chart's operator."""

    release: OperatorRelease
    namespace: str
    workdir: Path
    history: PodHistory = field(init=False)
    began: float = field(init=False, default=0.0)  # when the run was applied

    def __post_init__(self) -> None:
        self.history = PodHistory(self.release.node, self.namespace, self.workdir / "pods.json")

    @property
    def node(self) -> Node:
        return self.release.node

    def apply(self, manifest: dict) -> None:
        self.history.start()
        self.began = time.monotonic()
        self.node.apply(manifest, namespace=self.namespace)

    def resource(self) -> dict:
        return json.loads(self.node.kubectl("get", "grporun", RUN, "-n", self.namespace, "-o", "json").stdout)

    def status(self) -> dict:
        return self.resource().get("status", {})

    def phase(self) -> str:
        return self.node.kubectl("get", "grporun", RUN, "-n", self.namespace, "-o", "jsonpath={.status.phase}",
                                 check=False).stdout

    def pods(self) -> list[dict]:
        listed = self.node.kubectl("get", "pods", "-n", self.namespace, "-l", f"{RUN_LABEL}={RUN}", "-o", "json",
                                   check=False)
        return json.loads(listed.stdout)["items"] if listed.returncode == 0 else []

    def pod(self, name: str) -> dict | None:
        return next((p for p in self.pods() if p["metadata"]["name"] == name), None)

    def logs(self, pod: str) -> str:
        return self.node.kubectl("logs", pod, "-n", self.namespace, check=False).stdout

    def what_a_user_sees(self) -> str:
        """The run's status, the pods' state (`kubectl describe`), the last lines of each pod's log and the
        operator's."""
        kubectl = self.node.kubectl
        parts = [kubectl("get", "grporun", RUN, "-n", self.namespace, "-o", "jsonpath={.status}", check=False).stdout,
                 kubectl("describe", "pods", "-n", self.namespace, "-l", f"{RUN_LABEL}={RUN}", check=False).stdout,
                 f"containers that ended: {json.dumps(self.history.exits())}"]
        for pod in self.pods():
            name = pod["metadata"]["name"]
            logs = kubectl("logs", name, "-n", self.namespace, f"--tail={LOG_LINES}", check=False)
            parts.append(f"--- kubectl logs {name}\n{logs.stdout}{logs.stderr}")
        for pod in self.release.operator_pods():
            name = pod["metadata"]["name"]
            logs = kubectl("logs", name, "-n", self.release.namespace, f"--tail={LOG_LINES}", check=False)
            parts.append(f"--- operator {name}\n{logs.stdout}{logs.stderr}")
        return "\n".join(parts)

    def wait_for(self, check: Callable[[], Any], what: str, timeout: float = RUN_TIMEOUT_S) -> Any:
        """`check()`'s first true value; an error with what a user would look at once the run Failed or the time
        is up."""
        deadline = time.monotonic() + timeout
        while True:
            # The phase before the check: read after it, a run that failed in between (what a check may wait for)
            # looked like a failure the check had not seen.
            phase = self.phase()
            if value := check():
                return value
            assert phase != "Failed" and time.monotonic() < deadline, (
                f"{what}: not seen in {timeout:.0f} s (run {phase or 'without a phase'})\n{self.what_a_user_sees()}")
            time.sleep(1)

    def wait_for_log(self, pod: str, line: str, timeout: float = RUN_TIMEOUT_S) -> str:
        return self.wait_for(lambda: log if line in (log := self.logs(pod)) else None,
                             f"{pod}'s log showing {line!r}", timeout)

    def wait_succeeded(self) -> dict:
        """`kubectl wait --for=condition=Succeeded` (asserted 0, with what a user would look at otherwise); the
        run's status, checked at the exact epoch bound and shown as such by `kubectl get grporuns`."""
        node = self.node
        wait = subprocess.Popen([str(node.bin_dir / "kubectl"), f"--kubeconfig={node.kubeconfig}", "wait", "-n",
                                 self.namespace, "--for=condition=Succeeded", f"--timeout={RUN_TIMEOUT_S}s",
                                 f"grporun/{RUN}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # A Failed run never becomes Succeeded: stop waiting at once instead of at kubectl wait's timeout.
            while wait.poll() is None and self.phase() != "Failed":
                time.sleep(2)
        finally:
            if wait.poll() is None:
                wait.kill()
            waited = wait.communicate()[0]
        node.report(f"tiny run in {self.namespace}: {time.monotonic() - self.began:.1f} s from apply to Succeeded")
        assert wait.returncode == 0, f"kubectl wait exited {wait.returncode}: {waited}\n{self.what_a_user_sees()}"
        status = self.status()
        progress = status["progress"]
        assert status["phase"] == "Succeeded" and progress["groupsConsumed"] == progress["groupsTotal"], status
        table = node.kubectl("get", "grporuns", "-n", self.namespace).stdout.splitlines()
        assert table[0].split()[:4] == ["NAME", "PHASE", "PROGRESS", "EPOCH"] and table[1].split()[:3] == [
            RUN, "Succeeded", "100"], table
        return status

    def close(self) -> None:
        """Stop watching, keep the log of every pod still there in `workdir/logs/` (the namespace's deletion takes
        them with it, and a check after the run may need them), and delete the namespace."""
        self.history.stop()
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        for pod in self.pods():
            name = pod["metadata"]["name"]
            (logs / f"{name}.log").write_text(self.logs(name))
        self.node.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)


READER_SCRIPT = REPO / "tests" / "support" / "node" / "exported_model_reader.py"
READER_POD = "model-reader"
READER_TIMEOUT_S = 900


#: The Secret that gives a run's pods the test S3 server's keys.
STORE_SECRET = "tiny-store"


def store_access(node: Node, namespace: str, s3_server: S3Server) -> dict:
    """A Secret with the S3 server's keys in `namespace`; the store's fields of spec.inputs, spec.output and
    spec.checkpoint that reach the server from the node's pods."""
    keys = s3_server.env()
    node.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": STORE_SECRET, "namespace": namespace},
                "stringData": {name: keys[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}})
    return {"credentialsSecret": STORE_SECRET, "endpoint": f"http://{node.expose(s3_server.port)}"}


def read_exported_model(release: OperatorRelease, namespace: str, claim: str, folder: str) -> dict:
    """A pod of the user's own, apart from the run: it mounts `claim` read-only and, from the trainer image, checks
    the model in `folder` of it against its manifest, loads it with transformers and serves it with the vLLM CPU
    server (tests/support/node/exported_model_reader.py). Its result line, once it Succeeded; its log otherwise."""
    node = release.node
    node.kubectl("create", "configmap", "model-reader", "-n", namespace, f"--from-file={READER_SCRIPT}")
    container = {
        "name": "reader", "image": release.trainer.reference, "imagePullPolicy": "Never",
        "command": ["/opt/learner/bin/python", f"/reader/{READER_SCRIPT.name}", f"/models/{folder}"],
        # The image's user may not write its HOME: caches go to an emptyDir, as the operator's pods do.
        "env": [{"name": "HOME", "value": "/cache"}, {"name": "HF_HOME", "value": "/cache/huggingface"},
                {"name": "HF_HUB_OFFLINE", "value": "1"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "reader", "mountPath": "/reader", "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": "/cache"}]}
    node.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": READER_POD, "namespace": namespace},
                "spec": {"restartPolicy": "Never", "containers": [container],
                         "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                         "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": claim,
                                                                                  "readOnly": True}},
                                     {"name": "reader", "configMap": {"name": "model-reader"}},
                                     {"name": "shm", "emptyDir": {"medium": "Memory"}},
                                     {"name": "cache", "emptyDir": {}}]}})
    began = time.monotonic()
    pod = node.wait_for_pod(namespace, READER_POD, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"),
                            "finished", timeout=READER_TIMEOUT_S)
    logs = node.kubectl("logs", READER_POD, "-n", namespace, check=False)
    node.report(f"model reader pod in {namespace}: {time.monotonic() - began:.1f} s, {pod['status']['phase']}")
    assert pod["status"]["phase"] == "Succeeded", f"{READER_POD} {pod['status']}\n{logs.stdout[-6000:]}{logs.stderr}"
    return reader_result(logs.stdout)


def reader_result(log: str) -> dict:
    """The reader pod's result from its log: the last line that carries the result prefix. The log holds stderr
    too, and a warning may follow the result (multiprocessing's resource tracker, as vLLM's child ends)."""
    lines = [line for line in log.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"no result line in the reader's log:\n{log[-6000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])
