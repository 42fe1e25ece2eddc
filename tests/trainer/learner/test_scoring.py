"""Reward models on the learner: the tiny reward model, `score_step`, and the ScoringQueue stage of rank 0's stream."""

from __future__ import annotations

import asyncio
import math
import queue
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import PartialState
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample, TrainingSequence, _AsyncRolloutLoop

from grpo_trainer.agentic.episodes import GROUP_ROWS_KEY
from grpo_trainer.contract.codes import DropReason
from grpo_trainer.contract.config import RewardConfig
from grpo_trainer.learner.rewards import load_rewards, unscored
from grpo_trainer.learner.scoring import RewardModel, ScoringQueue, score_step
from grpo_trainer.progress import RolloutProgress, RolloutStop, StopCode
from grpo_trainer.testing.tiny_assets import UNSCORABLE_MARKER


def prompt(text: str = "say apple") -> list[dict]:
    return [{"role": "user", "content": text}]


def completion(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def sample(group_id: int, k: int, *, reward: float = math.nan, text: str = "say apple") -> RolloutSample:
    ids = np.arange(2, 10, dtype=np.int64)
    return RolloutSample(
        prompt=prompt(text), completion=completion(["aaa", "banana", "the cat", "zebra moon"][k % 4] + "x" * k),
        input_ids=ids, completion_mask=np.ones_like(ids), old_log_probs=np.zeros(len(ids), dtype=np.float32),
        advantage=0.0, model_version=0, group_id=group_id, metrics={"reward": reward, "reward_std": math.nan},
    )


class FixedModel:
    """A reward model stand-in for the combination rules: scores by completion index, as scripted."""

    def __init__(self, scores: list[float], weight: float = 1.0, name: str = "fixed"):
        self.scores, self.weight, self.name = scores, weight, name

    def score(self, prompts, completions) -> list[float]:
        return list(self.scores[: len(completions)])


# ---------------------------------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def reward_model(tiny_reward_model_dir) -> RewardModel:
    return RewardModel.load(RewardConfig(model=tiny_reward_model_dir, batch_size=3), "cpu")


def test_tiny_reward_model_is_deterministic_and_batching_does_not_change_a_score(tiny_reward_model_dir,
                                                                                 reward_model):
    prompts = [prompt()] * 5
    completions = [completion(t) for t in ["aaa", "banana", "the cat", "zebra moon", "a much longer answer here"]]
    batched = reward_model.score(prompts, completions)  # batches of 3: padding inside a batch
    alone = [reward_model.score([p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
    assert np.allclose(batched, alone, atol=1e-5) and all(math.isfinite(s) for s in batched)
    assert len(set(np.round(batched, 6))) == 5  # distinct completions, distinct scores: groups carry signal
    again = RewardModel.load(RewardConfig(model=tiny_reward_model_dir), "cpu").score(prompts, completions)
    assert again == batched


def test_marked_prompts_score_nan_and_so_do_samples_past_the_context(tiny_reward_model_dir, reward_model):
    scores = reward_model.score([prompt(f"say {UNSCORABLE_MARKER} apple"), prompt()], [completion("aaa")] * 2)
    assert math.isnan(scores[0]) and math.isfinite(scores[1])
    fits = len(reward_model.tokenizer(reward_model.text(prompt(), completion("a")))["input_ids"])
    short = RewardModel.load(RewardConfig(model=tiny_reward_model_dir, max_length=fits), "cpu")  # exactly fits
    long_scores = short.score([prompt()] * 2, [completion("a"), completion("apple banana " * 20)])
    assert math.isfinite(long_scores[0]) and math.isnan(long_scores[1])


def test_a_model_returning_nan_or_inf_is_unscorable(nan_reward_model_dir, reward_model):
    scores = RewardModel.load(RewardConfig(model=nan_reward_model_dir), "cpu").score([prompt()], [completion("a")])
    assert math.isnan(scores[0])
    head = reward_model.model.score.weight
    saved = head.detach().clone()
    try:
        with torch.no_grad():
            head.fill_(math.inf)
        assert all(math.isnan(s) for s in reward_model.score([prompt()] * 2, [completion("aaa"), completion("b")]))
    finally:
        with torch.no_grad():
            head.copy_(saved)


def test_the_default_dtype_is_float32_on_cpu_and_a_set_dtype_wins(tiny_reward_model_dir, reward_model):
    assert reward_model.model.dtype == torch.float32
    bf16 = RewardModel.load(RewardConfig(model=tiny_reward_model_dir, dtype="bfloat16"), "cpu")
    assert bf16.model.dtype == torch.bfloat16
    assert np.allclose(bf16.score([prompt()], [completion("aaa")]), reward_model.score([prompt()], [completion("aaa")]),
                       atol=0.2)  # bf16 keeps ~3 significant digits of a score near 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU default is bfloat16)")
def test_on_gpu_the_default_dtype_is_bfloat16_and_scores_stay_finite(tiny_reward_model_dir):
    model = RewardModel.load(RewardConfig(model=tiny_reward_model_dir), "cuda:0")
    assert model.model.dtype == torch.bfloat16
    assert all(math.isfinite(s) for s in model.score([prompt()] * 3, [completion(t) for t in ("a", "bb", "c c")]))


def test_a_classifier_with_more_than_one_label_is_refused(reward_model):
    model = SimpleNamespace(config=SimpleNamespace(num_labels=2))
    with pytest.raises(ValueError, match="has 2 labels; a reward model has one"):
        RewardModel(model, reward_model.tokenizer, name="two-heads")


def test_reward_models_are_not_worker_rewards_and_a_model_only_config_leaves_a_placeholder():
    assert load_rewards([RewardConfig(model="org/rm")]) == [unscored]
    assert unscored(completions=["a", "b"]) == [None, None]
    funcs = load_rewards([RewardConfig(model="org/rm"), RewardConfig(name="constant")])
    assert [f.__name__ for f in funcs] == ["constant"]


# ---------------------------------------------------------------------------------------------------- score_step
def trl_advantages(final_rewards: list[float | None]) -> list[float]:
    """TRL 1.16's own `_score_group` on a group whose one reward function returns `final_rewards`."""

    def reward_func(completions, **_):
        return list(final_rewards)

    n = len(final_rewards)
    worker = SimpleNamespace(reward_funcs=[reward_func], reward_func_names=["r"], _env_reward_types=[],
                             _provides_rollout_reward=False)
    group = SimpleNamespace(
        completions=[completion(str(i)) for i in range(n)], prompts=[prompt()] * n, completions_ids=[[1]] * n,
        reward_kwargs={}, tool_call_counts=[0] * n, tool_failure_counts=[0] * n, model_version=0, group_id=0,
        env_rewards=[None] * n, rollout_rewards=[None] * n,
        completions_sequences=[[TrainingSequence([1, 2], [0, 1], [0.0, 0.0], None)] for _ in range(n)],
    )
    PartialState(cpu=True)  # TRL's worker logs through accelerate's logger, which needs the state
    samples = asyncio.run(_AsyncRolloutLoop._score_group(worker, group))
    return [s.advantage for s in samples]


def test_advantages_are_trls_group_normalisation_of_the_final_rewards():
    group = [sample(0, k, reward=[0.5, math.nan, 0.25, 1.0][k]) for k in range(4)]  # NaN: the functions gave None
    model = FixedModel([2.0, 1.0, 3.0, -1.0], weight=0.5)
    scored = score_step(group, [model])
    finals = [0.5 + 1.0, 0.5, 0.25 + 1.5, 1.0 - 0.5]  # None-aware sum: the model alone scores sample 1
    assert [s.metrics["reward"] for s in scored.kept] == pytest.approx(finals)
    assert [s.advantage for s in scored.kept] == pytest.approx(trl_advantages(finals))
    assert scored.kept[0].metrics["reward_std"] == pytest.approx(float(np.std(finals)))
    assert scored.kept[0].metrics["rewards/fixed"] == 1.0 and scored.drop is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_sample_the_model_cannot_score_leaves_the_loss_and_the_rest_renormalise(bad):
    group = [sample(0, k, reward=0.0) for k in range(4)]
    model = FixedModel([1.0, bad, 3.0, 5.0])
    scored = score_step(group, [model])
    assert [s.completion for s in scored.kept] == [group[k].completion for k in (0, 2, 3)]
    assert scored.unscorable_samples == 1
    assert [s.advantage for s in scored.kept] == pytest.approx(trl_advantages([1.0, 3.0, 5.0]))


def test_a_group_no_reward_could_score_is_unscorable():
    assert score_step([sample(0, k) for k in range(4)], []).drop == DropReason.UNSCORABLE  # every reward None
    group = [sample(0, k, reward=1.0) for k in range(4)]
    scored = score_step(group, [FixedModel([math.nan] * 4)])
    assert scored.drop == DropReason.UNSCORABLE and scored.kept == [] and scored.unscorable_samples == 4


def test_a_group_without_signal_after_scoring_is_no_signal_when_the_filter_says_so():
    group = [sample(0, k, reward=float(k)) for k in range(4)]  # the worker's rewards alone would have signal
    flat = FixedModel([3.0, 2.0, 1.0, 0.0])  # ... the model's cancel it out: every final reward is 3
    assert score_step(group, [flat]).drop == DropReason.NO_SIGNAL
    kept = score_step([sample(0, k, reward=float(k)) for k in range(4)], [flat], drop_no_signal=False)
    assert kept.drop is None and [s.advantage for s in kept.kept] == [0.0] * 4


# ---------------------------------------------------------------------------------------------------- the stage
def make_queue(samples, model, progress=None, **kwargs) -> tuple[ScoringQueue, list]:
    inner: queue.Queue = queue.Queue()
    for s in samples:
        inner.put(s)
    drops: list = []

    def drop(group_id, reason):
        drops.append((group_id, reason))
        if progress is not None:
            progress.drop(group_id, reason)

    return ScoringQueue(inner, [model], num_generations=4, drop=drop, **kwargs), drops


def drain(scoring: ScoringQueue) -> list[RolloutSample]:
    out = []
    while True:
        try:
            out.append(scoring.get(timeout=0.01))
        except queue.Empty:
            return out


def test_the_stage_scores_whole_groups_and_drops_each_unscorable_group_once():
    samples = [sample(g, k, text=f"p{g}") for g in range(3) for k in range(4)]

    class ByPrompt(FixedModel):
        def score(self, prompts, completions):
            bad = prompts[0][0]["content"] == "p1"
            return [math.nan if bad else float(k) for k in range(len(completions))]

    scoring, drops = make_queue(samples, ByPrompt([]))
    out = drain(scoring)
    assert [s.group_id for s in out] == [0] * 4 + [2] * 4
    assert drops == [(1, DropReason.UNSCORABLE)]
    assert scoring.samples_scored == 12 and scoring.unscorable_samples == 4
    assert out[0].metrics["reward"] == 0.0 and out[3].advantage > 0


def test_a_short_group_is_scored_when_the_next_group_begins():
    samples = [sample(0, k) for k in range(3)] + [sample(1, k) for k in range(4)]  # one row of group 0 never came
    scoring, drops = make_queue(samples, FixedModel([1.0, 2.0, 3.0, 4.0]))
    out = drain(scoring)
    assert [s.group_id for s in out] == [0] * 3 + [1] * 4 and drops == []
    assert [s.advantage for s in out[:3]] == pytest.approx(trl_advantages([1.0, 2.0, 3.0]))


def test_a_stall_raised_by_the_drop_keeps_the_sample_that_arrived():
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=1, groups_per_epoch=4, epochs=1)
    samples = [sample(0, k) for k in range(2)] + [sample(1, k) for k in range(4)]
    scoring, _ = make_queue(samples, FixedModel([math.nan] * 4), progress)
    with pytest.raises(RolloutStop) as stop:
        scoring.get(timeout=0.01)
    assert stop.value.code == StopCode.STALLED and progress.dropped["unscorable"] == 1
    assert [s.group_id for s in scoring.pending] == [1]  # group 1's first sample, not lost


def test_a_forked_group_is_scored_whole_by_its_stamped_row_count():
    # Four conversations, one forked into two rows: five rows, one group. Scored as soon as the fifth arrives (no
    # next group needed), normalised over all five, and passed on with its new row count.
    rows = [sample(0, k) for k in range(5)]
    for row in rows:
        row.metrics[GROUP_ROWS_KEY] = 5.0
    scoring, drops = make_queue(rows, FixedModel([1.0, 2.0, math.nan, 3.0, 4.0]))
    out = drain(scoring)
    assert [s.group_id for s in out] == [0] * 4 and drops == []
    assert [s.metrics[GROUP_ROWS_KEY] for s in out] == [4.0] * 4
    assert [s.advantage for s in out] == pytest.approx(trl_advantages([1.0, 2.0, 3.0, 4.0]))
