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

import asyncio
import ctypes
import logging
import math
import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from ..agentic.availability import release_waits
from ..agentic.episodes import ENVIRONMENT_FAILED_KEY, completion_turns, stamp_group
from ..agentic.tools import (
    EpisodeRecord,
    GuardedEnvironmentFactory,
    episode_of,
    failed_reward_environment,
    is_abandoned,
)
from ..learner.rewards import CheckedReward, RewardFunctionError, RewardResultError, UserCodeError
from .metrics_batch import MetricsBatch
from .prompt_cache import CachedChatTemplate
from .router import RouterSettings, ServerRouter
from .sync_watchdog import DaemonCall

logger = logging.getLogger(__name__)

#: How long the child's stop event may take to set: its only waiter is the child's watcher thread, which wakes at once.
STOP_EVENT_TIMEOUT_S = 5.0
#: A live child's time to leave after the stop event, then after SIGTERM (TRL's own 15 s and 5 s).
STOP_JOIN_S = 15.0
TERMINATE_JOIN_S = 5.0
#: How often a stop waiting for the child reads what the child still sends.
QUEUE_READ_INTERVAL_S = 0.1
#: The child's time to leave after the stop event once the learner is preempted: the pod's grace period (120 s for
#: learner pods unless the user sets it) also holds the checkpoint, and the generations in flight are regenerated
#: after the resume anyway.
PREEMPTED_STOP_JOIN_S = 1.0
#: The child puts its error on a queue just before it sets its failed event; the queue's feeder thread may lag.
ERROR_INFO_WAIT_S = 2.0

#: linux/prctl.h: the signal a process gets when the thread that spawned it ends.
PR_SET_PDEATHSIG = 1



class RolloutWorkerDied(RuntimeError):
    """TRL's rollout worker child ended while the learner still needed it."""


class UserCodeStartError(UserCodeError):
    """The user's code (an environment factory, a reward, a tool) raised while TRL's child set up its rollout loop:
    the same code raises the same way on every retry."""


#: The child's errors that keep their class in the learner (what the learner's exit code depends on).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (RewardResultError, RewardFunctionError, UserCodeStartError)
}


def user_code(loop_kwargs: dict[str, Any]) -> dict[str, str]:
    """The user's code the rollout loop runs, `{module: what it is}` ("environment factory 'mod:make'")."""
    named: dict[str, str] = {}
    for reward in loop_kwargs.get("reward_funcs") or ():
        if isinstance(reward, CheckedReward):
            named.setdefault(reward.func.__module__, f"reward function {reward.label!r}")
    for tool in loop_kwargs.get("tools") or ():
        named.setdefault(tool.__module__, f"tool '{tool.__module__}:{tool.__qualname__}'")
    factories = loop_kwargs.get("environment_factory")
    for factory in factories.values() if isinstance(factories, dict) else (factories,):
        if isinstance(factory, GuardedEnvironmentFactory):
            named.setdefault(factory.factory.__module__, f"environment factory {factory.spec!r}")
    return named


def start_error(error: BaseException, loop_kwargs: dict[str, Any]) -> UserCodeStartError | None:
    """`error`, raised while the rollout loop was set up, as the user's code's error when it was raised in it (the
    innermost frame in one of the user's modules names it), else None: TRL's own set-up failed."""
    named = user_code(loop_kwargs)
    module = None
    frame = error.__traceback__
    while frame is not None:
        name = frame.tb_frame.f_globals.get("__name__")
        if name in named:
            module = name
        frame = frame.tb_next
    if module is None:
        return None
    return UserCodeStartError(f"{named[module]} raised while the rollout worker started (module {module!r}): "
                              f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


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


def die_with_parent() -> None:
    """In the worker's child: SIGKILL it when the learner thread that spawned it ends, however that ends.

    TRL's child outlived a SIGKILLed learner (the kubelet's after the grace period, the OOM killer's, a killed
    `grporun local`), busy in a reward or an environment and holding their memory. The signal follows the spawning
    thread: TRL starts the child from the trainer's `on_train_begin`, on the learner's main thread. A learner that
    died before the signal was set (the child's imports take seconds) has left the child to another parent already.
    """
    if sys.platform != "linux":
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)


class EpisodeRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child), stamping each group for the learner (grpo_trainer.agentic.episodes).

    An episode whose guarded environment failed (grpo_trainer.agentic.tools) is unscorable: its reward is NaN whatever
    the other rewards said, and the group's advantages are TRL's normalisation over the episodes that remain. The
    child dies with the learner (`die_with_parent`).

    `routing`: the learner's pool of rollout servers; each request then goes to one of them (TRL's `_post`, the one
    place its loop sends from, is where), with TRL's own retries around it.

    Three of TRL's costs per completion are left out: its metrics go to the learner merged a few times a second
    (grpo_trainer.rollout.metrics_batch), a group's prompt is rendered through the chat template once, not once per
    completion (grpo_trainer.rollout.prompt_cache), and the tokenizer's response template is built once
    (`preload_response_template`).
    """

    def __init__(self, *, routing: RouterSettings | None = None, **kwargs: Any):
        die_with_parent()  # first: TRL's set-up builds the environments, which may start processes of their own
        try:
            super().__init__(**kwargs)
        except Exception as error:
            # TRL reports only the loop's run to the learner: a set-up error was the child's exit 1 alone, a crash
            # the operator retried. The user's code's error goes back as TRL's run reports one; the child still dies.
            user_error = start_error(error, kwargs)
            if user_error is not None:
                kwargs["exception_info_queue"].put_nowait((type(user_error).__name__, str(user_error),
                                                           traceback.format_exc()))
                kwargs["failed_event"].set()
            raise
        if self.environment_factories is not None:
            self._environment_pool = {name: ReusableEnvironments(pool)
                                      for name, pool in self._environment_pool.items()}
        preload_response_template(self.tokenizer)
        if not isinstance(self.tokenizer.apply_chat_template, CachedChatTemplate):  # one cache per tokenizer
            self.tokenizer.apply_chat_template = CachedChatTemplate(self.tokenizer.apply_chat_template)
        self._metrics_queue = MetricsBatch(self._metrics_queue)
        if routing is not None and not all(callable(vars(_AsyncRolloutLoop).get(name)) for name in ("_post", "_retry")):
            raise RuntimeError("this TRL's rollout loop sends its requests other than through `_post`: the learner "
                               "cannot route them to its rollout servers (TRL 1.16's loop does)")
        self._router = ServerRouter(routing) if routing is not None else None
        # id(completion list) -> its episode's record, from the end of the conversation to its group's scoring. The
        # environment goes back to TRL's pool before then, and its next reset starts a new record.
        self._episodes: dict[int, EpisodeRecord] = {}

    async def _run_loops(self, stop_event) -> None:
        # TRL's generate loop awaits each reset before it looks at its stop: a reset waiting for an environment's
        # server (grpo_trainer.agentic.availability) must end at the stop, or the child never does.
        async def release_at_stop() -> None:
            await stop_event.wait()
            release_waits()

        releasing = asyncio.create_task(release_at_stop())
        try:
            await super()._run_loops(stop_event)
        finally:
            releasing.cancel()
            self._metrics_queue.flush()

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
        # An episode's record comes with its environment's tools; one with none (reset and get_reward only) is known
        # failed by the reward its guarded get_reward gave TRL. The guard logged each failure's cause.
        failed = [episode.environment if episode is not None and episode.failure is not None
                  else failed_reward_environment(reward)
                  for episode, reward in zip(episodes, group.env_rewards or [None] * len(episodes), strict=True)]
        if any(label is not None for label in failed):
            unscore(samples, rows_per_episode, [label is not None for label in failed])
        stamp_group(samples, rows_per_episode, turns=[completion_turns(c) for c in group.completions],
                    tool_calls=list(group.tool_call_counts), tool_failures=list(group.tool_failure_counts),
                    failed_environments=failed)
        return samples


def preload_response_template(tokenizer: Any) -> None:
    """Build the tokenizer's response template once. TRL parses every completion (tool calls or not) with
    transformers' `parse_response`, which rebuilds the template from its dict, regular expressions and all, at each
    call, and takes a built one as it is: 0.03 ms a parse instead of 0.08 with the tiny model's. A parse only reads
    the template (each copies its defaults)."""
    from transformers.utils.chat_parsing.response_templates import load_response_template

    template = getattr(tokenizer, "response_template", None)
    if isinstance(template, dict):
        tokenizer.response_template = load_response_template(template)


class ReusableEnvironments(list):
    """One environment's pool of instances in TRL's loop, which never takes back an instance whose call was abandoned
    past its deadline (grpo_trainer.agentic.tools): that call may still change it. TRL makes a new one instead."""

    def append(self, environment: Any) -> None:
        if not is_abandoned(environment):
            super().append(environment)


def unscore(samples: list[Any], rows_per_episode: list[int], failed: list[bool]) -> None:
    """Make the failed episodes' rows unscorable (reward NaN, advantage 0, TRL's mark; marked as the environment's
    failure for the learner's filter) and renormalise the rest.

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
            if failed[owner]:
                sample.metrics[ENVIRONMENT_FAILED_KEY] = 1.0
        sample.metrics["reward_std"] = std


def join_reading(process: multiprocessing.process.BaseProcess, queues: tuple[Any, ...], timeout_s: float) -> None:
    """Wait up to `timeout_s` for `process` to exit, reading (and dropping) what it still sends on `queues`
    meanwhile. A process exits only once its queues' feeder threads have written all it put: once training ended
    nothing read the samples the child generated ahead, and a full pipe held it until it was terminated."""
    deadline = time.monotonic() + timeout_s
    while process.exitcode is None and time.monotonic() < deadline:
        for sent in queues:
            try:
                while True:
                    sent.get_nowait()
            except queue.Empty:
                pass
        process.join(min(QUEUE_READ_INTERVAL_S, max(0.0, deadline - time.monotonic())))


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

    def start(self) -> None:
        try:
            super().start()
        except RuntimeError:  # TRL's "child exited during init": the child's own error says more when it left one
            failure = self.child_failure() if self._failed_event.is_set() else None
            if failure is None:
                raise
            raise failure from None

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
            join_reading(process, (self.rollout_buffer, self.metrics_queue), self._stop_join_s)
        if process.exitcode is None:
            logger.warning("the rollout worker child did not exit within %.0fs; terminating it", self._stop_join_s)
            process.terminate()
            process.join(TERMINATE_JOIN_S)
        if process.exitcode is None:
            process.kill()
            process.join(TERMINATE_JOIN_S)
