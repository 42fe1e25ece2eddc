"""Rollout servers that exit are started again in place, with their own counter and limit.

A vLLM server never ends by itself: any exit, 0 included (vLLM exits 0 after its engine dies), is a failure. The
learner's balancer takes the dead server out of its pool and goes on with the others (or waits, bounded, when it was
the only one); this module starts it again and the balancer admits it once it generates and has loaded the current
weights. Only when a server has used up `limit` restarts is its exit left to the run's failure policy (the operator's
status derivation), with the engine's error line as the pod's message. Learner restarts (`runPolicy.backoffLimit`)
are not spent on rollout servers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from grpo_trainer.rollout import EXIT_LINE_PREFIX

from ...api import DEFAULT_ROLLOUT_RESTART_LIMIT
from .processes import LocalProcess, tail

__all__ = ["DEFAULT_ROLLOUT_RESTART_LIMIT", "RolloutRestarts", "exit_line"]


def exit_line(log_path: Path) -> str | None:
    """The rollout entrypoint's last words (`vLLM exited with code N: RuntimeError: ...`), if it printed them."""
    lines = [line for line in tail(log_path).splitlines() if line.startswith(EXIT_LINE_PREFIX)]
    return lines[-1].removeprefix(EXIT_LINE_PREFIX) if lines else None


@dataclass
class RolloutRestarts:
    limit: int = DEFAULT_ROLLOUT_RESTART_LIMIT
    counts: Counter = field(default_factory=Counter)

    def tick(self, processes: Iterable[LocalProcess], log) -> None:
        """Start again each rollout server that exited, while its restarts last. `log` takes one line per restart."""
        for process in processes:
            if process.plan.role != "rollout" or process.popen is None or process.poll() is None:
                continue
            name = process.plan.name
            if self.counts[name] >= self.limit:
                continue  # used up: the run's failure policy sees the exit
            self.counts[name] += 1
            why = exit_line(process.log_path) or f"exited with code {process.exit_code}"
            log(f"Warning RolloutRestarted: {name}: {why}; restart {self.counts[name]}/{self.limit}")
            process.stop()
            process.start()

    @property
    def total(self) -> int:
        return sum(self.counts.values())
