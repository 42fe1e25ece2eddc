"""The rollout server's liveness command, `python -m grpo_trainer probe`: a generated token, not /health.

A SIGSTOPped process stands in for a hung vLLM engine: it accepts connections (the kernel does) and answers nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from grpo_operator.cli.local.processes import free_port
from grpo_trainer import contract as c
from tests.support.paths import REPO

SERVER = str(REPO / "tests" / "support" / "completions_server.py")


def test_the_liveness_command_passes_on_a_generating_server_and_fails_on_a_hung_one(tmp_path):
    config = tmp_path / "run.json"
    run = c.RunConfig.model_validate({"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}]})
    config.write_text(run.model_dump_json(by_alias=True))
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
