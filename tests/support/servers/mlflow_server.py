"""A real MLflow tracking server for tests: `mlflow server` from `.venv-mlflow` (`make setup-mlflow`) on a free
loopback port, a SQLite store and artifact directory in a temporary folder, stopped at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.paths import REPO, make_variable
from tests.support.ports import free_port

MLFLOW = REPO / make_variable("MLFLOW_VENV") / "bin" / "mlflow"
MISSING = f"no MLflow server at {MLFLOW}: `make setup-mlflow` installs it"


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


@contextmanager
def running_mlflow_server(workdir: Path) -> Iterator[MlflowServer]:
    """A server started in `workdir` (its port chosen; `wait_ready()` before the first request: it takes tens of
    seconds on a busy machine), stopped on leaving."""
    server = MlflowServer(workdir)
    try:
        yield server
    finally:
        server.stop()


def check_tracked_run(uri: str, experiment_name: str, run_name: str, *, model: str, epochs: float,
                      groups_trained: int, dataset: str | None = None):
    """The MLflow server at `uri` got the learner's run: the GRPORun's spec as parameters (its `model`, `epochs` and,
    when given, `dataset.path`: as the spec names them, an s3:// URI and not the copy a pod downloaded), a point per
    step of TRL's loss, and our progress numbers (at most `groups_trained`, the run's final count). Returns the run's
    info."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None, [e.name for e in client.search_experiments()]
    (tracked,) = client.search_runs([experiment.experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.info.run_name == run_name, tracked.info
    assert tracked.data.tags["grpo.dev/run"] == run_name, tracked.data.tags
    parameters = tracked.data.params
    assert parameters["grporun.training.epochs"] == str(float(epochs)), parameters
    assert parameters["grporun.model"] == model, parameters
    if dataset is not None:
        assert parameters["grporun.dataset.path"] == dataset, parameters
    loss = sorted(m.step for m in client.get_metric_history(tracked.info.run_id, "loss"))
    assert loss and loss == list(range(loss[0], loss[0] + len(loss))), loss  # one point per step
    trained = client.get_metric_history(tracked.info.run_id, "progress/groups_trained")
    assert 0 < max(m.value for m in trained) <= groups_trained, trained
    return tracked.info
