"""The shipped tiny run on the real node, from the user's side: `kubectl apply` of examples/tiny.yaml, the operator
the chart installed (tests/support/operator_release.py), rollout and learner pods run as containers from the trainer
image, and `kubectl wait --for=condition=Succeeded`.

The manifest is the shipped one with what a cluster needs instead of `grporun local`'s relative paths: the model and
prompts on a read-only volume both roles mount (`podTemplateOverride`), and a volume for the filesystem weight sync
(`rollout.weightSync.volume`). The pods run as a non-root user that owns none of the node's files, so the test makes
the model readable and the weight-sync folder writable by any user, as a user preparing a hostPath would.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from grpo_operator.api import RUN_LABEL
from tests.support.node import Node
from tests.support.operator_release import OperatorRelease
from tests.support.paths import REPO

pytestmark = [pytest.mark.node, pytest.mark.slow]

RUN = "tiny"
DATA_MOUNT = "/data"
RUN_TIMEOUT_S = 900
LOG_LINES = 40

_names = itertools.count()


def shared_folder(folder: Path, *, writable: bool) -> Path:
    """A folder a pod's non-root user can read (and, when `writable`, write): what the node's root makes for it."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o777 if writable and path.is_dir() else 0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_model_dir: str) -> Path:
    """The model and the prompts, in one folder readable by the pods' user."""
    data = tmp_path_factory.mktemp("tiny-data")
    shutil.copytree(tiny_model_dir, data / "model")
    shutil.copy(REPO / "examples" / "tiny-prompts.jsonl", data / "tiny-prompts.jsonl")
    return shared_folder(data, writable=False)


def tiny_manifest(data_volume: dict, weights_volume: dict) -> dict:
    """examples/tiny.yaml with the model and prompts at DATA_MOUNT (from `data_volume`, mounted read-only by both
    roles) and the weight-sync folder on `weights_volume`."""
    manifest = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec = manifest["spec"]
    spec["model"] = f"{DATA_MOUNT}/model"
    spec["dataset"]["path"] = f"{DATA_MOUNT}/tiny-prompts.jsonl"
    spec["rollout"]["weightSync"]["volume"] = weights_volume
    for role in ("rollout", "learner"):
        spec[role]["podTemplateOverride"] = {"spec": {
            "volumes": [{"name": "data", **data_volume}],
            "containers": [{"name": role, "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT,
                                                             "readOnly": True}]}]}}
    return manifest


def run_pods(node: Node, namespace: str) -> list[dict]:
    listed = node.kubectl("get", "pods", "-n", namespace, "-l", f"{RUN_LABEL}={RUN}", "-o", "json", check=False)
    return json.loads(listed.stdout)["items"] if listed.returncode == 0 else []


def run_phase(node: Node, namespace: str) -> str:
    return node.kubectl("get", "grporun", RUN, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False).stdout


def what_a_user_sees(release: OperatorRelease, namespace: str) -> str:
    """The run's status, the pods' state (`kubectl describe`), the last lines of each pod's log and the operator's."""
    node = release.node
    parts = [node.kubectl("get", "grporun", RUN, "-n", namespace, "-o", "jsonpath={.status}", check=False).stdout,
             node.kubectl("describe", "pods", "-n", namespace, "-l", f"{RUN_LABEL}={RUN}", check=False).stdout]
    for pod in run_pods(node, namespace):
        name = pod["metadata"]["name"]
        logs = node.kubectl("logs", name, "-n", namespace, f"--tail={LOG_LINES}", check=False)
        parts.append(f"--- kubectl logs {name}\n{logs.stdout}{logs.stderr}")
    for pod in release.operator_pods():
        name = pod["metadata"]["name"]
        logs = node.kubectl("logs", name, "-n", release.namespace, f"--tail={LOG_LINES}", check=False)
        parts.append(f"--- operator {name}\n{logs.stdout}{logs.stderr}")
    return "\n".join(parts)


def containers_seen(pods: list[dict], seen: dict[str, dict]) -> None:
    """Each pod's container status, the latest one seen (the operator deletes a finished run's pods)."""
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses", []):
            if status.get("containerID"):
                seen[pod["metadata"]["name"]] = {**status, "podImage": pod["spec"]["containers"][0]["image"]}


def run_to_succeeded(release: OperatorRelease, namespace: str, manifest: dict) -> dict[str, dict]:
    """`kubectl apply` of the run and `kubectl wait` for its Succeeded condition (asserted 0, with what a user would
    look at otherwise); the containers its pods ran as, seen while it ran."""
    node = release.node
    began = time.monotonic()
    node.apply(manifest, namespace=namespace)
    wait = subprocess.Popen([str(node.bin_dir / "kubectl"), f"--kubeconfig={node.kubeconfig}", "wait", "-n", namespace,
                             "--for=condition=Succeeded", f"--timeout={RUN_TIMEOUT_S}s", f"grporun/{RUN}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, dict] = {}
    try:
        # A Failed run never becomes Succeeded: stop waiting at once instead of at kubectl wait's timeout.
        while wait.poll() is None and run_phase(node, namespace) != "Failed":
            containers_seen(run_pods(node, namespace), seen)
            time.sleep(2)
    finally:
        if wait.poll() is None:
            wait.kill()
        waited = wait.communicate()[0]
    containers_seen(run_pods(node, namespace), seen)
    node.report(f"tiny run in {namespace}: {time.monotonic() - began:.1f} s from apply to Succeeded")
    # The containers' last states as seen while they ran: a failed run's pods may be gone by now.
    states = {name: status.get("state") for name, status in seen.items()}
    assert wait.returncode == 0, (f"kubectl wait exited {wait.returncode}: {waited}\n"
                                  f"containers last seen: {json.dumps(states)}\n{what_a_user_sees(release, namespace)}")
    run = json.loads(node.kubectl("get", "grporun", RUN, "-n", namespace, "-o", "json").stdout)
    progress = run["status"]["progress"]
    assert run["status"]["phase"] == "Succeeded" and progress["groupsConsumed"] == progress["groupsTotal"], (
        run["status"])
    table = node.kubectl("get", "grporuns", "-n", namespace).stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "PHASE", "PROGRESS", "EPOCH"] and table[1].split()[:3] == [
        RUN, "Succeeded", "100"], table
    return seen


def test_the_tiny_run_succeeds_on_the_node_from_the_trainer_image(operator_release: OperatorRelease,
                                                                  tiny_data: Path, tmp_path: Path):
    node = operator_release.node
    namespace = node.create_namespace(f"tiny-{next(_names)}")
    weights = shared_folder(tmp_path / "weights", writable=True)
    manifest = tiny_manifest({"hostPath": {"path": str(tiny_data), "type": "Directory"}},
                             {"hostPath": {"path": str(weights), "type": "Directory"}})
    try:
        seen = run_to_succeeded(operator_release, namespace, manifest)
    finally:
        node.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    roles = {name.rsplit("-", 2)[-2] for name in seen}
    assert roles == {"rollout", "learner"}, seen
    for name, status in sorted(seen.items()):
        node.report(f"pod {name} ran as {status['containerID']}, image {status['image']}, imageID {status['imageID']}")
        assert status["containerID"].startswith("containerd://"), status
        assert status["podImage"] == operator_release.trainer.reference, status


def claimed_folder(node: Node, namespace: str, name: str, folder: Path) -> dict:
    """`folder` as a PersistentVolume (hostPath, made by the cluster's admin) and a claim on it in `namespace`, bound
    by the controller-manager's binder: the pod sees only the claim, which the restricted policy admits. Returns
    the pod's volume source for the claim."""
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{name}"},
              "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                       "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "manual",
                       "claimRef": {"namespace": namespace, "name": name},
                       "hostPath": {"path": str(folder), "type": "Directory"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "manual",
                      "volumeName": f"{namespace}-{name}", "resources": {"requests": {"storage": "1Gi"}}}}
    node.apply(volume, claim)
    node.kubectl("wait", "-n", namespace, "--for=jsonpath={.status.phase}=Bound", f"pvc/{name}", "--timeout=60s")
    return {"persistentVolumeClaim": {"claimName": name}}


def test_the_tiny_run_succeeds_in_a_restricted_namespace(operator_release: OperatorRelease, tiny_data: Path,
                                                         tmp_path: Path):
    """Both roles pass the `restricted` Pod Security Standard, which refuses hostPath volumes: the model and the
    weight-sync folder come from PersistentVolumeClaims. Two epochs instead of twelve: what this test adds is
    admission and the claims, not a longer run."""
    node = operator_release.node
    namespace = node.create_namespace(f"tiny-restricted-{next(_names)}",
                                      labels={"pod-security.kubernetes.io/enforce": "restricted"})
    weights = shared_folder(tmp_path / "weights", writable=True)
    try:
        data_claim = claimed_folder(node, namespace, "tiny-data", tiny_data)
        data_claim["persistentVolumeClaim"]["readOnly"] = True
        manifest = tiny_manifest(data_claim, claimed_folder(node, namespace, "tiny-weights", weights))
        manifest["spec"]["training"]["epochs"] = 2
        seen = run_to_succeeded(operator_release, namespace, manifest)
    finally:
        node.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for name in ("tiny-data", "tiny-weights"):
            node.kubectl("delete", "persistentvolume", f"{namespace}-{name}", "--wait=false", check=False)
    assert {name.rsplit("-", 2)[-2] for name in seen} == {"rollout", "learner"}, seen
