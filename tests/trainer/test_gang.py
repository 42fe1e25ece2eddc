"""The exit code of a multi-process learner pod (grpo_trainer.gang), without torch: fake ranks in subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from grpo_trainer.contract import (
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_SUCCEEDED,
)
from grpo_trainer.gang import gang_exit_code
from grpo_trainer.launch import learner_argv


@pytest.mark.parametrize(("launcher", "outcomes", "expected"), [
    (0, {0: EXIT_STALLED, 1: EXIT_STALLED}, EXIT_STALLED),
    (0, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED),
    (0, {0: EXIT_SUCCEEDED, 1: EXIT_SUCCEEDED}, EXIT_SUCCEEDED),
    (1, {0: EXIT_INVALID_CONFIG}, EXIT_INVALID_CONFIG),  # torchrun stopped rank 1 before it read the config
    (1, {0: EXIT_STALLED, 1: 1}, 1),  # rank 1 crashed: a crash, whatever rank 0 decided
    (1, {0: EXIT_STALLED}, 1),  # rank 1 died without a word
    (0, {0: EXIT_STALLED}, 1),  # a rank that exits 0 without recording is not one of ours
    (1, {0: EXIT_PREEMPTED, 1: 1}, 1),
    (EXIT_STALLED, {}, 1),  # a launcher failing with one of our codes must not read as ours
    (137, {}, 137),
])
def test_gang_exit_code(launcher, outcomes, expected):
    assert gang_exit_code(launcher, outcomes, ranks=2) == expected


def test_multi_process_launch_line_runs_under_the_gang_supervisor():
    argv = learner_argv("/c/run.json", processes_per_machine=4, num_machines=2)
    assert argv[:6] == ["python", "-m", "grpo_trainer.gang", "--ranks", "4", "--"]
    assert argv[6:10] == ["python", "-m", "accelerate.commands.launch", "--multi_gpu"]
    one_process = learner_argv("/c/run.json")
    assert one_process[:2] == ["python", "-m"] and "grpo_trainer.gang" not in one_process


FAKE_RANK = textwrap.dedent("""
    import os, signal, sys, time
    from grpo_trainer import gang
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    gang.record_start()
    os.write(1, b"ready\\n")
    mode = sys.argv[1]
    if mode == "stall":
        sys.exit(gang.record_outcome(42))
    if mode == "crash" and os.environ["RANK"] == "1":
        sys.exit(3)
    if mode == "term":
        while not stop:
            time.sleep(0.01)
        sys.exit(gang.record_outcome(75))
    sys.exit(gang.record_outcome(42))
""")

# Stands in for torchrun: two ranks, exit 1 if any rank failed (what torchrun does), else 0.
FAKE_LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, "RANK": str(r)})
             for r in range(2)]
    sys.exit(1 if any(p.wait() for p in ranks) else 0)
""")


def supervised(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo_trainer.gang", "--ranks", "2", "--",
                             sys.executable, "-c", FAKE_LAUNCHER, FAKE_RANK, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_supervisor_exits_with_the_ranks_common_stall():
    process = supervised("stall")
    assert process.wait(60) == EXIT_STALLED, process.stderr.read()


def test_supervisor_turns_one_crashed_rank_into_a_crash():
    process = supervised("crash")
    assert process.wait(60) == 1, process.stderr.read()


def test_supervisor_passes_sigterm_to_the_ranks_and_exits_preempted():
    process = supervised("term")
    try:
        assert [process.stdout.readline(), process.stdout.readline()] == ["ready\n", "ready\n"]  # pids recorded
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == EXIT_PREEMPTED, process.stderr.read()
    finally:
        if process.poll() is None:  # a failed run leaves the fake ranks waiting for a SIGTERM: end the group
            process.kill()
