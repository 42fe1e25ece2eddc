"""User reward functions that break the reward contract, as `module:function` rewards for the learner's tests.

They run in TRL's spawned rollout worker child, so they are module-level functions importable from the repository
root (the learner's working directory in the tests).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any


def raises(completions: Sequence[Any], **_: Any) -> list[float]:
    return [float("bad") for _ in completions]


def one_short(completions: Sequence[Any], **_: Any) -> list[float]:
    return [1.0] * (len(completions) - 1)


def strings(completions: Sequence[Any], **_: Any) -> list[str]:
    return ["bad"] * len(completions)


def kills_its_process(completions: Sequence[Any], **_: Any) -> list[float]:
    """What the kernel's OOM killer does to the worker child: SIGKILL, no exception, no last words."""
    os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)


#: Where `preempts_its_learner_then_hangs` writes when it sent the SIGTERM (time.time()); set by the test.
PREEMPT_MARK_ENV = "GRPO_TEST_PREEMPT_MARK"
_calls = 0


def preempts_its_learner_then_hangs(completions: Sequence[Any], **_: Any) -> list[float]:
    """A pod's SIGTERM arriving while the worker child is busy with work that does not end (a reward, a tool, a
    generation on a server that is being drained with the learner): from the third group on, it SIGTERMs the learner
    and never returns."""
    global _calls
    _calls += 1
    if _calls >= 3:
        with open(os.environ[PREEMPT_MARK_ENV], "w") as mark:
            mark.write(repr(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(3600)
    return [float(i % 2) for i in range(len(completions))]


#: Where `marks_its_process_then_hangs` writes the pid of the process it runs in (the worker child); set by the test.
CHILD_PID_MARK_ENV = "GRPO_TEST_CHILD_PID_MARK"


def marks_its_process_then_hangs(completions: Sequence[Any], **_: Any) -> list[float]:
    """Writes the worker child's pid where CHILD_PID_MARK_ENV says, then never returns: the child is alive and busy
    when its learner is killed."""
    with open(os.environ[CHILD_PID_MARK_ENV], "w") as mark:
        mark.write(str(os.getpid()))
    time.sleep(3600)
    return [0.0] * len(completions)
