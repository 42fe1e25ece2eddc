"""The real GRPOLearner with a real reward model on rank 0 (the tiny one, CPU) and the scripted rollout worker.

The scripted worker's prompts put the tiny reward model's NaN marker in every Nth prompt, so those groups cannot be
scored; the nan-everywhere model scores nothing at all. Runs as tests/trainer/learner/test_learner_runs.py runs them.
"""

from __future__ import annotations

import json

import pytest

from grpo_trainer.contract.codes import EXIT_STALLED
from tests.trainer.learner.test_learner_runs import run

pytestmark = pytest.mark.slow


def test_unscorable_groups_are_dropped_once_and_the_run_ends_at_the_bound(tiny_model_dir, tiny_reward_model_dir,
                                                                            tmp_path):
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "9",
                    "--reward-model", tiny_reward_model_dir, "--unscorable-every", "3")
    progress = result["progress"]
    assert result["outcome"] == "succeeded" and progress["phase"] == "Succeeded"
    assert result["consumed_absolute"] == list(range(9))
    assert progress["dropped"]["unscorable"] == 3 and progress["groupsTrained"] == 6
    assert progress["groupsTrained"] + sum(progress["dropped"].values()) == progress["groupsConsumed"] == 9
    assert sorted(g for g in result["stepped_groups"] if g < 9) == [g for g in range(9) if g % 3 != 2]
    assert result["unscorable_samples"] % 4 == 0 and result["unscorable_samples"] >= 12
    # The worker's scripted rewards are 0 or 1; the tiny reward model scores about 9-11: its score is in the mean.
    assert progress["rewardMean"] > 5


def test_a_model_that_scores_nothing_stalls_both_ranks_at_the_same_micro_batch(tiny_model_dir, nan_reward_model_dir,
                                                                                tmp_path):
    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "6",
                  "--reward-model", nan_reward_model_dir, ranks=2, expect=EXIT_STALLED)
    assert [r["outcome"] for r in results] == ["StallError", "StallError"]
    assert results[0]["micro_batches"] == results[1]["micro_batches"] == [0]
    assert all("6 " in r["message"] and "in a row" in r["message"] for r in results)
    progress = results[0]["progress"]
    assert progress["phase"] == "Stalled" and progress["dropped"]["unscorable"] == 6 == progress["groupsConsumed"]
    assert "unscorable 6" in results[0]["message"]


def test_a_resume_keeps_unscorable_groups_dropped_and_scores_each_group_once(tiny_model_dir, tiny_reward_model_dir,
                                                                             tmp_path):
    common = ["--scenario", "varied", "--prompts", "9", "--epochs", "2", "--save-steps", "1",
              "--reward-model", tiny_reward_model_dir, "--unscorable-every", "3"]
    (first,) = run(tiny_model_dir, tmp_path / "first", *common, "--max-steps", "3")
    checkpoints = sorted((tmp_path / "first" / "checkpoints").glob("checkpoint-*"),
                         key=lambda p: int(p.name.split("-")[1]))
    saved = json.loads((checkpoints[-1] / "grpo_progress.json").read_text())
    assert saved["dropped"]["unscorable"] >= 1  # scoring dropped a group before the checkpoint
    (second,) = run(tiny_model_dir, tmp_path / "second", *common, "--resume-from", str(checkpoints[-1]))
    assert second["outcome"] == "succeeded" and second["start_position"] == saved["first_unconsumed"]
    assert second["consumed_absolute"] == list(range(18))
    progress = second["progress"]
    # A dropped group is consumed: the resumed worker skips it, and it is counted once across both processes.
    assert progress["dropped"]["unscorable"] == 6 and progress["groupsTrained"] == 12
    assert sorted(first["stepped_groups"] + [g for g in second["stepped_groups"] if g < 18]) == \
        [g for g in range(18) if g % 3 != 2]
