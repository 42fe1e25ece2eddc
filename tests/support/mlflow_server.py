"""A real MLflow tracking server for tests: `mlflow server` from `.venv-mlflow` (`make setup-mlflow`) on a free
loopback port, a SQLite store and artifact directory in a temporary folder, stopped at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from grpo_operator.local.processes import free_port
from tests.support.paths import REPO, make_variable

MLFLOW = REPO / make_variable("MLFLOW_VENV") / "bin" / "mlflow"


class MlflowServer:
    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.log = (workdir / "mlflow.log").open("w")
        # Its own session: the server runs its workers as children, stopped with it.
        self.process = subprocess.Popen(
            [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
             "--artifacts-destination", str(workdir / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.workdir / 'mlflow.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:  # noqa: S310 (loopback)
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server did not answer /health: {(self.workdir / 'mlflow.log').read_text()[-2000:]}")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
