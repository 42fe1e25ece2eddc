"""End to end on a real cluster: kind, the two images built from this checkout, the chart installed with the real
Helm engine, the tiny example run to Succeeded, and the chart's alert rules loaded into a real Prometheus that
scrapes the operator in the cluster.

Needs Docker and kind; skipped, with the reason printed, where either is missing (these project machines have no
Docker engine). The chart, the alerts and the scrape path are also covered without a cluster by
tests/chart/.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.chart_render import CHART_DIR
from tests.support.paths import REPO
from tests.support.ports import free_port
from tests.support.servers.prometheus_harness import Prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLUSTER = "grpo-e2e"
OPERATOR_IMAGE = "grpo-operator:e2e"
TRAINER_IMAGE = "grpo-trainer:cpu"
TINY_IMAGE = "grpo-trainer:tiny-e2e"  # the CPU image plus the tiny example's model and prompts
RELEASE, RELEASE_NAMESPACE = "grpo", "grpo-system"
RUN_NAMESPACE = "default"
TINY_DIR = "/home/grpo/tiny"
RUN_TIMEOUT_S = 1800

TINY_DOCKERFILE = f"""
FROM {TRAINER_IMAGE}
RUN python -m grpo_trainer.testing.tiny_assets {TINY_DIR}/model
COPY examples/tiny-prompts.jsonl {TINY_DIR}/tiny-prompts.jsonl
"""

# Filesystem weight sync needs one directory both pods see: a PVC from kind's local-path provisioner (single node,
# so ReadWriteOnce is enough, and it creates the directory world-writable for the non-root pods).
WEIGHTS_PVC = {
    "apiVersion": "v1", "kind": "PersistentVolumeClaim",
    "metadata": {"name": "tiny-weights", "namespace": RUN_NAMESPACE},
    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
}


def _run(*argv: str, timeout: float = 600, input_text: str | None = None, check: bool = True):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input_text, cwd=REPO)
    if check and result.returncode != 0:
        output = result.stdout[-3000:] + result.stderr[-3000:]
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{output}")
    return result


def _require_docker_and_kind() -> None:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed: the kind e2e suite needs a Docker engine")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"`docker info` failed, no Docker engine to build images or run kind: {reason}")
    if shutil.which("kind") is None:
        pytest.skip("kind is not installed (https://kind.sigs.k8s.io): the e2e suite needs it")
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the e2e suite drives the cluster with it")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_docker_and_kind()
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    _run("kind", "delete", "cluster", "--name", CLUSTER, check=False)
    _run("kind", "create", "cluster", "--name", CLUSTER, "--kubeconfig", str(kubeconfig), "--wait", "180s")
    try:
        yield kubeconfig
    finally:
        _run("kind", "delete", "cluster", "--name", CLUSTER, check=False)


@pytest.fixture(scope="module")
def images(cluster):
    _run("docker", "build", "-t", OPERATOR_IMAGE, ".", timeout=1800)
    _run("docker", "build", "-f", "trainer_image/Dockerfile", "--build-arg", "VARIANT=cpu", "-t", TRAINER_IMAGE, ".",
         timeout=3600)
    _run("docker", "build", "-t", TINY_IMAGE, "-f", "-", ".", input_text=TINY_DOCKERFILE, timeout=1800)
    _run("kind", "load", "docker-image", OPERATOR_IMAGE, TINY_IMAGE, "--name", CLUSTER, timeout=1800)


def _kubectl(kubeconfig: Path, *args: str, **kwargs):
    return _run("kubectl", f"--kubeconfig={kubeconfig}", *args, **kwargs)


def _tiny_run() -> dict:
    run = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    run["metadata"]["namespace"] = RUN_NAMESPACE
    run["spec"]["model"] = f"{TINY_DIR}/model"
    run["spec"]["dataset"]["path"] = f"{TINY_DIR}/tiny-prompts.jsonl"
    run["spec"]["rollout"]["weightSync"]["volume"] = {"persistentVolumeClaim": {"claimName": "tiny-weights"}}
    return run


def test_helm_install_runs_the_tiny_example_to_succeeded(cluster, images):
    import helm_python as helm

    kubeconfig = cluster
    repository, tag = OPERATOR_IMAGE.split(":")
    trainer_repository, trainer_tag = TINY_IMAGE.split(":")
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "trainerImage": {"repository": trainer_repository, "tag": trainer_tag},
    }
    config = helm.Config(kubeconfig_path=kubeconfig, namespace=RELEASE_NAMESPACE)
    try:
        release = config.install(str(CHART_DIR), RELEASE, values, namespace=RELEASE_NAMESPACE, create_namespace=True,
                                 wait="watcher", timeout=300)
    finally:
        config.close()
    print(f"installed {RELEASE}: {release}")
    _kubectl(kubeconfig, "get", "crd", "grporuns.grpo.dev")

    _kubectl(kubeconfig, "apply", "-f", "-", input_text=json.dumps(WEIGHTS_PVC))
    run = _tiny_run()
    _kubectl(kubeconfig, "apply", "--server-side", "-f", "-", input_text=json.dumps(run))
    name = run["metadata"]["name"]
    waited = _kubectl(kubeconfig, "-n", RUN_NAMESPACE, "wait", "--for=condition=Succeeded", f"grporun/{name}",
                      f"--timeout={RUN_TIMEOUT_S}s", timeout=RUN_TIMEOUT_S + 60, check=False)
    status = _kubectl(kubeconfig, "-n", RUN_NAMESPACE, "get", "grporun", name, "-o", "json").stdout
    if waited.returncode != 0:
        pods = _kubectl(kubeconfig, "-n", RUN_NAMESPACE, "get", "pods", "-o", "wide", check=False).stdout
        logs = _kubectl(kubeconfig, "-n", RELEASE_NAMESPACE, "logs", "deployment/grpo-grpo-operator", "--tail=200",
                        check=False).stdout
        pytest.fail(f"run did not succeed: {waited.stderr}\nstatus: {status}\npods:\n{pods}\noperator log:\n{logs}")
    progress = json.loads(status)["status"]["progress"]
    assert progress["groupsTrained"] > 0


def test_alert_rules_load_and_see_the_operator(cluster, images, tmp_path):
    """A Prometheus outside the cluster loads the chart's rules and scrapes the operator through a port-forward."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`)")
    local_port = free_port()
    forward = subprocess.Popen(
        ["kubectl", f"--kubeconfig={cluster}", "-n", RELEASE_NAMESPACE, "port-forward",
         f"service/{RELEASE}-grpo-operator-metrics", f"{local_port}:8080"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prometheus = Prometheus(binary, tmp_path, {"grpo-operator-metrics": (f"127.0.0.1:{local_port}", {})})
    try:
        prometheus.wait_ready()
        url = f"http://127.0.0.1:{prometheus.port}/api/v1/rules?" + urllib.parse.urlencode({"type": "alert"})
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(url, timeout=5) as response:
                groups = json.loads(response.read())["data"]["groups"]
            names = {rule["name"] for group in groups for rule in group["rules"]}
            if names or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert names == {"GRPORunStalled", "GRPORunNoProgress", "GRPORunRolloutNotReady", "GRPORunFailed",
                         "GRPOOperatorDown"}
        prometheus.wait_for('up{job="grpo-operator-metrics"} == 1', bool, timeout=60)
        prometheus.wait_for('grpo_operator_run_phase{run="tiny", phase="Succeeded"} == 1', bool, timeout=60)
    finally:
        prometheus.stop()
        forward.terminate()
        forward.wait(timeout=10)
