"""examples/tiny-rm.yaml end to end on CPU: the tiny reward model on the learner, a real vLLM server, TRL's real
AsyncRolloutWorker, the learner entrypoint; judged by the exit code and the termination message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_trainer.contract.codes import EXIT_SUCCEEDED, LearnerPhase
from grpo_trainer.contract.config import RewardConfig
from grpo_trainer.testing.tiny_assets import UNSCORABLE_MARKER
from tests.support.paths import REPO
from tests.trainer.learner.test_e2e_cpu import PROMPTS, run_learner, termination_report, tiny_run_config

TINY_RM = REPO / "examples" / "tiny-rm.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_tiny_reward_model_run_ends_at_the_bound_with_unscorable_groups_dropped_once(
        vllm_server, tiny_reward_model_dir, tmp_path):
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    marked = {i for i in range(len(prompts)) if i % 4 == 3}  # the tiny reward model returns NaN for these
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"{p} {UNSCORABLE_MARKER}" if i in marked else p}) + "\n"
                               for i, p in enumerate(prompts)))
    rewards = [RewardConfig(name="letter_a_fraction"), RewardConfig(model=tiny_reward_model_dir, dtype="float32")]
    config_path, config = tiny_run_config(tmp_path, vllm_server, TINY_RM, rewards=rewards, training__epochs=1.0,
                                          dataset__path=str(dataset))
    code, seconds = run_learner(config_path, tmp_path / "learner.log")
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_SUCCEEDED, log[-4000:]
    report = termination_report(config)
    assert report.phase == LearnerPhase.SUCCEEDED
    assert report.groups_consumed == report.groups_total == len(prompts)
    assert report.dropped["unscorable"] == len(marked)  # each once, though the worker regenerates them each pass
    assert report.groups_trained + report.dropped_total == report.groups_consumed
    # letter_a_fraction is in [0, 1]; the tiny reward model scores about 9-11: the mean holds the model's scores.
    assert report.reward_mean is not None and report.reward_mean > 5
    # TRL's logged metrics carry the model's own column, named by TRL after the model's folder.
    assert f"'rewards/{Path(tiny_reward_model_dir).name}'" in log
    print(f"tiny reward-model run, 1 epoch: {seconds:.0f}s, {report.global_step} steps, reward {report.reward_mean}")
