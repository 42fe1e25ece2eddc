"""`grporun operator` in a process of its own (the real command line, kopf's default login from a kubeconfig), so
a test can kill it the way a node failure does: SIGKILL, no cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests.support.paths import REPO


def write_kubeconfig(directory: Path, server: str, token: str = "t") -> Path:
    """A kubeconfig for `server`; the emulator logs each request's bearer `token`."""
    kubeconfig = directory / f"kubeconfig-{token}"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "tester"}}]}))
    return kubeconfig


class OperatorProcess:
    """One operator replica; `name` becomes its POD_NAME, so its Lease identity starts with it."""

    def __init__(self, name: str, kubeconfig: Path, *args: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"operator-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        clean = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
        path = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer_image"), str(REPO)])
        env = {**clean, "KUBECONFIG": str(kubeconfig), "POD_NAME": name, "PYTHONPATH": path}
        self.process = subprocess.Popen([sys.executable, "-m", "grpo_operator.cli", "operator", *args], env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """What a dead node does to the operator: nothing graceful, no Lease release."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")
