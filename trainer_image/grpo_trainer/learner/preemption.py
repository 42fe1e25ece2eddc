"""SIGTERM in a learner process: checkpoint, then exit as preempted (contract.codes.EXIT_PREEMPTED).

Kubernetes sends SIGTERM on pod deletion, node drain and spot reclaim, then SIGKILL after the pod's grace period.
Python's default ended the process without a checkpoint (up to `saveSteps` of work lost) and exit 143 counted
against the run's backoff. While training, the signal only asks the trainer to stop (GRPOLearner.request_preemption):
every rank stops at the same micro-batch, the checkpoint is saved, and the process exits preempted. Before training
there is nothing to save, so the handler raises Preempted at once. After training, SIGTERM leaves the model's upload
to an object store unfinished (grpo_trainer.storage.final_model: boto3's waits outlast the grace period): the process
exits preempted, its export kept on the output volume.

Torch-free, and installed before anything slow is imported: a signal that arrived while torch loaded would otherwise
kill the process the default way.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from functools import partial

logger = logging.getLogger(__name__)


class Preempted(BaseException):
    """SIGTERM before training started. A BaseException, so library `except Exception` blocks let it through."""


_stop_training: Callable[[], bool] | None = None
#: What the log says a SIGTERM does while training.
STOPPING_TRAINING = "stopping at the next micro-batch to save a checkpoint"
#: What the log says a SIGTERM does when `_stop_training` took it.
_stopping = STOPPING_TRAINING


def install() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


def route_to(stop_training: Callable[[], bool] | None,
             stopping: str = STOPPING_TRAINING) -> None:
    """From now on SIGTERM calls `stop_training`; it returns False when there is no training to stop. `stopping` is
    what the log says it does."""
    global _stop_training, _stopping
    _stop_training, _stopping = stop_training, stopping


def stop_on_sigterm(event: threading.Event, stopping: str) -> None:
    """From now on SIGTERM sets `event`: the work that watches it (the final model's upload) gives up."""
    route_to(partial(_set, event), stopping)


def _set(event: threading.Event) -> bool:
    event.set()
    return True


def settle() -> None:
    """The outcome is decided (training ended, its checkpoint or final model saved): a SIGTERM from now on (torchrun
    stopping the others once one rank's teardown failed, or the kubelet) only lets the process finish reporting it.
    Raising Preempted there escaped the entrypoint: the rank ended with a traceback and no outcome recorded."""
    route_to(_settled)


def _settled() -> bool:
    return True


#: time.monotonic() of the first SIGTERM; None before one arrived. The pod's grace period runs from it.
sigterm_at: float | None = None


def grace_left(grace_s: float) -> float:
    """Seconds of a `grace_s` grace period left since the first SIGTERM (all of it before one)."""
    return grace_s if sigterm_at is None else max(0.0, sigterm_at + grace_s - time.monotonic())


def _on_sigterm(signum: int, _frame) -> None:
    global sigterm_at
    if sigterm_at is None:
        sigterm_at = time.monotonic()
    if _stop_training is _settled:
        logger.warning("SIGTERM after the outcome was decided: finishing its report")
        return
    if _stop_training is not None and _stop_training():
        logger.warning("SIGTERM: %s", _stopping)
        return
    raise Preempted(f"preempted: signal {signum} before training started; nothing to save")
