"""Reward models on the learner: `rewards: [{model: ...}]` scored on rank 0's device, inside the rollout stream.

TRL's rollout worker runs its reward functions in a spawned CPU child (`CUDA_VISIBLE_DEVICES=""`), where a learned
reward model cannot use the GPU. Here the worker scores only the reward functions (a placeholder that returns None
when there are none) and rank 0 scores each complete group with the reward models before the batcher sees it:
`score_step` combines the rewards the way TRL does (weighted, None-aware sum), takes unscorable samples out and
recomputes the group-normalised advantages TRL's loss reads. Scoring a whole group before batching is what makes the
normalisation exact: TRL's batchers split a group across micro-batches and ranks. A group with nothing left, or with
no signal after scoring, is dropped there and counted once like every other drop, so every rank still stops at the
same micro-batch (the progress package) and a checkpoint keeps it dropped.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..agentic.episodes import GROUP_ROWS_KEY, group_rows
from ..contract.codes import DropReason
from ..contract.config import REWARD_MODEL_BATCH_SIZE, RewardConfig
from .rewards import completion_text

logger = logging.getLogger(__name__)

#: TRL's advantage: (r - mean) / (std + eps) over the group's scored samples
#: (`trl/experimental/async_grpo/async_rollout_worker.py:1065 (trl 1.16.0)`).
ADVANTAGE_EPS = 1e-8


class RewardModel:
    """One sequence-classification reward model: prompt + completion in, one float out (NaN when unscorable).

    Batched, under `torch.no_grad`, in `dtype` on `device`. A sample longer than `max_length` reward-model tokens is
    unscorable (NaN) rather than truncated: a truncated completion would be scored on text it does not end with.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str, weight: float = 1.0,
                 batch_size: int = REWARD_MODEL_BATCH_SIZE, max_length: int | None = None):
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"reward model {name!r} has {num_labels} labels; a reward model has one")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.weight = weight
        self.batch_size = batch_size
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = tokenizer.pad_token_id  # the head pools the last non-pad token

    @classmethod
    def load(cls, config: RewardConfig, device: str) -> RewardModel:
        """Raises OSError/ValueError for a model that cannot be loaded (the caller names the field)."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = config.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
        tokenizer = AutoTokenizer.from_pretrained(config.model)
        model = AutoModelForSequenceClassification.from_pretrained(config.model, dtype=getattr(torch, dtype))
        return cls(model.to(device), tokenizer, name=config.model.rstrip("/").rsplit("/", 1)[-1],
                   weight=config.weight, batch_size=config.batch_size or REWARD_MODEL_BATCH_SIZE,
                   max_length=config.max_length)

    def text(self, prompt: Any, completion: Any) -> str:
        """What the model reads: its own chat template when it has one, else the prompt's and completion's text."""
        if getattr(self.tokenizer, "chat_template", None) and isinstance(prompt, list):
            messages = [*prompt, {"role": "assistant", "content": completion_text(completion)}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        prompt_text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
        return f"{prompt_text}\n{completion_text(completion)}"

    def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[float]:
        """One score per (prompt, completion); NaN for an over-context sample or a NaN/inf output."""
        import torch

        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        encoded = [self.tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
        scores = [math.nan] * len(texts)
        fits = [i for i, ids in enumerate(encoded) if self.max_length is None or len(ids) <= self.max_length]
        device = next(self.model.parameters()).device
        with torch.no_grad():
            for start in range(0, len(fits), self.batch_size):
                chunk = fits[start:start + self.batch_size]
                batch = self.tokenizer.pad({"input_ids": [encoded[i] for i in chunk]}, padding=True,
                                           return_tensors="pt")
                logits = self.model(input_ids=batch["input_ids"].to(device),
                                    attention_mask=batch["attention_mask"].to(device)).logits
                for i, value in zip(chunk, logits[:, 0].float().tolist(), strict=True):
                    scores[i] = value if math.isfinite(value) else math.nan
        return scores


@dataclass
class ScoredGroup:
    """`kept`: the samples that train, their advantages and reward metrics rewritten; `drop`: why none train."""

    kept: list[Any]
    drop: DropReason | None = None
    unscorable_samples: int = 0


def score_step(group: Sequence[Any], reward_models: Sequence[RewardModel], *, drop_no_signal: bool = True,
               no_signal_epsilon: float = 1e-6) -> ScoredGroup:
    """Score one complete group (TRL RolloutSamples) with the reward models and rewrite what the loss reads.

    A sample's final reward is TRL's: the None-aware sum of the weighted rewards, where the worker's summed reward
    functions (`metrics["reward"]`, NaN when they all returned None) are one term and each reward model another. A
    sample is unscorable, and taken out of the loss, when a reward model could not score it (NaN/inf output, longer
    than its context: a sum without that term would not compare with its group's other samples) or when no reward
    scored it at all. Advantages are TRL's group normalisation over the samples that remain.
    """
    if not group:
        return ScoredGroup([], DropReason.UNSCORABLE)
    prompts = [sample.prompt for sample in group]
    completions = [sample.completion for sample in group]
    model_scores = [(rm, rm.score(prompts, completions)) for rm in reward_models]
    finals: list[float] = []
    for i, sample in enumerate(group):
        terms = [float(sample.metrics.get("reward", math.nan))]
        missing = False
        for rm, scores in model_scores:
            weighted = rm.weight * scores[i]
            sample.metrics[f"rewards/{rm.name}"] = weighted
            missing = missing or not math.isfinite(weighted)
            terms.append(weighted)
        values = [t for t in terms if math.isfinite(t)]
        finals.append(math.nan if missing or not values else math.fsum(values))
    kept = [sample for sample, reward in zip(group, finals, strict=True) if not math.isnan(reward)]
    unscorable = len(group) - len(kept)
    if not kept:
        return ScoredGroup([], DropReason.UNSCORABLE, unscorable)
    rewards = np.array([reward for reward in finals if not math.isnan(reward)], dtype=float)
    std = float(rewards.std())
    if drop_no_signal and std <= no_signal_epsilon:
        return ScoredGroup([], DropReason.NO_SIGNAL, unscorable)
    advantages = (rewards - rewards.mean()) / (std + ADVANTAGE_EPS)
    for sample, reward, advantage in zip(kept, rewards, advantages, strict=True):
        sample.advantage = float(advantage)
        sample.metrics["reward"] = float(reward)
        sample.metrics["reward_std"] = std
    return ScoredGroup(kept, None, unscorable)


class ScoringQueue:
    """The rollout queue with reward-model scores: whole groups in, scored samples out (rank 0 only).

    Duck-types the queue SampleFilterQueue reads (`get(timeout)`, `get_nowait()`, `qsize()`). The worker puts a
    group's samples in one after the other (its single score loop), so a group is complete when `num_generations`
    samples arrived or the next group's first sample does (TRL drops rows with no trained token). A group with
    nothing left to train is reported with `drop(group_id, reason)`, which may end the stream (RolloutStop) here.
    """

    def __init__(self, inner: Any, reward_models: Sequence[RewardModel], *, num_generations: int,
                 drop: Callable[[int, DropReason], None], drop_no_signal: bool = True,
                 no_signal_epsilon: float = 1e-6, metrics: dict[str, list] | None = None):
        self.inner = inner
        self.reward_models = list(reward_models)
        self.num_generations = num_generations
        self.drop = drop
        self.drop_no_signal = drop_no_signal
        self.no_signal_epsilon = no_signal_epsilon
        self.metrics = metrics if metrics is not None else {}
        self.ready: deque = deque()
        self.pending: list[Any] = []
        self.samples_scored = 0
        self.unscorable_samples = 0
        self.seconds = 0.0

    def qsize(self) -> int:
        return self.inner.qsize() + len(self.ready)

    def get_nowait(self) -> Any:
        return self.get(timeout=0)

    def get(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            try:
                sample = self.inner.get_nowait()
            except queue.Empty:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise
                sample = self.inner.get(timeout=remaining)
            self._add(sample)
        return self.ready.popleft()

    def _add(self, sample: Any) -> None:
        # The sample joins `pending` before a group is scored: a drop may end the stream (RolloutStop) mid-call.
        if self.pending and self.pending[0].group_id != sample.group_id:
            group, self.pending = self.pending, [sample]
            self._score(group)
        else:
            self.pending.append(sample)
        if len(self.pending) >= group_rows(self.pending[0], self.num_generations):
            group, self.pending = self.pending, []
            self._score(group)

    def _score(self, group: list[Any]) -> None:
        started = time.perf_counter()
        scored = score_step(group, self.reward_models, drop_no_signal=self.drop_no_signal,
                            no_signal_epsilon=self.no_signal_epsilon)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        self.samples_scored += len(group)
        self.unscorable_samples += scored.unscorable_samples
        # (numerator, denominator) pairs: TRL's log reduces them as a rate over the logging window.
        self.metrics.setdefault("reward_model/score_s_per_sample", []).append((elapsed, len(group)))
        self.metrics.setdefault("reward_model/unscorable_frac", []).append((scored.unscorable_samples, len(group)))
        for sample in scored.kept:
            sample.metrics[GROUP_ROWS_KEY] = float(len(scored.kept))
        self.ready.extend(scored.kept)
        if scored.drop is not None:
            self.drop(int(group[0].group_id), scored.drop)
