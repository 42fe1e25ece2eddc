"""The rollout server's probe commands: liveness (`python -m grpo_trainer probe`) is a generated token, not
/health; the startup probe (`probe --startup`) waits for /health within one run.

A SIGSTOPped process stands in for a hung vLLM engine: it accepts connections (the kernel does) and answers nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo_trainer.contract.config import RunConfig
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.ports import free_port

SERVER = str(COMPLETIONS_SERVER)


def _run_config(tmp_path: Path) -> Path:
    """A run config the probes read (the model's name is all they use)."""
    config = tmp_path / "run.json"
    run = RunConfig.model_validate({"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}]})
    config.write_text(run.model_dump_json(by_alias=True))
    return config


def test_the_liveness_command_passes_on_a_generating_server_and_fails_on_a_hung_one(tmp_path):
    config = _run_config(tmp_path)
    port = free_port()
    server = subprocess.Popen([sys.executable, SERVER, "s", str(port)], stdout=subprocess.PIPE, text=True)
    probe = [sys.executable, "-m", "grpo_trainer", "probe", "--config", str(config), "--port", str(port),
             "--timeout", "2"]
    try:
        server.stdout.readline()
        alive = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        os.kill(server.pid, signal.SIGSTOP)
        hung = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    finally:
        server.kill()
        server.wait()
    assert alive.returncode == 0, alive.stderr
    assert hung.returncode == 1 and "generated no token: no token within 2s" in hung.stderr


def test_the_startup_probe_waits_in_one_run_for_a_server_that_comes_up_and_fails_for_one_that_does_not(tmp_path):
    config = _run_config(tmp_path)
    port = free_port()

    def startup_probe(timeout_s: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "grpo_trainer", "probe", "--startup", "--config", str(config),
                                 "--port", str(port), "--timeout", str(timeout_s)], stderr=subprocess.PIPE, text=True)

    nobody = startup_probe(2)
    assert nobody.wait(timeout=60) == 1
    assert "has not started: /health did not answer within 2s" in nobody.stderr.read()
    waiting = startup_probe(60)
    time.sleep(3)  # the model "loads": nothing listens yet
    assert waiting.poll() is None, waiting.stderr.read()
    server = subprocess.Popen([sys.executable, SERVER, "s", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()
        assert waiting.wait(timeout=30) == 0, waiting.stderr.read()
    finally:
        waiting.kill()
        server.kill()
        server.wait()
