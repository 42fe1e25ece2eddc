"""Rollout servers that exit are started again in place, with their own counter and limit.

A vLLM server never ends by itself: any exit, 0 included (vLLM exits 0 after its engine dies), is a failure. The
learner's balancer takes the dead server out of its pool and goes on with the others (or waits, bounded, when it was
the only one); this module starts it again and the balancer admits it once it generates and has loaded the current
weights. Only when a server has used up `limit` restarts is its exit left to the run's failure policy (the operator's
status derivation), with the engine's error line as the pod's message. Learner restarts (`runPolicy.backoffLimit`)
are not spent on rollout servers.

A server that hangs is restarted the same way: `Liveness` does what the kubelet does with the rollout pod's liveness
probe (builders.rollout_probes), with the same generation probe, period and failure threshold.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from grpo_trainer.rollout import EXIT_LINE_PREFIX
from grpo_trainer.rollout_health import (
    LIVENESS_FAILURE_THRESHOLD,
    LIVENESS_PERIOD_S,
    PROBE_TIMEOUT_S,
    probe_generation,
)

from .processes import STOP_GRACE_S, LocalProcess, tail

DEFAULT_ROLLOUT_RESTART_LIMIT = 3
#: A hung (e.g. stopped) server cannot act on SIGTERM: SIGKILL follows soon.
HUNG_STOP_GRACE_S = 2.0


def exit_line(log_path: Path) -> str | None:
    """The rollout entrypoint's last words (`vLLM exited with code N: RuntimeError: ...`), if it printed them."""
    lines = [line for line in tail(log_path).splitlines() if line.startswith(EXIT_LINE_PREFIX)]
    return lines[-1].removeprefix(EXIT_LINE_PREFIX) if lines else None


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


@dataclass
class RolloutRestarts:
    limit: int = DEFAULT_ROLLOUT_RESTART_LIMIT
    counts: Counter = field(default_factory=Counter)
    liveness: Liveness | None = None

    def tick(self, processes: Iterable[LocalProcess], log) -> None:
        """Start again each rollout server that exited or hung, while its restarts last. `log` takes one line per
        restart."""
        for process in processes:
            if process.plan.role != "rollout" or process.popen is None:
                continue
            if process.poll() is None:
                why = self.liveness.hung(process) if self.liveness is not None else None
                if why is None:
                    continue
            else:
                why = exit_line(process.log_path) or f"exited with code {process.exit_code}"
            name = process.plan.name
            if self.counts[name] >= self.limit:
                continue  # used up: the run's failure policy sees the exit (a hung one stays out of the pool)
            self.counts[name] += 1
            log(f"Warning RolloutRestarted: {name}: {why}; restart {self.counts[name]}/{self.limit}")
            process.stop(grace_s=HUNG_STOP_GRACE_S if process.poll() is None else STOP_GRACE_S)
            process.start()
            if self.liveness is not None:
                self.liveness.forget(name)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
