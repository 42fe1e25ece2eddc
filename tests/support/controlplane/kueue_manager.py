"""Kueue's real manager (sigs.k8s.io/kueue/cmd/kueue, built by hack/kueue/build.sh) against the test control plane.

Kueue runs as the admin, with no leader election, no metrics or health servers, and no admission webhooks (its
validating and mutating webhook configurations are not installed: the API server never calls them). Its CRDs are
installed from the Go module it was built from. Those that Kueue's own kustomization converts through its webhook
(v1beta1 <-> v1beta2: Workload, ClusterQueue, LocalQueue, ...) do so here too, reaching it by URL on loopback with
the control plane's serving certificate (valid for 127.0.0.1, signed by the CA the CRDs trust). GRPORun is
registered as an external framework, as docs/kueue.md asks a cluster admin to do.

Kueue reads the metrics server's certificate from a fixed path, /etc/kueue/metrics/certs, even with the metrics
server off; the manager runs in a mount namespace of its own where /etc is a folder of the test's (root).
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import yaml

from tests.support.builds import Build
from tests.support.controlplane.control_plane import ControlPlane, Unavailable, _die_with_parent, go_build
from tests.support.controlplane.control_plane_client import Client
from tests.support.paths import REPO
from tests.support.ports import free_port

BUILD_SCRIPT = REPO / "hack" / "kueue" / "build.sh"
BUILD_NAME = "kueue"  # its name in hack/lib/build-times
NAMESPACE = "kueue-system"
GRPORUN_FRAMEWORK = "GRPORun.v1alpha1.grpo.dev"


def build() -> Build:
    """The build of the `kueue` manager and its `crds/` (hack/kueue/build.sh); Unavailable where it cannot run."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise Unavailable("Kueue's manager runs in a mount namespace of its own: needs root and unshare")
    return go_build(BUILD_NAME, [str(BUILD_SCRIPT)], "Kueue is")


def webhook_converted_crds(crds: Path) -> set[str]:
    """The CRDs Kueue's own kustomization patches to convert through its webhook (the others, ResourceFlavor among
    them, convert with strategy None: their versions share one schema, and the webhook refuses them)."""
    kustomization = yaml.safe_load((crds / "kustomization.yaml").read_text())
    return {yaml.safe_load((crds / patch["path"]).read_text())["metadata"]["name"]
            for patch in kustomization.get("patches") or [] if "webhook_in_" in patch["path"]}


class KueueManager:
    """Kueue in `plane.workdir/kueue`: start() installs its CRDs and returns once its webhook server answers."""

    def __init__(self, plane: ControlPlane, admin: Client, bin_dir: Path):
        self.plane, self.admin, self.bin_dir = plane, admin, bin_dir
        self.workdir = plane.workdir / "kueue"
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> KueueManager:
        self.workdir.mkdir(exist_ok=True)
        certs, etc = self._certificates()
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": "0"}, "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [GRPORUN_FRAMEWORK]},
        }))
        self.admin.create_namespace(NAMESPACE)
        converted = webhook_converted_crds(self.bin_dir / "crds")
        for path in sorted((self.bin_dir / "crds" / "bases").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            self.admin.install_crd(self._with_conversion(crd) if crd["metadata"]["name"] in converted else crd)
        log = open(self.workdir / "kueue.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        script = 'mount --bind "$1" /etc && exec "$2" --config="$3" --feature-gates=VisibilityOnDemand=false'
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--", "sh", "-c", script, "sh", str(etc), str(self.bin_dir / "kueue"), str(config)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            env={**os.environ, "KUBECONFIG": str(self.plane.kubeconfig)})
        self._wait_listening(timeout)
        return self

    def _certificates(self) -> tuple[Path, Path]:
        certs = self.workdir / "certs"
        metrics = self.workdir / "etc" / "kueue" / "metrics" / "certs"
        for folder in (certs, metrics):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.plane.workdir / "server.crt", folder / "tls.crt")
            shutil.copy(self.plane.workdir / "server.key", folder / "tls.key")
        return certs, self.workdir / "etc"

    def _with_conversion(self, crd: dict) -> dict:
        bundle = base64.b64encode(self.plane.ca.read_bytes()).decode()
        crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
            "conversionReviewVersions": ["v1"],
            "clientConfig": {"url": f"https://127.0.0.1:{self.port}/convert", "caBundle": bundle}}}
        return crd

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"kueue exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kueue's webhook server did not listen in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / "kueue.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
