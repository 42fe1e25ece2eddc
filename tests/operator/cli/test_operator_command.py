"""`grporun operator`: its flags accept what the Helm chart passes, and the liveness probe answers through kopf."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grpo_operator.cli import operator_command as main
from grpo_operator.metric_names import RECONCILE_SECONDS
from tests.support.chart_render import objects_of_kind, render_objects
from tests.support.ports import free_port


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("values", [{"watch": {"allNamespaces": True}},
                                    {"watch": {"allNamespaces": False, "namespaces": ["a", "b"]}}])
def test_the_charts_container_args_parse(values):
    deployment = objects_of_kind(render_objects(values), "Deployment")[0]
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    assert operator["command"] == ["grporun"] and operator["args"][0] == "operator"
    args = parse(operator["args"][1:])
    if values["watch"]["allNamespaces"]:
        assert args.all_namespaces is True and args.namespace == []
    else:
        assert args.namespace == ["a", "b"] and not args.all_namespaces
    assert args.liveness.endswith("/healthz") and args.metrics_port > 0


def test_a_namespace_scope_is_required():
    assert main.main(parse([])) == 2
    with pytest.raises(SystemExit):
        parse(["--namespace", "a", "--all-namespaces"])


@pytest.mark.slow
def test_the_liveness_probe_answers_through_kopf(cluster):
    port = free_port()
    cluster.stop_operator()
    cluster.start_operator(liveness_endpoint=f"http://127.0.0.1:{port}/healthz")
    response = cluster.wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz"), what="the liveness endpoint")
    assert response.status_code == 200 and response.json() == {"runs": 0}


def _get(url: str) -> requests.Response | None:
    try:
        return requests.get(url, timeout=2)
    except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy
        return None


#: The passes of a new run by which the operator has created its pods: it creates them in its first (a pass writes the
#: status, then acts), and a pass may begin before the pod index has caught up with the run.
PASSES_TO_CREATE = 3
#: The chart's operator pod sets no terminationGracePeriodSeconds: Kubernetes' default, after which the kubelet kills
#: it. The operator must exit on SIGTERM within it.
DEFAULT_TERMINATION_GRACE_S = 30


@pytest.mark.slow
def test_grporun_operator_runs_from_a_kubeconfig_serves_metrics_and_stops_on_sigterm(tmp_path):
    """The real command line in its own process: kopf's default login (kubeconfig), the metrics server, SIGTERM."""
    import signal

    from tests.support.emulator.kube_emulator import GRPORUNS, PODS, KubeClient
    from tests.support.specs import grporun

    emulator = _emulator(with_crd=True)
    kubeconfig = _kubeconfig(tmp_path, emulator.url)
    metrics_port, liveness_port = free_port(), free_port()
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo_operator.cli", "operator", "--namespace", "default",
             "--metrics-port", str(metrics_port), "--liveness-port", str(liveness_port), "--reconcile-interval", "0.2",
             "--trainer-image", "grpo-trainer:cli"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        client = KubeClient(emulator.url)
        client.create(GRPORUNS, "default", grporun("cli"))
        # Its start-up (imports, the API server and CRD checks, kopf's start) ends when its liveness endpoint answers:
        # a minute on a loaded machine. Then the run's pods, by the operator's own passes over it.
        _wait_until_serving(process, liveness_port, log)
        while len(client.list(PODS, "default", "grpo.dev/run=cli")) < 2:
            assert process.poll() is None, f"the operator exited: {log.read_text()[-3000:]}"
            passes = _passes(metrics_port)
            assert passes < PASSES_TO_CREATE, (f"the operator created no pods in {passes} passes; the run's status: "
                                               f"{client.get(GRPORUNS, 'default', 'cli').get('status')}; "
                                               f"its log: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        images = {p["spec"]["containers"][0]["image"] for p in client.list(PODS, "default")}
        assert images == {"grpo-trainer:cli"}
        # The pass that created the pods publishes the run's series when it ends, after its actions: one pass more
        # than were counted once the pods were seen.
        seen_at = _passes(metrics_port)
        while _passes(metrics_port) <= seen_at:
            assert process.poll() is None, f"the operator exited: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        metrics = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'grpo_operator_run_info{model="/models/tiny",namespace="default",run="cli"} 1.0' in metrics
        assert requests.get(f"http://127.0.0.1:{liveness_port}/healthz", timeout=5).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(DEFAULT_TERMINATION_GRACE_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
        emulator.stop()


def _wait_until_serving(process: subprocess.Popen, liveness_port: int, log: Path) -> None:
    """Until the operator's liveness endpoint answers; its exit ends the wait with its log."""
    while (response := _get(f"http://127.0.0.1:{liveness_port}/healthz")) is None or response.status_code != 200:
        assert process.poll() is None, f"the operator exited while starting: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def _passes(metrics_port: int) -> int:
    """The reconcile passes the operator has made, from its metrics (0 before its metrics server answers)."""
    response = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    if response is None:
        return 0
    for family in text_string_to_metric_families(response.text):
        if family.name == RECONCILE_SECONDS:
            return int(sum(sample.value for sample in family.samples if sample.name.endswith("_count")))
    return 0


def _emulator(*, with_crd: bool):
    from tests.support.emulator.kube_emulator import DEFAULT_RESOURCES, EmulatorThread, KubeClient, KubeEmulator
    from tests.support.emulator.operator_fixtures import CRDS
    from tests.support.paths import REPO

    emulator = EmulatorThread(KubeEmulator(resources=DEFAULT_RESOURCES + (CRDS,))).start()
    if with_crd:
        KubeClient(emulator.url).create(CRDS, None, yaml.safe_load((REPO / "crds" / "grporun.yaml").read_text()))
    return emulator


def _kubeconfig(tmp_path, server: str):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "t"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}]}))
    return kubeconfig


def _operator(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The operator's start, which ends in an error: its exit is the wait's end (a minute on a loaded machine, most of
    it imports); a hang is the test timeout's."""
    clean = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return subprocess.run([sys.executable, "-m", "grpo_operator.cli", "operator", "-A", "--metrics-port", "0"],
                          env={**clean, **env}, capture_output=True, text=True)


@pytest.mark.slow
def test_without_credentials_the_operator_says_where_it_looked_in_one_line(tmp_path):
    result = _operator({"HOME": str(tmp_path)})
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "in-cluster service account" in line and "$KUBECONFIG" in line and "~/.kube/config" in line


@pytest.mark.slow
def test_an_unreachable_api_server_is_one_line(tmp_path):
    kubeconfig = _kubeconfig(tmp_path, f"http://127.0.0.1:{free_port()}")
    result = _operator({"HOME": str(tmp_path), "KUBECONFIG": str(kubeconfig)})
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "cannot reach the API server" in line and str(kubeconfig) in line


@pytest.mark.slow
def test_a_cluster_without_the_crd_names_the_command_that_installs_it(tmp_path):
    emulator = _emulator(with_crd=False)
    try:
        result = _operator({"HOME": str(tmp_path), "KUBECONFIG": str(_kubeconfig(tmp_path, emulator.url))})
    finally:
        emulator.stop()
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "grporuns.grpo.dev" in line and "kubectl apply --server-side -f crds/grporun.yaml" in line
