"""Every weight sync timed, and one that outlives its deadline ends the learner as stalled.

A sync can block where nothing times it out: an NCCL collective waits forever for a peer that is somewhere else, and
the filesystem sync waits up to its server timeouts and then for a replica to come back. The learner cannot cancel
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

from .progress import StallError


class WeightSyncStuck(StallError):
    """A weight sync ran past `rollout.weightSync.deadlineSeconds`."""


@dataclass
class SyncTimer:
    """Times weight syncs; `run` enforces the deadline (None: no deadline)."""

    deadline_s: float | None
    #: Called at the start of the sync's thread: a CUDA rank selects its device there (the current device is
    #: per thread, and a new thread starts on device 0).
    thread_setup: Callable[[], None] = lambda: None
    syncs: int = 0
    total_s: float = 0.0
    last_s: float | None = None
    _started: float | None = field(default=None, repr=False)

    @property
    def running_s(self) -> float:
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    def run(self, sync: Callable[[], None]) -> None:
        """Run `sync` to its end, re-raising what it raised; raise WeightSyncStuck when it outlives the deadline."""
        outcome: list[BaseException | None] = []

        def target() -> None:
            try:
                self.thread_setup()
                sync()
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                outcome.append(error)
            else:
                outcome.append(None)

        self._started = started = time.monotonic()
        thread = threading.Thread(target=target, name="grpo-weight-sync", daemon=True)
        thread.start()
        thread.join(self.deadline_s)
        if thread.is_alive():
            raise WeightSyncStuck(
                f"weight sync stuck: still running after {time.monotonic() - started:.0f}s "
                f"(rollout.weightSync.deadlineSeconds {self.deadline_s:g}); see the learner log for the step it "
                "was in (pause, barrier, transfer, resume)"
            )
        self._started = None
        self.last_s = time.monotonic() - started
        self.total_s += self.last_s
        if outcome[0] is not None:
            raise outcome[0]
        self.syncs += 1
