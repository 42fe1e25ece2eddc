"""SIGTERM in a learner process: checkpoint, then exit as preempted (contract.codes.EXIT_PREEMPTED).

Kubernetes sends SIGTERM on pod deletion, node drain and spot reclaim, then SIGKILL after the pod's grace period.
Python's default ended the process without a checkpoint (up to `saveSteps` of work lost) and exit 143 counted
against the run's backoff. While training, the signal only asks the trainer to stop (GRPOLearner.request_preemption):
every rank stops at the same micro-batch, the checkpoint is saved, and the process exits preempted. Before training
there is nothing to save, so the handler raises Preempted at once.

Torch-free, and installed before anything slow is imported: a signal that arrived while torch loaded would otherwise
kill the process the default way.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Preempted(BaseException):
    """SIGTERM before training started. A BaseException, so library `except Exception` blocks let it through."""


_stop_training: Callable[[], bool] | None = None


def install() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


def route_to(stop_training: Callable[[], bool] | None) -> None:
    """From now on SIGTERM calls `stop_training`; it returns False when there is no training to stop."""
    global _stop_training
    _stop_training = stop_training


def settle() -> None:
    """The outcome is decided (training ended, its checkpoint or final model saved): a SIGTERM from now on (torchrun
    stopping the others once one rank's teardown failed, or the kubelet) only lets the process finish reporting it.
    Raising Preempted there escaped the entrypoint: the rank ended with a traceback and no outcome recorded."""
    route_to(_settled)


def _settled() -> bool:
    return True


def _on_sigterm(signum: int, _frame) -> None:
    if _stop_training is _settled:
        logger.warning("SIGTERM after the outcome was decided: finishing its report")
        return
    if _stop_training is not None and _stop_training():
        logger.warning("SIGTERM: stopping at the next micro-batch to save a checkpoint")
        return
    raise Preempted(f"preempted: signal {signum} before training started; nothing to save")
