"""A local rollout server's last words, as a pod's termination message would carry them.

A rollout server that exits (any code: vLLM exits 0 after its engine died) is replaced by the shared state machine
(grpo_operator.status.rollout_exits) with its own counter and `runPolicy.rolloutRestartLimit`, exactly as under the
operator: `grporun local` only stops the process (RecreatePods) and starts it again (CreateChildren). The engine's
error line reaches the run's status from the entrypoint's exit line, which the kubelet would keep as the pod's
termination message.
"""

from __future__ import annotations

from pathlib import Path

from grpo_trainer.rollout import EXIT_LINE_PREFIX

from .processes import tail


def exit_line(log_path: Path) -> str | None:
    """The rollout entrypoint's exit line (`grpo rollout: vLLM exited with code N: RuntimeError: ...`), if any."""
    lines = [line for line in tail(log_path).splitlines() if line.startswith(EXIT_LINE_PREFIX)]
    return lines[-1] if lines else None
