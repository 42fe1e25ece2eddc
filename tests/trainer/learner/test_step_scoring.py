"""The training step's scoring: score_step's verdicts, the groups rank 0 excludes, RolloutProgress.exclude, and real
runs on 2 gloo ranks where it takes whole groups, or everything, out of the loss."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_trainer.contract.codes import EXIT_STALLED, DropReason, LearnerPhase
from grpo_trainer.learner.step_scoring import (
    Decisions,
    ExclusionTracker,
    ImportanceBounds,
    Verdict,
    masked_terms,
    score_step,
)
from grpo_trainer.progress import ProgressState, RolloutProgress, RolloutStop, StallError, StopCode


def make_progress(n=6, epochs=1, stall_groups=0) -> RolloutProgress:
    return RolloutProgress(set(), epochs_done=0, stall_groups=stall_groups, groups_per_epoch=n, epochs=epochs)


# --- score_step --------------------------------------------------------------------------------------------------
def terms(per_sample_log_ratio: list[float], tokens: int = 3):
    """Loss terms of samples whose summed learner - rollout logprob is the given value, spread over `tokens`."""
    segment_id = torch.arange(len(per_sample_log_ratio)).repeat_interleave(tokens)
    old = torch.full((len(segment_id),), -2.0)
    log_probs = old + torch.tensor(per_sample_log_ratio).repeat_interleave(tokens) / tokens
    return log_probs, old, torch.zeros_like(old), segment_id


def test_without_bounds_only_non_finite_samples_leave_the_loss():
    log_probs, old, loss, segment_id = terms([0.0, 50.0, 0.0, 0.0])
    log_probs[7] = float("nan")  # sample 2's logprob
    old[10] = float("-inf")  # sample 3's rollout logprob
    verdicts = score_step(log_probs, old, loss, segment_id, 4, ImportanceBounds())
    assert verdicts.tolist() == [Verdict.KEPT, Verdict.KEPT, Verdict.NON_FINITE, Verdict.NON_FINITE]
    assert masked_terms(verdicts, segment_id).tolist() == [False] * 6 + [True] * 6


def test_a_non_finite_per_sample_loss_leaves_the_loss():
    log_probs, old, loss, segment_id = terms([0.0, 0.0])
    loss[4] = float("inf")
    assert score_step(log_probs, old, loss, segment_id, 2, ImportanceBounds()).tolist() == [0, Verdict.NON_FINITE]


def test_the_sequence_ratio_outside_the_bounds_masks_the_sample():
    # Sequence ratios e^-1, e^0.5, e^2 and e^400 (which overflows float32: compared in log space).
    log_probs, old, loss, segment_id = terms([-1.0, 0.5, 2.0, 400.0])
    bounds = ImportanceBounds(clip_min=0.5, clip_max=10.0)
    verdicts = score_step(log_probs, old, loss, segment_id, 4, bounds)
    assert verdicts.tolist() == [Verdict.IMPORTANCE_RATIO, Verdict.KEPT, Verdict.KEPT, Verdict.IMPORTANCE_RATIO]
    assert score_step(log_probs, old, loss, segment_id, 4, ImportanceBounds(clip_max=math.e ** 2.5)).tolist() == [
        0, 0, 0, Verdict.IMPORTANCE_RATIO]


def test_a_sample_without_loss_terms_is_kept():
    log_probs, old, loss, segment_id = terms([0.0])
    assert score_step(log_probs, old, loss, segment_id, 2, ImportanceBounds(clip_max=2.0)).tolist() == [0, 0]


# --- rank 0's tracker --------------------------------------------------------------------------------------------
def test_a_group_is_excluded_once_every_collated_sample_of_it_was_taken_out():
    collated = {1: 4, 2: 4, 3: 2}
    tracker = ExclusionTracker(collated)
    masked, kept, pad = int(Verdict.IMPORTANCE_RATIO), int(Verdict.KEPT), int(Verdict.PAD)
    # Rank 0's and rank 1's rows of one micro-batch: group 1 half scored, group 2 has a kept sample.
    assert tracker.add([1, 1, 2, 2, -1, 2, 2, 3], [masked, masked, masked, kept, pad, masked, masked, masked]) == (
        Decisions())
    assert tracker.add([1, 1, 3], [masked, int(Verdict.NON_FINITE), masked]) == Decisions(excluded=[1, 3])
    assert tracker.samples_scored == 10 and tracker.samples_masked == {"non_finite": 1, "importance_ratio": 8}
    assert collated == {}  # decided groups are forgotten
    collated[1] = 1  # a straggler of a decided group
    assert tracker.add([1], [masked]) == Decisions()


def test_a_straggler_decides_on_its_own_verdict():
    collated = {1: 2, 2: 2}
    tracker = ExclusionTracker(collated)
    masked, kept = int(Verdict.NON_FINITE), int(Verdict.KEPT)
    assert tracker.add([1, 1, 2, 2], [masked, masked, kept, masked]) == Decisions(excluded=[1])
    collated.update({1: 1, 2: 1})  # a late sample of each, collated after the group was decided
    assert tracker.add([1, 2], [kept, masked]) == Decisions(readmitted=[1])  # 1 trained after all; 2 trained already
    collated[1] = 1
    assert tracker.add([1], [kept]) == Decisions()  # readmitted once


# --- RolloutProgress.exclude -------------------------------------------------------------------------------------
def test_exclude_turns_a_collated_group_into_a_drop_counted_once():
    progress = make_progress(n=3)
    progress.train({0, 1})
    progress.exclude(1, DropReason.EXCLUDED)
    progress.exclude(1, DropReason.EXCLUDED)  # a second report of the same group
    progress.exclude(2, DropReason.EXCLUDED)  # not collated: nothing to exclude
    report = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
    assert report.groups_trained == 1 and report.dropped["excluded"] == 1 and report.groups_consumed == 2
    assert progress.stall_streak == 1


def test_the_stall_an_exclusion_completes_is_raised_by_the_next_check():
    progress = make_progress(n=3, epochs=2)
    progress.drop(0, DropReason.NO_SIGNAL)
    progress.train({1, 2})
    progress.exclude(1, DropReason.EXCLUDED)
    progress.check()  # 0 and 1: two in a row, one pass is three
    progress.exclude(2, DropReason.EXCLUDED)  # outside the stream: it raises nothing itself
    with pytest.raises(RolloutStop, match="3 prompt groups in a row") as stop:
        progress.check()
    assert stop.value.error is not None


def test_a_late_sample_of_an_excluded_group_does_not_turn_it_into_a_trained_one():
    progress = make_progress(n=3)
    progress.train({0, 1})
    progress.exclude(0, DropReason.EXCLUDED)
    progress.train({0})  # a late sample of it collated: its own verdict decides
    report = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
    assert report.groups_trained == 1 and report.dropped["excluded"] == 1 and progress.stall_streak == 1
    progress.readmit(0)  # the training step's scoring kept that sample: the group trained
    progress.readmit(0)
    progress.readmit(1)  # trained already: nothing to undo
    report = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
    assert report.groups_trained == 2 and report.dropped["excluded"] == 0 and progress.stall_streak == 0
    assert report.groups_consumed == 2


def test_a_run_whose_last_groups_are_excluded_after_the_stream_ended_it_stalls():
    # The stream ends the run once the bound's groups are collated (counted as trained); the training step's
    # scoring of the last micro-batches comes after. `end_stop` is the confirmation once they all trained.
    progress = make_progress(n=4)
    progress.train({0, 1, 2, 3})
    with pytest.raises(RolloutStop) as stop:
        progress.check()
    assert stop.value.code == StopCode.DONE
    for group_id in range(4):
        progress.exclude(group_id, DropReason.EXCLUDED)
    end = progress.end_stop()
    assert end.code == StopCode.STALLED and "4 prompt groups in a row" in end.error and "excluded 4" in end.error


def test_a_run_that_trained_a_group_ends_at_the_bound_when_confirmed():
    progress = make_progress(n=4)
    progress.train({0, 1, 2, 3})
    progress.exclude(3, DropReason.EXCLUDED)
    assert progress.end_stop().code == StopCode.DONE


def learner_at_the_end(progress: RolloutProgress):
    """A GRPOLearner as `_stop` finds it on one rank at the end of the stream (only what `_stop` reads)."""
    from types import SimpleNamespace

    from transformers import TrainerControl

    from grpo_trainer.learner.trainer import GRPOLearner
    from grpo_trainer.progress import StopAwareDataset

    learner = object.__new__(GRPOLearner)
    learner.accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    learner.progress = progress
    learner.control = TrainerControl()
    learner.args = SimpleNamespace(save_strategy="no")
    learner._train_stream = StopAwareDataset([], progress)
    learner._train_stream.stop = RolloutStop()
    learner.phase, learner.message, learner.stall_cause = LearnerPhase.RUNNING, "", None
    return learner


def test_the_learner_ends_a_pass_excluded_whole_after_the_stream_ended_with_the_stall_error():
    progress = make_progress(n=4)
    progress.train({0, 1, 2, 3})  # collated: the stream raised the end here
    for group_id in range(4):  # the training step's scoring of the last micro-batches
        progress.exclude(group_id, DropReason.EXCLUDED)
    learner = learner_at_the_end(progress)
    with pytest.raises(StallError, match="4 prompt groups in a row were consumed without one training"):
        learner._stop(StopCode.DONE, 0, 4)
    assert learner.phase == LearnerPhase.STALLED and not learner.control.should_training_stop


def test_the_learner_ends_at_the_bound_when_a_group_trained():
    progress = make_progress(n=4)
    progress.train({0, 1, 2, 3})
    progress.exclude(0, DropReason.EXCLUDED)
    learner = learner_at_the_end(progress)
    learner._stop(StopCode.DONE, 0, 4)
    assert learner.control.should_training_stop and learner.phase == LearnerPhase.RUNNING


def test_an_excluded_group_survives_a_checkpoint_as_excluded():
    progress = make_progress(n=4, epochs=2)
    progress.train({0, 1, 2})
    progress.exclude(1, DropReason.EXCLUDED)
    state = progress.checkpoint_state().to_dict()
    resumed = RolloutProgress.restore(ProgressState.from_dict(state), set(), stall_groups=0, groups_per_epoch=4,
                                      epochs=2)
    report = resumed.report(phase=LearnerPhase.RUNNING, global_step=0)
    assert report.dropped["excluded"] == 1 and report.groups_trained == 2 and report.groups_consumed == 3


# --- real runs, 2 gloo ranks ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_exclude_the_groups_the_importance_bound_takes_out_and_end_at_the_bound(tiny_model_dir, tmp_path):
    from tests.trainer.learner.test_learner_runs import run

    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "9", "--off-policy-every", "3",
                  "--is-clip-max", "10", ranks=2)
    rank0, rank1 = results
    assert rank0["outcome"] == rank1["outcome"] == "succeeded"
    assert rank0["micro_batches"] == rank1["micro_batches"] and rank0["micro_batches"][-1] == 0
    assert rank0["checksum"] == rank1["checksum"]
    progress = rank0["progress"]
    assert progress["groupsConsumed"] == progress["groupsTotal"] == 9
    assert progress["dropped"]["excluded"] == 3 and progress["groupsTrained"] == 6  # groups 2, 5, 8, once each
    assert rank0["consumed_absolute"] == list(range(9))
    # The 3 off-policy groups of 4 samples were masked; the overflow that filled the last window may add more.
    assert rank0["samples_masked"]["importance_ratio"] >= 12 and rank0["samples_masked"]["non_finite"] == 0
    assert progress["samplesMasked"] == rank0["samples_masked"]


@pytest.mark.slow
@pytest.mark.parametrize("epochs", [3, 1])
def test_two_ranks_whose_step_scoring_takes_out_everything_stall_within_one_pass(tiny_model_dir, tmp_path, epochs):
    # With 3 epochs the stream raises the stall itself; with 1 it ends the run at the bound once the last groups
    # are collated, before their scoring excluded them (that run ended Succeeded, 0 trained, 9 excluded), and the
    # learner turns the end into the stall once they trained, at the same micro-batch on both ranks.
    from tests.trainer.learner.test_learner_runs import run

    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "9", "--epochs", str(epochs),
                  "--nan-logprobs-every", "1", ranks=2, expect=EXIT_STALLED)
    rank0, rank1 = results
    assert rank0["outcome"] == rank1["outcome"] == "StallError"
    assert rank0["micro_batches"] == rank1["micro_batches"] and rank0["micro_batches"][-1] == 0
    assert rank0["checksum"] == rank1["checksum"] and all(math.isfinite(r["checksum"]) for r in results)
    progress = rank0["progress"]
    assert progress["phase"] == "Stalled" and progress["groupsTrained"] == 0
    # The stream raised the stall at its first check once a pass (9 groups) was excluded; the micro-batch already
    # collated by then (the dispatcher reads one ahead: 2 ranks x 4 samples, 2 groups) trained and was excluded too.
    streak = int(rank0["message"].split("stalled: ")[1].split(" ")[0])
    assert 9 <= streak <= 10 and "prompt groups in a row were consumed without one training" in rank0["message"]
    consumed = progress["groupsConsumed"]
    assert consumed <= 9 + 2 + 2 and rank0["consumed_absolute"] == list(range(consumed))
    assert progress["dropped"]["excluded"] == consumed  # every group excluded, each once
    assert rank0["samples_masked"]["non_finite"] == progress["samplesScored"]
    # One pass ends at the bound: the last micro-batch also carries the next pass's overflow, scored, not counted.
    assert progress["samplesScored"] == 4 * consumed if epochs > 1 else progress["samplesScored"] >= 4 * consumed
