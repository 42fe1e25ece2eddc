"""Experiment tracking: what the learner hands MLflow, TensorBoard and Weights & Biases beside TRL's own curves.

Torch-free. TRL reaches the trackers through transformers' `report_to` integrations, each logging the dict
`Trainer.log` receives; `progress_logs` is what the learner adds to that dict, so our progress numbers sit beside
TRL's loss and entropy on the same steps.
"""

from __future__ import annotations

from . import contract as c

#: Prefix of the progress numbers in a tracker (TRL's own keys are `loss`, `entropy`, `completions/...`).
PROGRESS_PREFIX = "progress/"


def progress_logs(report: c.ProgressReport) -> dict[str, float]:
    """The progress numbers a tracker plots per logged step: groups, drops by reason, stall streak, rollout wait."""
    logs = {
        f"{PROGRESS_PREFIX}groups_consumed": float(report.groups_consumed),
        f"{PROGRESS_PREFIX}groups_trained": float(report.groups_trained),
        f"{PROGRESS_PREFIX}groups_total": float(report.groups_total),
        f"{PROGRESS_PREFIX}epochs_done": float(report.epochs_done),
        f"{PROGRESS_PREFIX}stall_streak": float(report.stall_streak),
        f"{PROGRESS_PREFIX}rollout_wait_s": float(report.rollout_wait_seconds),
        f"{PROGRESS_PREFIX}weight_version": float(report.weight_version),
    }
    for reason, count in sorted(report.dropped.items()):
        logs[f"{PROGRESS_PREFIX}groups_dropped/{reason}"] = float(count)
    return logs
