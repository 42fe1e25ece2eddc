"""SIGTERM in a learner process (grpo_trainer.learner.preemption), in a child process so the test runner keeps its
own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys
    from grpo_trainer.learner import preemption
    preemption.install()
    if sys.argv[1] == "settled":
        preemption.settle()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        print("finished")
    except preemption.Preempted as preempted:
        print(preempted)
""")


def sigterm_in(state: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHILD, state], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_before_training_a_sigterm_ends_the_process_as_preempted():
    assert sigterm_in("starting").startswith("preempted: signal 15 before training started")


def test_once_the_outcome_is_decided_a_sigterm_lets_the_process_finish_reporting_it():
    # torchrun SIGTERMs the surviving ranks when one rank's teardown fails; raising Preempted there escaped the
    # entrypoint and the rank recorded no outcome.
    assert sigterm_in("settled") == "finished"


_BLOCKED_TEARDOWN = """
import sys, threading
import grpo_trainer.__main__ as entry
def learner(config_path):
    # A library thread that never ends: the interpreter's teardown would join it for good.
    threading.Thread(target=threading.Event().wait, name="stuck-library-thread").start()
    return 75
entry.learner = learner
entry.TEARDOWN_LIMIT_S = 1.0
entry.exit_with(entry.main(["learner", "--config", "unused.json"]))  # what `python -m grpo_trainer` runs
"""


def test_a_learner_whose_teardown_blocks_still_exits_with_its_recorded_outcome_naming_what_held_it():
    # Held, the pod waited for its grace period's SIGKILL: exit 137, a crash, where the learner had decided 75.
    done = subprocess.run([sys.executable, "-c", _BLOCKED_TEARDOWN], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert "teardown was still waiting after 1s on thread 'stuck-library-thread'" in done.stderr
