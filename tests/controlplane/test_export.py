"""`grporun export --cluster` against the real kube-apiserver: the command (a real process, with a kubeconfig) reads
the run, refuses one still running, creates the export pod, follows it and records its report on status.output.

There is no kubelet in this tier: the test plays its part. It runs the pod's own command (`python -m grpo_trainer
export`) here, on the run config the operator's builder renders (its folders moved under the test's), and gives the
pod the termination message that command left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_operator import builders
from grpo_operator.api import parse_spec
from grpo_operator.run_ref import RunRef
from grpo_trainer.contract.codes import EXIT_EXPORT_FAILED, EXIT_SUCCEEDED
from grpo_trainer.contract.config import load_run_config
from tests.support.controlplane.control_plane import ADMIN_TOKEN
from tests.support.emulator.kube_emulator import GRPORUNS, PODS
from tests.support.specs import minimal_spec
from tests.trainer.storage.test_reexport import checkpoint

pytestmark = pytest.mark.controlplane

#: How long the test waits for the command to create its pod or to end.
WAIT_S = 60.0


def _grporun_export(kubeconfig: Path, namespace: str, run: str) -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.Popen([sys.executable, "-m", "grpo_operator.cli", "export", "--cluster", "-n", namespace, run],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_pod(admin, namespace: str, name: str, command: subprocess.Popen) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pod = admin.get(PODS, namespace, name)
        if pod is not None:
            return pod
        if command.poll() is not None:
            pytest.fail(f"grporun export ended ({command.returncode}) without a pod: {command.communicate()}")
        time.sleep(0.2)
    command.kill()
    pytest.fail(f"no pod {name} after {WAIT_S}s: {command.communicate()}")


def _play_kubelet(admin, namespace: str, pod: dict, phase: str, exit_code: int, message: str) -> None:
    container = pod["spec"]["containers"][0]
    status = {"phase": phase, "containerStatuses": [{
        "name": container["name"], "image": container["image"], "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                 "message": message}}}]}
    admin.patch(PODS, namespace, pod["metadata"]["name"], {"status": status}, subresource="status")


def _run_pods_command(pod: dict, config_map: dict, tmp_path: Path) -> tuple[int, str]:
    """The pod's command, run here on its run config with the pod's folders under `tmp_path`; its exit code and
    the termination message it left."""
    config = load_run_config(config_map["data"][builders.CONFIG_FILE])
    message = tmp_path / "termination-log"
    message.unlink(missing_ok=True)
    assert config.output is not None
    config = config.model_copy(update={
        "termination_message_path": str(message),
        "checkpoint": config.checkpoint.model_copy(update={"directory": str(tmp_path / "checkpoints")}),
        "output": config.output.model_copy(update={"directory": str(tmp_path / "model")}),
    })
    (tmp_path / "run.json").write_text(config.model_dump_json(by_alias=True))
    command = pod["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "grpo_trainer", "export"]
    argv = [*command[3:command.index("--config") + 1], str(tmp_path / "run.json")]
    done = subprocess.run([sys.executable, "-m", "grpo_trainer", *argv], capture_output=True, text=True, timeout=120)
    return done.returncode, message.read_text()


def test_grporun_export_cluster_exports_in_a_pod_and_records_status_output(control_plane, admin, namespace,
                                                                            tiny_model_dir, tmp_path):
    kubeconfig = control_plane.write_kubeconfig(tmp_path / "admin.kubeconfig", ADMIN_TOKEN)
    spec = minimal_spec(output={"volume": {"persistentVolumeClaim": {"claimName": "models"}}},
                        checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "checkpoints"}}})
    run = admin.create(GRPORUNS, namespace, {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
                                             "metadata": {"name": "tiny"}, "spec": spec})
    ref = RunRef.of(run["metadata"])
    config_map = builders.build_config_map(ref, parse_spec(spec))
    admin.call("POST", f"/api/v1/namespaces/{namespace}/configmaps", json=config_map)

    admin.patch(GRPORUNS, namespace, "tiny", {"status": {"phase": "Running"}}, subresource="status")
    command = _grporun_export(kubeconfig, namespace, "tiny")
    out, err = command.communicate(timeout=WAIT_S)
    assert command.returncode == 1 and out == ""
    assert err.startswith(f"grporun export: GRPORun {namespace}/tiny: the run is Running: export it once it has "
                          "ended") and err.count("\n") == 1

    admin.patch(GRPORUNS, namespace, "tiny", {"status": {"phase": "Failed"}}, subresource="status")
    # No checkpoint yet: the export pod fails, and the command names why.
    command = _grporun_export(kubeconfig, namespace, "tiny")
    pod = _wait_for_pod(admin, namespace, "tiny-export", command)
    assert pod["metadata"]["ownerReferences"][0]["uid"] == ref.uid
    code, message = _run_pods_command(pod, config_map, tmp_path)
    assert code == EXIT_EXPORT_FAILED
    _play_kubelet(admin, namespace, pod, "Failed", code, message)
    out, err = command.communicate(timeout=WAIT_S)
    assert command.returncode == 1, (out, err)
    assert "pod tiny-export: Pending" in out
    assert err.startswith("grporun export: pod tiny-export: the export failed: grpo export: checkpoint.directory ")
    assert err.rstrip().endswith("no complete checkpoint to export the model from")
    assert "output" not in (admin.get(GRPORUNS, namespace, "tiny").get("status") or {})

    # With checkpoints: the earlier pod is replaced, the model exported, its report recorded.
    checkpoint(tmp_path / "checkpoints", Path(tiny_model_dir), 4)
    checkpoint(tmp_path / "checkpoints", Path(tiny_model_dir), 8)
    command = _grporun_export(kubeconfig, namespace, "tiny")
    deadline = time.monotonic() + WAIT_S
    while (pod := _wait_for_pod(admin, namespace, "tiny-export", command)).get("status", {}).get("phase") != "Pending":
        assert time.monotonic() < deadline, "the earlier export pod was not replaced"
        time.sleep(0.2)
    code, message = _run_pods_command(pod, config_map, tmp_path)
    assert code == EXIT_SUCCEEDED
    _play_kubelet(admin, namespace, pod, "Succeeded", code, message)
    out, err = command.communicate(timeout=WAIT_S)
    assert command.returncode == 0, (out, err)
    report = json.loads(message)
    output = admin.get(GRPORUNS, namespace, "tiny")["status"]["output"]
    assert output["uri"] == report["uri"] == "pvc://models/tiny"
    assert (output["step"], output["sha256"], output["bytes"]) == (8, report["sha256"], report["bytes"])
    assert out.rstrip().endswith(f"model: pvc://models/tiny (step 8, {report['bytes']} bytes, manifest sha256 "
                                 f"{report['sha256']}); recorded on GRPORun {namespace}/tiny status.output")
    assert admin.get(GRPORUNS, namespace, "tiny")["status"]["phase"] == "Failed"
