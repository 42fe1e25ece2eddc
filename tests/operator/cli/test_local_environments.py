"""`grporun local` runs spec.environments as processes: the real game server (grpo_trainer.testing.guess_env) on a
free loopback port the learner is told, ready once its probe passes, restarted in place when it dies (counted in
status.environments as the kubelet's restarts are), and stopped with the run.

The learner is a process that sleeps and the rollout server a scripted one: what is tested is the environment's
lifecycle under the operator's state machine; the learner's episodes against the game are
tests/operator/cli/test_local_agentic.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from rich.console import Console

from grpo_operator.engine import run_pass
from grpo_operator.local.plan import ProcessPlan
from grpo_operator.local.processes import http_get
from grpo_operator.local.supervise import LocalPort, LocalRun, prepare
from tests.support.paths import REPO

TINY = REPO / "examples" / "tiny.yaml"
SERVER = str(REPO / "tests" / "support" / "completions_server.py")
GUESS = {"name": "guess", "image": "registry.example/guess:1", "port": 8765,
         "command": ["python", "-m", "grpo_trainer.testing.guess_env"], "args": ["--port", "$(PORT)"],
         "readinessProbe": {"httpGet": {"path": "/health", "port": 8765}}}


@pytest.fixture
def local_run(tmp_path):
    """A prepared local run with the guess game as its environment, on one scripted rollout server (given as
    --rollout-url), its learner a process that sleeps (so its model is never read)."""
    rollout = subprocess.Popen([sys.executable, SERVER, "s0"], stdout=subprocess.PIPE, text=True)
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["model"] = str(tmp_path)
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    manifest["spec"]["environments"] = [GUESS]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False,
                                       fresh=False, rollout_url=[rollout.stdout.readline().strip()],
                                       rollout_python=sys.executable, rollout_restart_limit=None))
    learner = local.learner()
    learner.plan = ProcessPlan(learner.plan.name, "learner", [sys.executable, "-c", "import time; time.sleep(300)"],
                               learner.plan.env, learner.plan.url)
    yield local
    local.stop_all()
    rollout.kill()
    rollout.wait()


def tick_until(local: LocalRun, condition, log) -> None:
    """The supervisor's passes (the engine's, through the local port), the learner's report unread, until
    `condition()` holds."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, log.getvalue()
        asyncio.run(run_pass(local.ref, LocalPort(local, Console(file=log, width=300).log,
                                                  read_progress=lambda url: None)))
        time.sleep(0.1)


def environments(local: LocalRun) -> list[dict] | None:
    return (local.status or {}).get("environments")


def test_an_environment_server_runs_where_the_learner_is_told_restarts_in_place_and_stops_with_the_run(local_run):
    local, log = local_run, io.StringIO()
    server = local.processes["tiny-env-guess-0"]
    url = local.learner().plan.env["GRPO_ENVIRONMENT_GUESS_URL"]
    assert url == server.plan.url and url != "http://127.0.0.1:8765"  # a free port, not the pod's
    assert json.loads((local.run_dir / "run.json").read_text())["environments"] == {"guess": url}

    tick_until(local, lambda: environments(local) == [
        {"name": "guess", "wanted": 1, "replicas": 1, "ready": 1, "restarts": 0}], log)
    assert http_get(f"{url}/health") is not None  # the game answers where the learner is told
    assert f"started tiny-env-guess-0 (pid {server.popen.pid}" in log.getvalue()

    first = server.popen.pid
    os.kill(first, signal.SIGKILL)
    tick_until(local, lambda: environments(local) == [
        {"name": "guess", "wanted": 1, "replicas": 1, "ready": 1, "restarts": 1}], log)
    assert server.popen.pid != first and http_get(f"{url}/health") is not None  # the same port again
    assert "restarted tiny-env-guess-0 in place after it exited with code -9 (restart 1" in log.getvalue()
    assert local.status["phase"] != "Failed" and local.status.get("restarts", 0) == 0  # the run went on

    local.stop_all()
    assert server.poll() is not None and http_get(f"{url}/health") is None
