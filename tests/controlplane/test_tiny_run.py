"""The whole tiny run through the real API server: `kubectl apply` of examples/tiny.yaml, the real operator (as the
chart's ServiceAccount), pods run by the process kubelet (a real vLLM CPU server and the real learner, each in its
own network namespace) and `kubectl wait --for=condition=Succeeded`.

The manifest is the shipped one with what a cluster needs instead of `grporun local`'s relative paths: the model
and prompts at absolute paths (the process kubelet shares the host's files), and a hostPath volume both roles mount
for the filesystem weight sync (`rollout.weightSync.volume`, docs/limits.md).
"""

from __future__ import annotations

import pytest
import yaml

from grpo_operator.reconcile import OperatorContext
from tests.support.control_plane_client import kubectl
from tests.support.control_plane_cluster import AccountOperatorThread
from tests.support.pod_network import unavailable_reason
from tests.support.process_kubelet import REPO, ProcessKubelet
from tests.support.vllm_server import require_rollout_python

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.vllm]


def test_the_tiny_example_succeeds_through_the_real_api_server(control_plane, admin, operator_account, namespace,
                                                               tiny_model_dir, tmp_path):
    require_rollout_python()
    why = unavailable_reason()
    if why:
        pytest.skip(f"the process kubelet needs network namespaces: {why}")
    manifest = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    manifest["spec"]["model"] = tiny_model_dir
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    manifest["spec"]["rollout"]["weightSync"]["volume"] = {"hostPath": {"path": str(tmp_path / "weights")}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(manifest))
    kubelet = ProcessKubelet(admin, namespace, tmp_path / "pods", node=f"node-{namespace}").start()
    operator = AccountOperatorThread(control_plane, operator_account.token,
                                     OperatorContext(trainer_image="grpo-trainer:cpu", reconcile_interval=1.0)).start()
    config = control_plane.kubeconfig
    try:
        kubectl(control_plane, config, "apply", "--server-side", "-n", namespace, "-f", str(path))
        waited = kubectl(control_plane, config, "wait", "-n", namespace, "--for=condition=Succeeded",
                         "--timeout=900s", "grporun/tiny", check=False, timeout=960)
        status = admin.call("GET", f"/apis/grpo.dev/v1alpha1/namespaces/{namespace}/grporuns/tiny")
        logs = {p.name: (p / "container.log").read_text(errors="replace")[-3000:] for p in kubelet.workdir.iterdir()}
        assert waited.returncode == 0, (status.get("status"), logs, kubelet.errors)
        progress = status["status"]["progress"]
        assert status["status"]["phase"] == "Succeeded" and progress["groupsConsumed"] == progress["groupsTotal"]
        table = kubectl(control_plane, config, "get", "grporuns", "-n", namespace).stdout.splitlines()
        assert table[1].split()[:3] == ["tiny", "Succeeded", "100"]
    finally:
        operator.stop()
        kubelet.stop()
    assert kubelet.errors == []
