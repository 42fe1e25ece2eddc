"""Trackers that fail mid-run: each tracker's integration (transformers' callback) runs on a thread of its own, so a
tracking server that stops answering or a directory that stops taking files holds no training step, and the run's
end waits for a tracker at most END_WAIT_S.

A call the tracker's server answered with a refusal of its data (`ThreadHooks.refused`: MLflow's 400 for a value it
will not take) loses that call's data only: a warning names the tracker and the server's reason, and the tracker goes
on. A tracker whose call raises otherwise, whose calls are still unfinished STUCK_AFTER_S after they were made, or
whose start or end does not finish within START_WAIT_S or END_WAIT_S is dropped for the rest of the run: one warning
names it and where it reports, its thread is left to itself (a daemon: it holds no exit), and the progress report
names it with the time it was dropped (ProgressReport.tracking_lost; the operator's TrackingDegraded condition). The
run's metrics from then on are not in that tracker.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ...contract.report import TRACKING_DEGRADED_LINE_MAX_CHARS, TrackerLossReport

logger = logging.getLogger(__name__)

#: How long the learner waits for a tracker's end (its queued metrics sent, its run closed) before it goes on without
#: it.
END_WAIT_S = 30.0
#: ... and for its start (its run opened, TrainingArguments logged as parameters: more calls, on a server the start-up
#: probe just found answering).
START_WAIT_S = 120.0
#: A tracker whose calls made mid-run are still unfinished after this long is dropped. Its own client gives up
#: sooner where it can be told to (MLflow's HTTP timeout and retries: mlflow_tracker.MLFLOW_HTTP_ENV); this bounds
#: the rest (a file system that hangs).
STUCK_AFTER_S = 60.0
#: The callback events whose end the learner waits for (bounded): the run's start, which the trackers' parameters
#: and the progress report read, and its end.
WAITED_EVENTS = frozenset({"on_train_begin", "on_train_end"})


class TrackerLosses:
    """The trackers dropped mid-run, shared by their guards and read by the progress report (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lost: dict[str, TrackerLossReport] = {}

    def lose(self, tracker: str, where: str, why: str) -> bool:
        """Drop `tracker` (once: the first failure is the one reported), with a warning naming it and `where`; True
        when this call dropped it."""
        reason = f"{why} ({where})"[:TRACKING_DEGRADED_LINE_MAX_CHARS]
        with self._lock:
            if tracker in self._lost:
                return False
            self._lost[tracker] = TrackerLossReport(tracker=tracker, since=time.time(), reason=reason)
        logger.warning(f"tracking: {tracker} at {where} dropped for the rest of the run: {why}; training goes on "
                       "without it and its metrics from now on are lost")
        return True

    def lost(self, tracker: str) -> bool:
        with self._lock:
            return tracker in self._lost

    def reports(self) -> list[TrackerLossReport]:
        with self._lock:
            return list(self._lost.values())


class _CallThread:
    """One daemon thread that runs a tracker's calls in order."""

    def __init__(self, name: str, setup: Callable[[], None]):
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, args=(setup,), name=f"tracker-{name}", daemon=True).start()

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._calls.put((call, future))
        return future

    def _run(self, setup: Callable[[], None]) -> None:
        setup()
        while True:
            call, future = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - the guard reads it from the future
                future.set_exception(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


@dataclass(frozen=True)
class ThreadHooks:
    """What a tracker's client needs around the thread its integration runs on (grpo_trainer.learner.tracking.base,
    `Tracker.thread_hooks`).

    setup: runs first on that thread (what the client keeps per thread: MLflow's active run).
    release: runs once the tracker is dropped: what the client would otherwise still send at exit, let go without a
        call to it (MLflow ends its active run at exit, retrying the lost server).
    refused: whether an error a call raised is the server's refusal of that call's data (it answered, and will take
        the next call's): the call's data are lost, the tracker is kept.
    """

    setup: Callable[[], None] = lambda: None
    release: Callable[[], None] = lambda: None
    refused: Callable[[BaseException], bool] = lambda error: False


def guarded(integration: Any, tracker: str, where: str, losses: TrackerLosses, hooks: ThreadHooks = ThreadHooks()):
    """`integration` (a transformers TrainerCallback) called on its own thread, dropped into `losses` when it fails
    (the module docstring says when). The original stays reachable as `.integration`."""
    from transformers import TrainerCallback

    events = [name for name in vars(TrainerCallback) if name.startswith("on_")
              # only the events the integration handles: the others would be calls that do nothing
              and getattr(type(integration), name) is not getattr(TrainerCallback, name)]

    class GuardedIntegration(TrainerCallback):
        def __init__(self):
            self.integration = integration
            self._thread = _CallThread(tracker, hooks.setup)
            self._pending: list[tuple[float, Future]] = []

        def settle(self, timeout_s: float) -> bool:
            """Wait up to `timeout_s` for the calls made so far; whether they all finished."""
            try:
                self._thread.submit(lambda: None).result(timeout=timeout_s)
            except FutureTimeout:
                return False
            return True

        def _lose(self, why: str) -> None:
            if losses.lose(tracker, where, why):
                hooks.release()

        def _call(self, event: str, args, state, control, kwargs) -> None:
            """On the tracker's thread: the integration's handler, unless the tracker was dropped meanwhile (the
            calls queued behind a failed one are not made)."""
            if losses.lost(tracker):
                return
            try:
                getattr(integration, event)(args, state, control, **kwargs)
            except Exception as error:  # noqa: BLE001 - whatever else the tracker's client raises drops it
                if hooks.refused(error):
                    logger.warning(f"tracking: {tracker} at {where} refused the data of {event} (step "
                                   f"{state.global_step}): {_first_line(error)}; they are not logged, the tracker "
                                   "goes on")
                    return
                self._lose(_first_line(error))

        def _check_pending(self) -> None:
            """Drop the tracker if a call made earlier is stuck; forget the calls that finished."""
            now = time.monotonic()
            self._pending = [(made, future) for made, future in self._pending if not future.done()]
            if self._pending and now - self._pending[0][0] > STUCK_AFTER_S:
                self._lose(f"a call made {now - self._pending[0][0]:.0f}s ago has not finished")

        def _forward(self, event: str, args, state, control, **kwargs):
            if losses.lost(tracker):
                return None
            self._check_pending()
            if losses.lost(tracker):
                return None
            # The trainer goes on changing its state (the step, the logs) while the call waits its turn.
            state = copy.copy(state)
            kwargs = {key: dict(value) if key == "logs" and value is not None else value
                      for key, value in kwargs.items()}
            future = self._thread.submit(lambda: self._call(event, args, state, control, kwargs))
            if event not in WAITED_EVENTS:
                self._pending.append((time.monotonic(), future))
                return None
            starting = event == "on_train_begin"
            wait_s = START_WAIT_S if starting else END_WAIT_S
            try:
                future.result(timeout=wait_s)
            except FutureTimeout:
                self._lose(f"its run's {'start' if starting else 'end'} did not finish within {wait_s:.0f}s")
            return None

    def forwarding(event: str):
        def method(self, args, state, control, **kwargs):
            return self._forward(event, args, state, control, **kwargs)
        method.__name__ = event
        return method

    for event in events:
        setattr(GuardedIntegration, event, forwarding(event))
    GuardedIntegration.__name__ = f"Guarded{type(integration).__name__}"
    return GuardedIntegration()
