"""Rollout servers that exit or hang are restarted in place by `grporun local`, with their own counter and limit.

Real child processes stand in for vLLM here (they exit on cue, as a server whose engine died does); the restart of a
real vLLM server under a running learner is in tests/trainer/test_rollout_replicas.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from grpo_operator.cli.local.plan import ProcessPlan
from grpo_operator.cli.local.processes import LocalProcess, free_port
from grpo_operator.cli.local.rollout_restarts import Liveness, RolloutRestarts, exit_line
from grpo_trainer.rollout import EXIT_LINE_PREFIX
from tests.support.paths import REPO

SERVER = REPO / "tests" / "support" / "completions_server.py"

DIES = f"""
import sys
print("nanobind: leaked 12 instances!")
print("{EXIT_LINE_PREFIX}vLLM exited with code 0: RuntimeError: CPU Generator does not use offset", file=sys.stderr)
"""


def _wait_exit(process: LocalProcess) -> None:
    deadline = time.monotonic() + 30
    while process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_exited_server_restarts_until_its_own_limit_then_is_left_to_the_failure_policy(tmp_path):
    plan = ProcessPlan("tiny-rollout-0", "rollout", [sys.executable, "-c", DIES], {})
    process = LocalProcess(plan, tmp_path / "rollout.log")
    learner = LocalProcess(ProcessPlan("tiny-learner-0", "learner", [sys.executable, "-c", "pass"], {}),
                           tmp_path / "learner.log")
    restarts = RolloutRestarts(limit=2)
    lines: list[str] = []
    process.start()
    learner.start()
    for expected in (1, 2, 2):
        _wait_exit(process)
        _wait_exit(learner)
        restarts.tick([process, learner], lines.append)
        assert restarts.counts["tiny-rollout-0"] == expected
    assert "tiny-learner-0" not in restarts.counts  # a learner's exit is the run's policy, never restarted here
    assert len(lines) == 2 and "RolloutRestarted" in lines[0] and "restart 2/2" in lines[1]
    assert "exited with code 0: RuntimeError: CPU Generator does not use offset" in lines[0]  # exit 0 is a failure
    assert process.poll() == 0  # left exited: the failure policy sees it
    assert exit_line(process.log_path) == "vLLM exited with code 0: RuntimeError: CPU Generator does not use offset"


def test_a_hung_server_is_restarted_after_its_liveness_probes_fail_in_a_row(tmp_path):
    # A SIGSTOPped server still holds its port and accepts connections: only a generated token tells it is hung.
    port = free_port()
    plan = ProcessPlan("tiny-rollout-0", "rollout", [sys.executable, str(SERVER), "s", str(port)], {},
                       url=f"http://127.0.0.1:{port}")
    process = LocalProcess(plan, tmp_path / "rollout.log")
    restarts = RolloutRestarts(limit=2, liveness=Liveness("m", period_s=0.1, failure_threshold=2, timeout_s=0.5))
    lines: list[str] = []
    process.start()
    try:
        _tick_until(lambda: "tiny-rollout-0" in restarts.liveness._started, restarts, process, lines)
        assert restarts.counts["tiny-rollout-0"] == 0  # generating: nothing to do
        stopped = process.popen.pid
        os.kill(stopped, signal.SIGSTOP)
        _tick_until(lambda: restarts.counts["tiny-rollout-0"] == 1, restarts, process, lines)
        assert process.popen.pid != stopped and process.poll() is None  # a new server in its place
        assert len(lines) == 1 and "hung: no token from 2 liveness probes in a row" in lines[0]
        _tick_until(lambda: "tiny-rollout-0" in restarts.liveness._started, restarts, process, lines)
        assert restarts.counts["tiny-rollout-0"] == 1  # the new one generates: no further restart
    finally:
        process.stop()


def _tick_until(condition, restarts: RolloutRestarts, process: LocalProcess, lines: list[str]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, lines
        restarts.tick([process], lines.append)
        time.sleep(0.05)
