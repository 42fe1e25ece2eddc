"""RolloutWaitMeter: the rollout queue as TRL's trainer reads it, timed while the learner waits on it.

TRL's RolloutQueueDataset already times its blocking `get` (`perf/rollout_wait_s`), but it adds a wait to its total
only when the wait ends and resets the total at every optimizer step: a learner starved for minutes reads as not
waiting at all until a sample arrives. This meter counts the same time (the learner blocked in `get` for a sample),
never resets, and includes the wait in progress, so `rate()` of the counter built on it is the share of time the
learner waited, whenever Prometheus scrapes. docs/rollout.md says how it drives autoscaling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class RolloutWaitMeter:
    """Duck-types the queue TRL's RolloutQueueDataset reads (`get(timeout)`, `qsize()`), timing each `get`."""

    def __init__(self, inner: Any, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self._clock = clock
        self._lock = threading.Lock()  # the exporter's thread reads while the training thread waits
        self._finished_s = 0.0
        self._waiting_since: float | None = None

    def qsize(self) -> int:
        return self.inner.qsize()

    def get(self, timeout: float | None = None) -> Any:
        with self._lock:
            self._waiting_since = self._clock()
        try:
            return self.inner.get(timeout=timeout)
        finally:
            with self._lock:
                self._finished_s += self._clock() - self._waiting_since
                self._waiting_since = None

    @property
    def seconds(self) -> float:
        """Seconds spent waiting in `get` since this meter was made, the wait now in progress included."""
        with self._lock:
            running = 0.0 if self._waiting_since is None else self._clock() - self._waiting_since
            return self._finished_s + max(running, 0.0)
