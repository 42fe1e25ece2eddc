"""One real vLLM CPU server for the whole test session, on the tiny model (`tiny_model_dir`).

The fixture is registered once in conftest.py (`pytest_plugins`); test modules just name it. The server is started
through the project's own rollout entrypoint (`python -m grpo_trainer rollout`) in `.venv-rollout`, so these tests
also cover the command line the rollout pod runs. Start-up costs 45 s to 3 min on the 2-core CI box: every test that
needs a server shares this one.
Each learner run starts with a full weight sync (TRL's cold sync on train begin), so tests that change the server's
weights do not leak into each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.support.controlplane.control_plane import _die_with_parent
from tests.support.paths import REPO
from tests.support.ports import free_port

ROLLOUT_PYTHON = Path(os.environ.get("GRPO_ROLLOUT_PYTHON", REPO / ".venv-rollout" / "bin" / "python"))
START_TIMEOUT_S = 600
MAX_MODEL_LEN = 256
#: vLLM's CPU warm-up compiles the model with inductor: 20-35 s of each server start here (a run that starts two
#: servers: 205 s compiled, 156 s eager). These tests start many servers and test what happens around them, so
#: theirs skip it; the shipped example, `make demo` and the node tier's tiny run keep the compiled path.
EAGER_VLLM_ARGS = ("--enforce-eager",)
#: The adapter rank the test servers are started for (`--max-lora-rank`): a test's adapter may be this or lower.
SERVED_LORA_RANK = 8


@dataclass(frozen=True)
class VllmServer:
    url: str
    model: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def server_config(model: str, url: str, weight_dir: str) -> dict:
    """The run config the rollout entrypoint reads (only the rollout part matters to it)."""
    return {
        "model": model,
        "dataset": {"path": "unused.jsonl"},
        "rewards": [{"name": "constant"}],
        "rollout": {
            "urls": [url], "maxModelLen": MAX_MODEL_LEN, "gpuMemoryUtilization": 0.2, "device": "cpu",
            "extraArgs": list(EAGER_VLLM_ARGS),
            "weightSync": {"mode": "filesystem", "directory": weight_dir},
        },
        # A LoRA run's servers (`--enable-lora`, rank and slots from the spec): serving adapters costs the base model
        # nothing that matters here, and a whole-weight sync reloads such a server just the same
        # (test_weight_sync), so one server serves the LoRA runs and the others alike.
        "training": {"lora": {"r": SERVED_LORA_RANK}},
        "learner": {"device": "cpu"},
    }


def require_rollout_python() -> Path:
    if not os.access(ROLLOUT_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM environment at {ROLLOUT_PYTHON} (build it with `make setup-rollout`)")
    return ROLLOUT_PYTHON


@dataclass
class ServerProcess:
    server: VllmServer
    process: subprocess.Popen

    def kill(self) -> None:
        """SIGKILL the whole server (API process and engine), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@dataclass(frozen=True)
class ServerStart:
    """One server to start: its folder (run.json, server.log), extra environment and run config (wire form; by
    default `server_config`'s)."""

    workdir: Path
    env: dict[str, str] | None = None
    config: dict | None = None


@contextlib.contextmanager
def running_vllm_server(model: str, workdir: Path, env: dict[str, str] | None = None,
                        config: dict | None = None,
                        start_timeout_s: float = START_TIMEOUT_S) -> Iterator[ServerProcess]:
    """A vLLM CPU server on a free port, started through the rollout entrypoint; stopped (group-wide) on exit.

    `config`: the run config (wire form) to serve, e.g. a run's own `run.json`; by default `server_config`'s. The
    entrypoint reads only its model, seed and rollout part, so its `rollout.urls` need not name this server."""
    with running_vllm_servers(model, [ServerStart(workdir, env, config)], start_timeout_s) as (running,):
        yield running


@contextlib.contextmanager
def running_vllm_servers(model: str, starts: list[ServerStart],
                         start_timeout_s: float = START_TIMEOUT_S) -> Iterator[list[ServerProcess]]:
    """Several servers starting at once (each start costs minutes on a busy machine), all stopped on exit. Each is
    spawned on the calling thread: a server dies with the thread that spawned it (PR_SET_PDEATHSIG follows the
    thread, not the process), so a pool thread that ends would take its server with it."""
    python = require_rollout_python()
    spawned: list[ServerProcess] = []
    try:
        for start in starts:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            config_path = start.workdir / "run.json"
            served = start.config or server_config(model, url, str(start.workdir / "weights"))
            config_path.write_text(json.dumps(served))
            log_path = start.workdir / "server.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [str(python), "-m", "grpo_trainer", "rollout", "--config", str(config_path), "--port", str(port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    cwd=REPO, preexec_fn=_die_with_parent, env={**os.environ, **(start.env or {})},
                )
            spawned.append(ServerProcess(VllmServer(url, model, log_path), process))
        deadline = time.monotonic() + start_timeout_s
        for running in spawned:
            _wait_healthy(running, deadline, start_timeout_s)
        yield spawned
    finally:
        for running in spawned:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.process.pid, signal.SIGTERM)
        for running in spawned:
            try:
                running.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.process.pid, signal.SIGKILL)
            running.process.wait(timeout=10)


def _wait_healthy(running: ServerProcess, deadline: float, start_timeout_s: float) -> None:
    server, process = running.server, running.process
    while True:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited with {process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM server was not healthy within {start_timeout_s:.0f}s:\n{server.log_tail()}")
        time.sleep(1)
    print(f"vLLM CPU server ready at {server.url} (log {server.log_path})", file=sys.stderr)


def sync_weights(server: VllmServer, named_parameters, weights_dir: Path):
    """Sync `named_parameters` into `server` as a learner's weight sync does (as version v1 in `weights_dir`); the
    sync. The session's server serves whatever the last run trained into it: a test that reads its samples syncs
    the weights it expects first."""
    from grpo_trainer.rollout.weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer  # torch: when used

    sync = FilesystemWeightTransfer([server.url], weights_dir, aliases=TIED_EMBEDDING_ALIASES)
    sync.init_weight_transfer()
    sync.pause()
    sync.send_weights(iter(list(named_parameters)))
    sync.resume()
    return sync


def restore_model_weights(server: VllmServer, weights_dir: Path):
    """Serve the tiny model's own weights again on `server`: what a fresh rollout server serves. A LoRA run's
    adapters apply to the weights the server holds, so they are only the run's policy on these."""
    from transformers import AutoModelForCausalLM

    return sync_weights(server, AutoModelForCausalLM.from_pretrained(server.model).named_parameters(), weights_dir)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory) -> VllmServer:
    with running_vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm")) as running:
        yield running.server
