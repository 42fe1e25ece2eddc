"""The exit code of a multi-process learner pod (grpo_trainer.learner.gang), without torch: fake ranks in
subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from grpo_trainer.contract.codes import (
    EXIT_EXPORT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_SUCCEEDED,
)
from grpo_trainer.contract.launch import GangLayout, learner_argv
from grpo_trainer.learner.gang import gang_exit_code


@pytest.mark.parametrize(("launcher", "outcomes", "expected"), [
    (0, {0: EXIT_STALLED, 1: EXIT_STALLED}, EXIT_STALLED),
    (0, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED),
    (0, {0: EXIT_SUCCEEDED, 1: EXIT_SUCCEEDED}, EXIT_SUCCEEDED),
    (1, {0: EXIT_INVALID_CONFIG}, EXIT_INVALID_CONFIG),  # torchrun stopped rank 1 before it read the config
    (1, {0: EXIT_STALLED, 1: 1}, 1),  # rank 1 crashed: a crash, whatever rank 0 decided
    (1, {0: EXIT_STALLED}, 1),  # rank 1 died without a word
    (0, {0: EXIT_STALLED}, 1),  # a rank that exits 0 without recording is not one of ours
    (1, {0: EXIT_PREEMPTED, 1: 1}, 1),
    # Every rank recorded (after its checkpoint) before one's teardown aborted and torchrun stopped the gang.
    (1, {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, EXIT_PREEMPTED),
    (134, {0: EXIT_SUCCEEDED, 1: EXIT_SUCCEEDED}, EXIT_SUCCEEDED),
    (1, {0: EXIT_PREEMPTED, 1: EXIT_STALLED}, 1),  # ranks that disagree are a crash
    (1, {0: EXIT_EXPORT_FAILED, 1: EXIT_SUCCEEDED}, EXIT_EXPORT_FAILED),  # trained; rank 0 could not write it
    (1, {0: EXIT_EXPORT_FAILED}, 1),  # rank 1 never recorded: a crash
    (1, {0: EXIT_SUCCEEDED, 1: EXIT_EXPORT_FAILED}, 1),  # only rank 0 exports
    (EXIT_STALLED, {}, 1),  # a launcher failing with one of our codes must not read as ours
    (137, {}, 137),
])
def test_gang_exit_code(launcher, outcomes, expected):
    assert gang_exit_code(launcher, outcomes, ranks=2) == expected


def test_multi_process_launch_line_runs_under_the_gang_supervisor():
    argv = learner_argv("/c/run.json", gang=GangLayout(processes_per_machine=4, num_machines=2))
    assert argv[:6] == ["python", "-m", "grpo_trainer.learner.gang", "--ranks", "4", "--"]
    assert argv[6:10] == ["python", "-m", "accelerate.commands.launch", "--multi_gpu"]
    one_process = learner_argv("/c/run.json")
    assert one_process[:2] == ["python", "-m"] and "grpo_trainer.learner.gang" not in one_process


FAKE_RANK = textwrap.dedent("""
    import os, signal, sys, time
    from grpo_trainer.learner import gang
    mode = sys.argv[1]
    rank = os.environ["RANK"]
    if mode == "late" and rank == "1":
        time.sleep(1.5)  # still starting when the pod gets its SIGTERM
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    gang.record_start()
    os.write(1, f"ready {rank}\\n".encode())
    if mode == "stall":
        sys.exit(gang.record_outcome(42))
    if mode == "crash" and rank == "1":
        sys.exit(3)
    if mode == "teardown_abort":
        code = gang.record_outcome(75)
        if rank == "1":
            while not os.path.exists(os.path.join(os.environ[gang.GANG_DIR_ENV], "rank0.exit")):
                time.sleep(0.01)
            os.abort()  # as gloo's "terminate called without an active exception" at interpreter exit
        time.sleep(5)  # rank 0 is still tearing down when the launcher stops the gang
        sys.exit(code)
    if mode in ("term", "late"):
        while not stop:
            time.sleep(0.01)
        sys.exit(gang.record_outcome(75))
    sys.exit(gang.record_outcome(42))
""")

# Stands in for torchrun: two ranks; when one fails, SIGTERM the others and exit 1 (what torchrun does), else 0.
FAKE_LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, "RANK": str(r)})
             for r in range(2)]
    while any(p.poll() is None for p in ranks) and not any(p.poll() for p in ranks):
        time.sleep(0.01)
    failed = any(p.poll() for p in ranks)
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    sys.exit(1 if failed or any(p.wait() for p in ranks) else 0)
""")


def supervised(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo_trainer.learner.gang", "--ranks", "2", "--",
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
        assert sorted([process.stdout.readline(), process.stdout.readline()]) == ["ready 0\n", "ready 1\n"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == EXIT_PREEMPTED, process.stderr.read()
    finally:
        if process.poll() is None:  # a failed run leaves the fake ranks waiting for a SIGTERM: end the group
            process.kill()


def test_a_rank_whose_teardown_aborts_after_recording_leaves_the_gangs_outcome():
    # torchrun saw rank 1 die of SIGABRT after it had recorded 75, SIGTERMed rank 0 and exited 1: the pod said crash.
    process = supervised("teardown_abort")
    assert process.wait(60) == EXIT_PREEMPTED, process.stderr.read()


def test_a_rank_that_registers_after_the_sigterm_gets_it_too():
    # Rank 0 is up and gets the SIGTERM; rank 1 installs its handler only later. Left alone it would run on (in a
    # real pod: wait for its exited peer in the rendezvous) until the kubelet's SIGKILL.
    process = supervised("late")
    try:
        assert process.stdout.readline() == "ready 0\n"
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline() == "ready 1\n"
        assert process.wait(30) == EXIT_PREEMPTED, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
