"""The shipped tiny run on the real node, from the user's side: `kubectl apply` of examples/tiny.yaml into a
namespace that enforces the `restricted` Pod Security Standard, the operator the chart installed
(tests/support/operator_release.py), rollout and learner pods run as containers from the trainer image, and
`kubectl wait --for=condition=Succeeded`. The restricted policy refuses hostPath volumes, so the model and the
weight-sync folder come from PersistentVolumeClaims, as a cluster's admin would provide them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.node import Node
from tests.support.node_runs import NodeRun, shared_folder, tiny_manifest
from tests.support.operator_release import OperatorRelease

pytestmark = [pytest.mark.node, pytest.mark.slow]


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


def test_the_tiny_run_succeeds_in_a_restricted_namespace_from_the_trainer_image(operator_release: OperatorRelease,
                                                                               tiny_data: Path, tmp_path: Path):
    node = operator_release.node
    namespace = node.create_namespace("tiny-restricted", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    run = NodeRun(operator_release, namespace, tmp_path)
    weights = shared_folder(tmp_path / "weights", writable=True)
    try:
        data_claim = claimed_folder(node, namespace, "tiny-data", tiny_data)
        data_claim["persistentVolumeClaim"]["readOnly"] = True
        manifest = tiny_manifest(data_claim, claimed_folder(node, namespace, "tiny-weights", weights))
        manifest["spec"]["training"]["epochs"] = 2  # the runs of test_run_faults.py go the full twelve
        run.apply(manifest)
        run.wait_succeeded()
    finally:
        run.close()
        for name in ("tiny-data", "tiny-weights"):
            node.kubectl("delete", "persistentvolume", f"{namespace}-{name}", "--wait=false", check=False)
    seen = run.history.containers()
    assert {name.rsplit("-", 2)[-2] for name in seen} == {"rollout", "learner"}, seen  # both roles admitted
    for name, status in sorted(seen.items()):
        node.report(f"pod {name} ran as {status['containerID']}, image {status['image']}, imageID {status['imageID']}")
        assert status["containerID"].startswith("containerd://"), status
        assert status["podImage"] == operator_release.trainer.reference, status
