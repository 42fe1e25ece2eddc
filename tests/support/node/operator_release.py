"""The chart installed on the real node with the helm CLI (hack/k8s/build.sh helm), running the operator image
(tests/support/node/images.py): the operator the node scenarios run against, in its container, with the chart's
ServiceAccount and RBAC, reaching the API server through the `kubernetes` Service as any in-cluster client does.
The release's `trainerImage` is the trainer image's CPU variant, imported into the node beside the operator's: the
runs' rollout and learner pods run from it.

`operator_release` is a session fixture: installed once (`helm install --wait`), uninstalled at the end, when it
checks that `helm uninstall` left none of the release's objects behind (an error of the last test otherwise).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.builds import Build
from tests.support.chart_render import CHART_DIR, RELEASE, RELEASE_NAMESPACE
from tests.support.controlplane.control_plane import k8s_build
from tests.support.node.images import BuiltImage
from tests.support.node.node import Node

HELM_BUILD = "helm"  # hack/k8s/build.sh's set, and its name in hack/lib/build-times
INSTANCE_LABEL = f"app.kubernetes.io/instance={RELEASE}"
# Every kind the chart makes (namespaced ones in the release namespace), for the after-uninstall check.
CHART_KINDS = ("deployments", "replicasets", "pods", "serviceaccounts", "services", "configmaps", "roles",
               "rolebindings", "poddisruptionbudgets", "clusterroles", "clusterrolebindings",
               "validatingadmissionpolicies", "validatingadmissionpolicybindings")


def helm_build() -> Build:
    """hack/k8s/build.sh helm (not started), which prints the folder holding `helm`."""
    return k8s_build(HELM_BUILD, "the helm CLI is")


@dataclass
class OperatorRelease:
    node: Node
    helm: Path
    image: BuiltImage
    trainer: BuiltImage
    namespace: str = RELEASE_NAMESPACE
    install_s: float = 0.0

    def run_helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.helm), f"--kubeconfig={self.node.kubeconfig}", *args], capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}")
        return done

    def install(self) -> None:
        repository, tag = self.image.reference.rsplit(":", 1)
        trainer_repository, trainer_tag = self.trainer.reference.rsplit(":", 1)
        values = ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                  "--set", "image.pullPolicy=Never", "--set", f"trainerImage.repository={trainer_repository}",
                  "--set-string", f"trainerImage.tag={trainer_tag}"]
        began = time.monotonic()
        try:
            self.run_helm("install", RELEASE, str(CHART_DIR), "--namespace", self.namespace, "--create-namespace",
                          "--wait", "--timeout=5m", *values)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.operator_diagnosis()}") from None
        self.install_s = time.monotonic() - began

    def operator_diagnosis(self) -> str:
        """What a failed install leaves to read: the operator pods' description (conditions, probes, the kubelet's
        events) and their logs, the previous container's too."""
        kubectl = self.node.kubectl
        parts = [kubectl("describe", "pods", "-n", self.namespace, "-l", INSTANCE_LABEL, check=False).stdout,
                 kubectl("get", "events", "-n", self.namespace, "--sort-by=.lastTimestamp", check=False).stdout]
        for previous in (False, True):
            logs = kubectl("logs", "-n", self.namespace, "-l", INSTANCE_LABEL, "--tail=200", "--timestamps",
                           *(["--previous"] if previous else []), check=False)
            parts.append(f"operator logs{' (previous container)' if previous else ''}:\n{logs.stdout}{logs.stderr}")
        return "\n".join(parts)

    def operator_pods(self) -> list[dict]:
        listed = self.node.kubectl("get", "pods", "-n", self.namespace, "-l", INSTANCE_LABEL, "-o", "json")
        return json.loads(listed.stdout)["items"]

    def leftovers(self) -> list[str]:
        """The release's objects still there: `kind/name` of everything labelled with its instance."""
        found = []
        for kind in CHART_KINDS:
            listed = self.node.kubectl("get", kind, "-A", "-l", INSTANCE_LABEL, "-o", "name", check=False)
            found += listed.stdout.split()
        return found

    def uninstall(self, timeout: float = 120) -> list[str]:
        self.run_helm("uninstall", RELEASE, "--namespace", self.namespace, "--wait", "--timeout=2m")
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:  # pods and ReplicaSets go by GC
            time.sleep(1)
        return left


@pytest.fixture(scope="session")
def operator_release(node: Node, helm_binary: Path, operator_image: BuiltImage,
                     trainer_image: BuiltImage) -> Iterator[OperatorRelease]:
    for built in (operator_image, trainer_image):
        node.report(f"import of {built.reference}: {node.import_image(built.archive):.1f} s")
    release = OperatorRelease(node, helm_binary, operator_image, trainer_image)
    release.install()
    node.report(f"helm install of {operator_image.reference} (trainer image {trainer_image.reference}): "
                f"{release.install_s:.1f} s")
    try:
        yield release
    finally:
        left = release.uninstall()
        assert not left, f"helm uninstall left {left}"
