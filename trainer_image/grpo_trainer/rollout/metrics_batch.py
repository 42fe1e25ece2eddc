"""The worker child's rollout metrics, sent to the learner a few times a second instead of once per completion.

TRL's rollout loop puts one payload of metrics on its multiprocessing queue per completion and per scored group
(`_AsyncRolloutLoop._push_metrics`): each is pickled by the queue's feeder thread and unpickled by the learner's
training thread when it logs, a tenth of the child's CPU in the tiny example. `MetricsBatch` stands in for that
queue in the child and merges the payloads, sending one every `interval_s`, so that the learner logs what it would
have: TRL reduces a logging window by each value's shape and key (`_reduce_metric`, trl/experimental/async_grpo/
async_grpo_trainer.py:81 (trl 1.16.0)): a (numerator, denominator) pair is a rate, summed; a key with the word
`total` is a counter, summed; `max`/`min` are extrema; anything else is a gauge, whose window mean this sends as a
(sum, count) pair, which TRL reduces to the same mean. A NaN that is no rate is left out, as TRL's log leaves it out.

TRL also makes a metric of each tool name the policy writes (`tools/NAME/call_total`, `failure_total`,
`latency_s`, async_rollout_worker.py:968 (trl 1.16.0)), whatever it wrote: `tools/guess(/call_total`,
`tools//latency_s`. Such a key is one more series per made-up name, and a tracker may refuse it: MLflow answers a
name that reads as another path (`tools//call_total`) with a 400 for the whole step's metrics, loss included. Those
keys are not sent; TRL counts the calls in `tools/unknown_name_total` all the same.
"""

from __future__ import annotations

import math
import queue
import re
import time
from collections.abc import Callable
from typing import Any

#: How often the merged metrics go to the learner: it logs them at its next step, as it logged TRL's.
METRICS_INTERVAL_S = 0.25


#: TRL's per-tool metrics whose NAME could be a tool's: a function or method name, or an MCP tool's.
_TOOL_METRIC = re.compile(r"^tools/(?P<name>[^/]*(?:/.*)?)/(?:call_total|failure_total|latency_s)$")
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def is_invented_tool_metric(key: str) -> bool:
    """A per-tool metric of a tool name no tool can have: the policy made it up."""
    found = _TOOL_METRIC.match(key)
    return found is not None and _TOOL_NAME.match(found["name"]) is None


def _reduction(key: str, value: Any) -> str:
    if isinstance(value, tuple):
        return "rate"
    words = key.split("/")[-1].split("_")
    for word in ("total", "max", "min"):
        if word in words:
            return word
    return "gauge"


class MetricsBatch:
    """Duck-types the `put_nowait` of TRL's metrics queue (`inner`), merging what it is given."""

    def __init__(self, inner: Any, interval_s: float = METRICS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.interval_s = interval_s
        self._clock = clock
        self._pending: dict[str, Any] = {}
        self._sent_at = clock()

    def put_nowait(self, payload: dict[str, Any]) -> None:
        for key, value in payload.items():
            self._merge(key, value)
        if self._clock() - self._sent_at >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Send what is pending now (a full queue drops it, as TRL's push does: generation never blocks on it)."""
        self._sent_at = self._clock()
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            self.inner.put_nowait(pending)
        except queue.Full:
            pass

    def _merge(self, key: str, value: Any) -> None:
        if is_invented_tool_metric(key):
            return
        kind = _reduction(key, value)
        if kind != "rate":
            value = float(value)
            if math.isnan(value):
                return
        if kind == "gauge":
            value, kind = (value, 1.0), "rate"
        before = self._pending.get(key)
        if before is None:
            self._pending[key] = value
        elif kind == "rate":
            self._pending[key] = (before[0] + value[0], before[1] + value[1])
        elif kind == "total":
            self._pending[key] = before + value
        else:
            self._pending[key] = max(before, value) if kind == "max" else min(before, value)
