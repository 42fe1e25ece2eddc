"""Rollout servers that exit are restarted in place by `grporun local`, with their own counter and limit.

Real child processes stand in for vLLM here (they exit on cue, as a server whose engine died does); the restart of a
real vLLM server under a running learner is in tests/trainer/test_rollout_replicas.py.
"""

from __future__ import annotations

import sys
import time

from grpo_operator.cli.local.plan import ProcessPlan
from grpo_operator.cli.local.processes import LocalProcess
from grpo_operator.cli.local.rollout_restarts import RolloutRestarts, exit_line
from grpo_trainer.rollout import EXIT_LINE_PREFIX

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
