"""Every weight sync timed, and one that outlives its deadline ends the learner as stalled.

A sync can block where nothing times it out: an NCCL collective waits forever for a peer that is somewhere else, and
the filesystem sync waits up to its server timeouts and then for a server to come back. The learner cannot cancel
either (a collective in C, a socket read), so the sync runs on its own daemon thread and the training thread waits
for it with the deadline: past it, the training thread raises `WeightSyncStuck` and the learner exits as stalled,
leaving the stuck thread to end with the process. Every rank runs its part of the sync this way, so a rank held in
the sync's barrier by a hung rank 0 ends at the deadline too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..progress import StallError


class DaemonCall:
    """`call()` on a daemon thread that the caller waits on as long as it chooses: what it raised is re-raised by
    `result()`, and a call left running ends with the process (a collective in C or a socket read cannot be
    cancelled)."""

    def __init__(self, call: Callable[[], Any], name: str):
        self._outcome: list[tuple[Any, BaseException | None]] = []

        def target() -> None:
            try:
                self._outcome.append((call(), None))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                self._outcome.append((None, error))

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None) -> bool:
        """Wait up to `timeout_s` (None: until it ends); True once the call has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> Any:
        value, error = self._outcome[0]
        if error is not None:
            raise error
        return value


class WeightSyncStuck(StallError):
    """A weight sync ran past `rollout.weightSync.deadlineSeconds`."""


def _no_detail() -> str:
    return "see the learner log for the step it was in (pause, barrier, transfer, resume)"


@dataclass
class SyncTimer:
    """Times weight syncs; `run` enforces the deadline (None: no deadline)."""

    deadline_s: float | None
    #: Called at the start of the sync's thread: a CUDA rank selects its device there (the current device is
    #: per thread, and a new thread starts on device 0).
    thread_setup: Callable[[], None] = lambda: None
    #: What a sync past its deadline still waits on (which server, which step): the stall's message says it.
    waiting_on: Callable[[], str] = _no_detail
    syncs: int = 0
    total_s: float = 0.0
    last_s: float | None = None
    #: How long a sync ran when it was declared stuck: the running gauge stays there (the learner is ending).
    stuck_s: float | None = None
    _started: float | None = field(default=None, repr=False)

    @property
    def running_s(self) -> float:
        started = self._started
        if started is None:
            return self.stuck_s or 0.0
        return time.monotonic() - started

    def run(self, sync: Callable[[], None]) -> None:
        """Run `sync` to its end, re-raising what it raised; raise WeightSyncStuck when it outlives the deadline."""
        def setup_and_sync() -> None:
            self.thread_setup()
            sync()

        self._started = started = time.monotonic()
        call = DaemonCall(setup_and_sync, "grpo-weight-sync")
        if not call.join(self.deadline_s):
            self.stuck_s = time.monotonic() - started
            self._started = None
            raise WeightSyncStuck(
                f"weight sync stuck: still running after {self.stuck_s:.0f}s "
                f"(rollout.weightSync.deadlineSeconds {self.deadline_s:g}): {self.waiting_on()}"
            )
        self._started = None
        self.last_s = time.monotonic() - started
        self.total_s += self.last_s
        call.result()
        self.syncs += 1
