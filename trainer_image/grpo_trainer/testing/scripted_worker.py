"""A rollout worker that needs no inference server: scripted rewards, real RolloutSamples.

Implements TRL's `RolloutWorkerProtocol`, so the real trainer consumes it exactly as it consumes TRL's
AsyncRolloutWorker: same sample type, same advantage formula
(`trl/experimental/async_grpo/async_rollout_worker.py:1026-1124 (trl 1.16.0)`), same group ids growing across
passes, same `_loop_kwargs["dataset_start_index"]` for resume. Tests and benchmarks use it to script drops
(no-signal groups, stale or lost groups) deterministically; users can use it to dry-run a learner configuration on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..agentic.episodes import stamp_group

#: (absolute group position, generation index) -> reward. Absolute = prompts x passes since the run began. NaN stands
#: for a completion every reward function returned None for.
RewardScript = Callable[[int, int], float]
#: (absolute group position, generation index) -> the training rows that conversation became (at least 1).
RowScript = Callable[[int, int], int]


def varied_rewards(position: int, generation: int) -> float:
    return float(generation % 2)


def never(position: int) -> bool:
    return False


@dataclass(frozen=True)
class GroupScript:
    """What happens to each group, by its absolute position: its rewards; whether it is `lost` (never queued);
    whether its rollout logprobs are far from any learner's (`off_policy`: an importance ratio of about
    e^(5 x completion tokens)) or NaN (`nan_logprobs`: a server that returned no logprob), the training step's
    scoring cases; after how many groups the worker fails (`fail_after_groups`); and how many training rows each
    conversation becomes (`rows`: a conversation TRL's tool loop forked; the group is then stamped exactly as
    grpo_trainer.rollout.worker.EpisodeRolloutLoop stamps it). None: never (one unstamped row each)."""

    reward: RewardScript = varied_rewards
    lost: Callable[[int], bool] | None = None
    off_policy: Callable[[int], bool] | None = None
    nan_logprobs: Callable[[int], bool] | None = None
    fail_after_groups: int | None = None
    rows: RowScript | None = None


@dataclass(frozen=True)
class SampleShape:
    """What a scripted sample looks like: token ids drawn from [2, vocab_size), a completion ending in eos."""

    vocab_size: int = 256
    prompt_tokens: int = 8
    completion_tokens: int = 8
    eos_token_id: int = 1


DEFAULT_SCRIPT = GroupScript()
DEFAULT_SHAPE = SampleShape()


class ScriptedRolloutWorker:
    def __init__(
        self,
        *,
        dataset_size: int,
        num_generations: int,
        script: GroupScript = DEFAULT_SCRIPT,
        shape: SampleShape = DEFAULT_SHAPE,
        queue_maxsize: int = 64,
        seed: int = 0,
        delay_s: float = 0.0,
        prompt_text: Callable[[int], str] | None = None,
    ):
        self.dataset_size = dataset_size
        self.num_generations = num_generations
        self.reward = script.reward
        self.lost = script.lost or never
        self.off_policy = script.off_policy or never
        self.nan_logprobs = script.nan_logprobs or never
        self.fail_after_groups = script.fail_after_groups
        self.rows = script.rows
        self.vocab_size = shape.vocab_size
        self.prompt_tokens = shape.prompt_tokens
        self.completion_tokens = shape.completion_tokens  # a subclass may change it per group (bench/learner_run.py)
        self.eos_token_id = shape.eos_token_id
        self.seed = seed
        self.delay_s = delay_s
        self.prompt_text = prompt_text or (lambda index: f"prompt {index}")  # prompt index -> the user's text
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self._loop_kwargs = {"dataset_start_index": 0}
        self.model_version = 0
        self.groups_generated = 0
        self.samples_generated = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # RolloutWorkerProtocol ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="scripted-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"scripted rollout worker died: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("scripted rollout worker stopped")

    # generation ----------------------------------------------------------------------------------------------------
    def group_samples(self, group_id: int, position: int) -> list[RolloutSample]:
        """The samples of one group, deterministic in (seed, position)."""
        rng = np.random.default_rng([self.seed, position % self.dataset_size])
        prompt = rng.integers(2, self.vocab_size, self.prompt_tokens)
        rewards = np.array([self.reward(position, k) for k in range(self.num_generations)], dtype=float)
        # TRL's rule for unscored completions: advantage 0, the group normalised over the scored ones.
        scored = ~np.isnan(rewards)
        advantages = np.zeros_like(rewards)
        std = float(rewards[scored].std()) if scored.any() else float("nan")
        if scored.any():
            advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (std + 1e-8)
        samples = []
        old_log_prob = -np.log(self.vocab_size)
        if self.off_policy(position):
            old_log_prob -= 5.0
        if self.nan_logprobs(position):
            old_log_prob = np.nan
        rows_per_episode = [self.rows(position, k) if self.rows else 1 for k in range(self.num_generations)]
        for k, rows in enumerate(rows_per_episode):
            for _ in range(rows):  # a forked conversation's rows: its tokens differ, its reward and advantage do not
                completion = rng.integers(2, self.vocab_size, self.completion_tokens)
                completion[-1] = self.eos_token_id
                input_ids = np.concatenate([prompt, completion]).astype(np.int64)
                mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(completion))]).astype(np.int64)
                samples.append(
                    RolloutSample(
                        prompt=[{"role": "user", "content": self.prompt_text(position % self.dataset_size)}],
                        completion=[{"role": "assistant", "content": f"completion {k}"}],
                        input_ids=input_ids,
                        completion_mask=mask,
                        old_log_probs=np.full(len(input_ids), old_log_prob, dtype=np.float32),
                        advantage=float(advantages[k]),
                        model_version=self.model_version,
                        group_id=group_id,
                        metrics={"reward": float(rewards[k]), "reward_std": std},
                        enqueued_at=time.time(),
                    )
                )
        if self.rows is not None:
            generations = self.num_generations
            stamp_group(samples, rows_per_episode, turns=[1] * generations, tool_calls=[0] * generations,
                        tool_failures=[0] * generations, failed_environments=[None] * generations)
        return samples

    def _run(self) -> None:
        try:
            start = self._loop_kwargs["dataset_start_index"]
            group_id = 0
            while not self._stop.is_set():
                if self.fail_after_groups is not None and group_id >= self.fail_after_groups:
                    raise RuntimeError(f"scripted failure after {group_id} groups")
                position = start + group_id
                if not self.lost(position):
                    for sample in self.group_samples(group_id, position):
                        if not self._put(sample):
                            return
                        self.samples_generated += 1
                self.groups_generated += 1
                group_id += 1
                if self.delay_s:
                    time.sleep(self.delay_s)
        except BaseException as error:  # noqa: BLE001 - surfaced through check_health, like TRL's worker
            self._error = error

    def _put(self, sample: RolloutSample) -> bool:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class NoWeightTransfer:
    """TRL's `WeightTransferProtocol` for a worker with no inference server to update (scripted rewards)."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator) -> None:
        for _ in iterator:  # drain: on FSDP the iterator drives collectives every rank must join
            pass

    def resume(self) -> None: ...

    def destroy(self) -> None: ...
