"""User reward functions that break the reward contract, as `module:function` rewards for the learner's tests.

They run in TRL's spawned rollout worker child, so they are module-level functions importable from the repository
root (the learner's working directory in the tests).
"""

from __future__ import annotations

import os
import signal
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
