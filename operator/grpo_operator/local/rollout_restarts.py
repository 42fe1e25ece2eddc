"""A local rollout server's last words, as a pod's termination message would carry them, and its liveness probe.

A rollout server that exits (any code: vLLM exits 0 after its engine died) is replaced by the shared state machine
(grpo_operator.status.rollout_exits) with its own counter and `runPolicy.rolloutRestartLimit`, exactly as under the
operator: `grporun local` only stops the process (RecreatePods) and starts it again (CreateChildren). The engine's
error line reaches the run's status from the entrypoint's exit line, which the kubelet would keep as the pod's
termination message.

A server that hangs keeps its port and answers /health. `Liveness` does what the kubelet does with the rollout pod's
liveness probe (builders.rollout_probes), with the same generation probe, period and failure threshold: the hung
server is stopped, and the state machine replaces it like any server that exited.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from grpo_trainer.contract import (
    EXIT_LINE_PREFIX,
    LIVENESS_FAILURE_THRESHOLD,
    LIVENESS_PERIOD_S,
    PROBE_TIMEOUT_S,
    probe_generation,
)

from .processes import LocalProcess, tail

#: A hung (e.g. stopped) server cannot act on SIGTERM: SIGKILL follows soon.
HUNG_STOP_GRACE_S = 2.0


def exit_line(log_path: Path) -> str | None:
    """The rollout entrypoint's exit line (`grpo rollout: vLLM exited with code N: RuntimeError: ...`), if any."""
    lines = [line for line in tail(log_path).splitlines() if line.startswith(EXIT_LINE_PREFIX)]
    return lines[-1] if lines else None


# more than 8: probe settings and per-server probe state, all defaulted but the first
@dataclass
class Liveness:
    """The kubelet's liveness probe for local servers: never blocks the supervisor (probes run on a thread pool).

    Like a startup probe, failures count only once the server has generated a first token (model load takes minutes).
    """

    model: str
    period_s: float = LIVENESS_PERIOD_S
    failure_threshold: int = LIVENESS_FAILURE_THRESHOLD
    timeout_s: float = PROBE_TIMEOUT_S
    probe: Callable[[str, str, float], str | None] = probe_generation
    failures: Counter = field(default_factory=Counter)
    _started: set = field(default_factory=set)
    _pending: dict = field(default_factory=dict)  # name -> Future
    _next_at: dict = field(default_factory=dict)  # name -> monotonic time of the next probe
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(thread_name_prefix="liveness"))

    def hung(self, process: LocalProcess) -> str | None:
        """Why the running server counts as hung now, else None; starts its next probe when one is due."""
        name = process.plan.name
        pending: Future | None = self._pending.get(name)
        verdict = None
        if pending is not None and pending.done():
            del self._pending[name]
            error = pending.result()
            if error is None:
                self._started.add(name)
                self.failures[name] = 0
            elif name in self._started:
                self.failures[name] += 1
                if self.failures[name] >= self.failure_threshold:
                    verdict = f"hung: no token from {self.failures[name]} liveness probes in a row ({error})"
        if name not in self._pending and time.monotonic() >= self._next_at.get(name, 0.0):
            self._next_at[name] = time.monotonic() + self.period_s
            self._pending[name] = self._pool.submit(self.probe, process.plan.url, self.model, self.timeout_s)
        return verdict

    def forget(self, name: str) -> None:
        """A restarted server starts over: not started, no failures (a probe of the old process is dropped)."""
        self._started.discard(name)
        self.failures.pop(name, None)
        self._pending.pop(name, None)
        self._next_at.pop(name, None)
