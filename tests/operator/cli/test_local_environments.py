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

from grpo_operator.api import parse_spec
from grpo_operator.local.environments import BACKOFF_RESET_S, InPlaceRestarts, probe_passes
from grpo_operator.local.plan import LocalProbe, ProcessPlan
from grpo_operator.local.processes import LocalProcess, http_get
from grpo_operator.local.supervise import LocalPort, LocalRun, prepare, tick
from tests.support.paths import COMPLETIONS_SERVER, REPO
from tests.support.servers.raw_answer import answering_once
from tests.support.specs import minimal_spec

TINY = REPO / "examples" / "tiny.yaml"
SERVER = str(COMPLETIONS_SERVER)
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
    """The supervisor's ticks (the kubelet's step, the engine's pass through the local port), the learner's report
    unread, until `condition()` holds."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, log.getvalue()
        asyncio.run(tick(local, LocalPort(local, Console(file=log, width=300).log, read_progress=lambda url: None)))
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


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def exited(process) -> None:
    deadline = time.monotonic() + 30
    while process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_server_that_keeps_exiting_is_restarted_after_a_doubling_back_off_and_shows_crash_loop_back_off(tmp_path):
    spec = parse_spec(minimal_spec(environments=[{"name": "guess", "image": "g:1", "command": ["x"]}]))
    server = LocalProcess(ProcessPlan("tiny-env-guess-0", "environment", [sys.executable, "-c", "print('bye')"], {},
                                      url="http://127.0.0.1:9"), tmp_path / "guess.log")
    clock, lines = Clock(), []
    local = LocalRun("tiny", "default", spec, tmp_path, {"tiny-env-guess-0": server},
                     in_place=InPlaceRestarts(clock=clock))
    local.start_missing(lines.append)

    def restarts_after(seconds: float) -> int:
        exited(server)
        clock.now += seconds
        local.run_kubelet(lines.append)
        return local.in_place.restarts["tiny-env-guess-0"]

    # The back-off counts from when the exit is seen.
    assert restarts_after(0) == 1  # the first exit: started again at once
    assert restarts_after(0) == 1  # the second: 1 s back-off
    [pod] = local.observations()
    assert (pod.phase, pod.ready, pod.waiting_reason, pod.container_restarts) == ("Running", False,
                                                                                  "CrashLoopBackOff", 1)
    assert pod.message == "bye bye"  # the log's tail (the restarts append to it), as a pod's termination message
    assert restarts_after(0.5) == 1 and restarts_after(0.5) == 2
    assert restarts_after(0) == 2 and restarts_after(1.9) == 2 and restarts_after(0.1) == 3  # then 2 s
    assert restarts_after(BACKOFF_RESET_S) == 4  # it ran a minute: started again at once
    assert lines[-1].startswith("restarted tiny-env-guess-0 in place after it exited with code 0 (restart 4")
    local.stop(("tiny-env-guess-0",), recreate=False)  # its pod deleted: gone, not restarted, no restarts kept
    assert server.popen is None and local.observations() == [] and local.in_place.restarts["tiny-env-guess-0"] == 0


def test_the_engines_pass_only_observes_a_server_that_exited_the_kubelets_step_restarts_it(tmp_path):
    spec = parse_spec(minimal_spec(environments=[{"name": "guess", "image": "g:1", "command": ["x"]}]))
    server = LocalProcess(ProcessPlan("tiny-env-guess-0", "environment", [sys.executable, "-c", "print('bye')"], {},
                                      url="http://127.0.0.1:9"), tmp_path / "guess.log")
    learner = LocalProcess(ProcessPlan("tiny-learner-0", "learner", [sys.executable, "-c", "pass"], {}),
                           tmp_path / "learner.log")  # never started: no report to read
    local = LocalRun("tiny", "default", spec, tmp_path, {p.plan.name: p for p in (server, learner)})
    lines: list[str] = []
    local.start_missing(lines.append)
    first = server.popen.pid
    exited(server)
    observed = asyncio.run(LocalPort(local, lines.append).observe())
    [pod] = [p for p in observed.seen.pods if p.role == "environment"]
    assert (pod.waiting_reason, pod.container_restarts) == ("CrashLoopBackOff", 0)
    assert server.popen.pid == first and server.poll() is not None  # observed, not restarted
    local.run_kubelet(lines.append)
    assert server.popen.pid != first and local.in_place.restarts["tiny-env-guess-0"] == 1
    local.stop_all()


def test_an_http_probe_of_a_server_that_answers_what_is_not_http_fails_rather_than_ending_the_run():
    with answering_once(b"this is not http\r\n\r\n") as url:
        plan = ProcessPlan("game-0", "environment", ["game"], {}, url=url, probe=LocalProbe("http", path="/health"))
        assert probe_passes(plan) is False
