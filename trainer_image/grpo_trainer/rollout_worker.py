"""TRL's AsyncRolloutWorker, supervised: a worker child that dies ends the learner, quickly and by name.

TRL's parent side learns of its child's death only through an event the child sets while raising (a SIGKILL, the
OOM killer's, sets nothing: the parent then waits for the heartbeat's 300 s), and its `stop()` sets a
multiprocessing event the child's watcher thread waits on. Setting such an event waits, without a timeout, for
every waiter to wake (`multiprocessing.synchronize.Condition.notify`): a waiter in a dead process never does, and
the learner hung there for good after its worker child had died. This subclass checks the child's exit too, turns
the child's last error back into the exception it was (a reward's RewardResultError keeps its class, so the
learner can exit as invalid config), and stops the child without waiting on it for more than a few seconds.

TRL builds the worker itself (`async_grpo_trainer.py:1367 (trl 1.16.0)`); GRPOLearner makes it this class.
"""

from __future__ import annotations

import logging
import queue
import signal

from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from .rewards import RewardFunctionError, RewardResultError
from .sync_watchdog import DaemonCall

logger = logging.getLogger(__name__)

#: How long the child's stop event may take to set: its only waiter is the child's watcher thread, which wakes at once.
STOP_EVENT_TIMEOUT_S = 5.0
#: A live child's time to leave after the stop event, then after SIGTERM (TRL's own 15 s and 5 s).
STOP_JOIN_S = 15.0
TERMINATE_JOIN_S = 5.0
#: The child puts its error on a queue just before it sets its failed event; the queue's feeder thread may lag.
ERROR_INFO_WAIT_S = 2.0

#: The child's errors that keep their class in the learner (what the learner's exit code depends on).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (RewardResultError, RewardFunctionError)
}


class RolloutWorkerDied(RuntimeError):
    """TRL's rollout worker child ended while the learner still needed it."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class SupervisedRolloutWorker(AsyncRolloutWorker):
    """AsyncRolloutWorker whose health check sees a dead child and whose stop cannot hang on one."""

    def child_failure(self) -> Exception | None:
        """Why the child can no longer produce samples, or None while it can."""
        process = self._process
        if self._failed_event.is_set():
            try:
                type_name, message, child_traceback = self._exception_info_queue.get(timeout=ERROR_INFO_WAIT_S)
            except queue.Empty:
                return RolloutWorkerDied("TRL's rollout worker child failed and left no error; see the learner log")
            logger.error("rollout worker child failed:\n%s", child_traceback)
            known = _KNOWN_ERRORS.get(type_name)
            if known is not None:
                return known(message)
            return RolloutWorkerDied(f"TRL's rollout worker child failed: {type_name}: {message}")
        if process is not None and process._popen is not None and process.exitcode is not None:
            return RolloutWorkerDied(f"TRL's rollout worker child (pid {process.pid}) died: "
                                     f"{describe_exit(process.exitcode)}; it runs the reward functions "
                                     f"{', '.join(self.reward_labels())}")
        return None

    def reward_labels(self) -> list[str]:
        """The configured names of the reward functions the child runs (user code: the first suspect)."""
        funcs = self._loop_kwargs.get("reward_funcs") or []
        return [repr(getattr(func, "label", getattr(func, "__name__", type(func).__name__))) for func in funcs]

    def check_health(self, stale_after_s: float) -> None:
        failure = self.child_failure()
        if failure is not None:
            raise failure from None  # not "during handling of queue.Empty": the poll that found it
        super().check_health(stale_after_s)

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        if process._popen is None:  # start() failed before the child was spawned
            return
        if process.exitcode is None:
            logger.info("Stopping AsyncRolloutWorker child process...")
            # On a daemon thread: the child may die between the check above and the set, and the set then never
            # returns. Left blocked, it ends with the process.
            if not DaemonCall(self._stop_event_mp.set, "grpo-rollout-worker-stop").join(STOP_EVENT_TIMEOUT_S):
                logger.warning("the rollout worker child's stop event did not set within %.0fs", STOP_EVENT_TIMEOUT_S)
            process.join(STOP_JOIN_S)
        if process.exitcode is None:
            logger.warning("the rollout worker child did not exit within %.0fs; terminating it", STOP_JOIN_S)
            process.terminate()
            process.join(TERMINATE_JOIN_S)
        if process.exitcode is None:
            process.kill()
            process.join(TERMINATE_JOIN_S)
