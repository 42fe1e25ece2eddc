"""TRL's AsyncRolloutWorker, supervised: a worker child that dies ends the learner, quickly and by name.

TRL's parent side learns of its child's death only through an event the child sets while raising (a SIGKILL, the
OOM killer's, sets nothing: the parent then waits for the heartbeat's 300 s), and its `stop()` sets a
multiprocessing event the child's watcher thread waits on. Setting such an event waits, without a timeout, for
every waiter to wake (`multiprocessing.synchronize.Condition.notify`): a waiter in a dead process never does, and
the learner hung there for good after its worker child had died. This subclass checks the child's exit too, turns
the child's last error back into the exception it was (a reward's RewardResultError keeps its class, so the
learner can exit as invalid config), and stops the child without waiting on it for more than a few seconds.

TRL builds the worker itself (`async_grpo_trainer.py:1367 (trl 1.16.0)`); GRPOLearner makes it this class, whose
child runs `EpisodeRolloutLoop`: TRL's loop, with each group's rows stamped for the learner's accounting
(grpo_trainer.agentic.episodes), an episode whose environment failed made unscorable (grpo_trainer.agentic.tools),
and, given `routing`, each generation request sent straight to a rollout server of the learner's pool
(grpo_trainer.rollout.router) instead of to TRL's one URL.
"""

from __future__ import annotations

import logging
import math
import queue
import signal
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from ..agentic.episodes import completion_turns, stamp_group
from ..agentic.tools import EpisodeRecord, episode_of
from ..learner.rewards import RewardFunctionError, RewardResultError
from .router import RouterSettings, ServerRouter
from .sync_watchdog import DaemonCall

logger = logging.getLogger(__name__)

#: How long the child's stop event may take to set: its only waiter is the child's watcher thread, which wakes at once.
STOP_EVENT_TIMEOUT_S = 5.0
#: A live child's time to leave after the stop event, then after SIGTERM (TRL's own 15 s and 5 s).
STOP_JOIN_S = 15.0
TERMINATE_JOIN_S = 5.0
#: The child's time to leave after the stop event once the learner is preempted: the pod's grace period (120 s for
#: learner pods unless the user sets it) also holds the checkpoint, and the generations in flight are regenerated
#: after the resume anyway.
PREEMPTED_STOP_JOIN_S = 1.0
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


#: TRL's advantage epsilon (`async_rollout_worker.py:1065 (trl 1.16.0)`).
_ADVANTAGE_EPS = 1e-8


class EpisodeRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child), stamping each group for the learner (grpo_trainer.agentic.episodes).

    An episode whose guarded environment failed (grpo_trainer.agentic.tools) is unscorable: its reward is NaN whatever
    the other rewards said, and the group's advantages are TRL's normalisation over the episodes that remain.

    `routing`: the learner's pool of rollout servers; each request then goes to one of them (TRL's `_post`, the one
    place its loop sends from, is where), with TRL's own retries around it.
    """

    def __init__(self, *, routing: RouterSettings | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if routing is not None and not all(callable(vars(_AsyncRolloutLoop).get(name)) for name in ("_post", "_retry")):
            raise RuntimeError("this TRL's rollout loop sends its requests other than through `_post`: the learner "
                               "cannot route them to its rollout servers (TRL 1.16's loop does)")
        self._router = ServerRouter(routing) if routing is not None else None
        # id(completion list) -> its episode's record, from the end of the conversation to its group's scoring. The
        # environment goes back to TRL's pool before then, and its next reset starts a new record.
        self._episodes: dict[int, EpisodeRecord] = {}

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        # TRL hands the episode's environment over only as the bound methods in `tool_dict`.
        environments = {id(owner): owner for owner in (getattr(f, "__self__", None) for f in tool_dict.values())
                        if episode_of(owner) is not None}
        episode = next((episode_of(env) for env in environments.values()), None)
        result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        if episode is not None:
            self._episodes[id(result[0])] = episode
        return result

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if self._router is None:
            return await super()._post(path, payload, timeout, max_retries)
        return await self._retry(lambda: self._router.post(self.session, path, payload, timeout),
                                 label=f"POST {path}", max_attempts=max_retries)

    async def _score_group(self, group):
        episodes = [self._episodes.pop(id(completion), None) for completion in group.completions]
        samples = await super()._score_group(group)
        rows_per_episode = [len(sequences) for sequences in group.completions_sequences]
        failed = [None if e is None or e.failure is None else e.environment for e in episodes]
        if any(label is not None for label in failed):
            for episode in episodes:
                if episode is not None and episode.failure is not None:
                    logger.warning("environment %r failed an episode (unscorable): %s", episode.environment,
                                   episode.failure)
            unscore(samples, rows_per_episode, [label is not None for label in failed])
        stamp_group(samples, rows_per_episode, turns=[completion_turns(c) for c in group.completions],
                    tool_calls=list(group.tool_call_counts), tool_failures=list(group.tool_failure_counts),
                    failed_environments=failed)
        return samples


def unscore(samples: list[Any], rows_per_episode: list[int], failed: list[bool]) -> None:
    """Make the failed episodes' rows unscorable (reward NaN, advantage 0, TRL's mark) and renormalise the rest.

    `samples` are one group's rows in conversation order, `rows_per_episode[i]` for conversation i.
    """
    owners = [i for i, rows in enumerate(rows_per_episode) for _ in range(rows)]
    first_row = {}
    for row, owner in enumerate(owners):
        first_row.setdefault(owner, row)
    rewards = {owner: samples[row].metrics.get("reward", math.nan) for owner, row in first_row.items()}
    scored = {owner: reward for owner, reward in rewards.items() if not failed[owner] and math.isfinite(reward)}
    values = np.array(list(scored.values()), dtype=float)
    mean = float(values.mean()) if len(values) else math.nan
    std = float(values.std()) if len(values) else math.nan
    for sample, owner in zip(samples, owners, strict=True):
        if owner in scored:
            sample.advantage = float((scored[owner] - mean) / (std + _ADVANTAGE_EPS))
        else:
            sample.advantage = 0.0
            sample.metrics["reward"] = math.nan
        sample.metrics["reward_std"] = std


class SupervisedRolloutWorker(AsyncRolloutWorker):
    """AsyncRolloutWorker whose health check sees a dead child and whose stop cannot hang on one."""

    _loop_cls = EpisodeRolloutLoop
    # A class default: TRL builds the worker, and GRPOLearner only swaps its class.
    _stop_join_s = STOP_JOIN_S

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

    def abandon_in_flight(self) -> None:
        """The learner is preempted: `stop()` no longer waits for the child's work in flight (generations on servers
        being drained with the learner, a reward or tool that does not return). Called from the signal handler."""
        self._stop_join_s = PREEMPTED_STOP_JOIN_S

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
            process.join(self._stop_join_s)
        if process.exitcode is None:
            logger.warning("the rollout worker child did not exit within %.0fs; terminating it", self._stop_join_s)
            process.terminate()
            process.join(TERMINATE_JOIN_S)
        if process.exitcode is None:
            process.kill()
            process.join(TERMINATE_JOIN_S)
