"""A local rollout server's last words, as a pod's termination message would carry them, and its liveness probe.

A rollout server that exits (any code: vLLM exits 0 after its engine died) is replaced by the shared state machine
(grpo_operator.status.rollout_exits) with its own counter and `runPolicy.rolloutRestartLimit`, exactly as under the
operator: `grporun local` only stops the process (RecreatePods) and starts it again (CreateChildren). The engine's
error line reaches the run's status from the entrypoint's exit line, which the kubelet would keep as the pod's
termination message.

A server that hangs keeps its port and answers /health. `Liveness` does what the kubelet does with the rollout pod's
startup and liveness probes (builders.rollout_probes): /health polled until it answers, then the same generation
probe, period and failure threshold: the hung server is stopped, and the state machine replaces it like any server
that exited.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from grpo_trainer.contract.rollout_pod import (
    EXIT_LINE_PREFIX,
    HEALTH_REQUEST_TIMEOUT_S,
    LIVENESS_FAILURE_THRESHOLD,
    LIVENESS_PERIOD_S,
    PROBE_TIMEOUT_S,
    STARTUP_POLL_S,
)
from grpo_trainer.server.health import probe_generation

from .processes import LocalProcess, http_get, tail

#: A hung (e.g. stopped) server cannot act on SIGTERM: SIGKILL follows soon.
HUNG_STOP_GRACE_S = 2.0


def exit_line(log_path: Path) -> str | None:
    """The rollout entrypoint's exit line (`grpo rollout: vLLM exited with code N: RuntimeError: ...`), if any."""
    lines = [line for line in tail(log_path).splitlines() if line.startswith(EXIT_LINE_PREFIX)]
    return lines[-1] if lines else None


def health_answers(url: str) -> bool:
    """The rollout pod's startup probe, once: `/health` answers 200 (vLLM serves HTTP only once its model is loaded)."""
    return http_get(f"{url}/health", timeout=HEALTH_REQUEST_TIMEOUT_S) is not None


@dataclass
class Liveness:
    """The kubelet's startup and liveness probes for local servers: never blocks the supervisor (probes run on a
    thread pool).

    As in the pod, liveness probes begin once the startup probe saw `/health` answer (a model load takes minutes),
    and from there every probe without a token counts, the first one included: a server that hangs before any
    probe got a token from it (probes are a period apart, and a hang can come sooner) is restarted all the same.
    """

    model: str
    period_s: float = LIVENESS_PERIOD_S
    failure_threshold: int = LIVENESS_FAILURE_THRESHOLD
    timeout_s: float = PROBE_TIMEOUT_S
    probe: Callable[[str, str, float], str | None] = probe_generation
    startup_poll_s: float = STARTUP_POLL_S
    startup: Callable[[str], bool] = health_answers
    failures: Counter = field(default_factory=Counter)
    _started: set = field(default_factory=set)  # servers whose startup probe passed
    _pending: dict = field(default_factory=dict)  # name -> Future (of the startup probe until it passes)
    _next_at: dict = field(default_factory=dict)  # name -> monotonic time of the next probe
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(thread_name_prefix="liveness"))

    def hung(self, process: LocalProcess) -> str | None:
        """Why the running server counts as hung now, else None; starts its next probe when one is due."""
        name = process.plan.name
        pending: Future | None = self._pending.get(name)
        verdict = None
        if pending is not None and pending.done():
            del self._pending[name]
            if name not in self._started:
                if pending.result():  # the startup probe passed: liveness probes begin at once
                    self._started.add(name)
                    self._next_at[name] = 0.0
            elif (error := pending.result()) is None:
                self.failures[name] = 0
            else:
                self.failures[name] += 1
                if self.failures[name] >= self.failure_threshold:
                    verdict = f"hung: no token from {self.failures[name]} liveness probes in a row ({error})"
        now = time.monotonic()
        if name not in self._pending and now >= self._next_at.get(name, 0.0):
            if name in self._started:
                self._next_at[name] = now + self.period_s
                self._pending[name] = self._pool.submit(self.probe, process.plan.url, self.model, self.timeout_s)
            else:
                self._next_at[name] = now + self.startup_poll_s
                self._pending[name] = self._pool.submit(self.startup, process.plan.url)
        return verdict

    def forget(self, name: str) -> None:
        """A restarted server starts over: its startup probe first, no failures (a probe of the old process is
        dropped)."""
        self._started.discard(name)
        self.failures.pop(name, None)
        self._pending.pop(name, None)
        self._next_at.pop(name, None)
