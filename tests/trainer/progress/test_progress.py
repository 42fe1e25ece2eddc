"""Unit tests of the progress module's classes (trainer_image/grpo_trainer/progress.py), no trainer involved."""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TreeRow

from grpo_trainer.agentic.episodes import (
    ENVIRONMENT_FAILED_KEY,
    EPISODES_KEY,
    GROUP_ROWS_KEY,
    EpisodeCounts,
    EpisodeQueue,
)
from grpo_trainer.contract.codes import DROP_REASONS, DropReason, LearnerPhase, StallCause
from grpo_trainer.contract.config import FilterConfig
from grpo_trainer.contract.report import parse_progress
from grpo_trainer.progress import (
    STOP_KEY,
    ProgressCollator,
    ProgressState,
    RolloutProgress,
    RolloutStop,
    SampleFilterQueue,
    SampleLimits,
    StopAwareDataset,
    StopCode,
    stop_from_batch,
)


def make_progress(n=6, epochs=1, stall_groups=0, **kwargs) -> RolloutProgress:
    return RolloutProgress(set(), epochs_done=0, stall_groups=stall_groups, groups_per_epoch=n, epochs=epochs, **kwargs)


def sample(group_id, rewards=(0.0, 1.0), k=0, version=0, tokens=6, last_token=1, std=None) -> RolloutSample:
    rewards = np.array(rewards, dtype=float)
    reward_std = float(rewards.std()) if std is None else std
    advantage = float((rewards[k] - rewards.mean()) / (reward_std + 1e-8))
    ids = np.arange(2, 2 + tokens, dtype=np.int64)
    ids[-1] = last_token
    return RolloutSample(
        prompt=[], completion=[], input_ids=ids,
        completion_mask=np.r_[np.zeros(tokens // 2), np.ones(tokens - tokens // 2)].astype(np.int64),
        old_log_probs=np.zeros(tokens, dtype=np.float32), advantage=advantage, model_version=version,
        group_id=group_id, metrics={"reward": float(rewards[k]), "reward_std": reward_std},
    )


def filter_queue(progress, samples, *, version=0, num_generations=2, max_staleness=2, token_budget=0,
                 **kwargs) -> SampleFilterQueue:
    """`kwargs`: FilterConfig's fields by name, and SampleFilterQueue's own keyword arguments."""
    inner = queue.Queue()
    for s in samples:
        inner.put(s)
    filters = {name: kwargs.pop(name) for name in list(kwargs) if name in FilterConfig.model_fields}
    limits = SampleLimits(max_staleness=max_staleness, num_generations=num_generations, token_budget=token_budget)
    return SampleFilterQueue(inner, progress, model_version_fn=lambda: version, limits=limits,
                             filter_config=FilterConfig(**filters), **({"end_token_ids": {1, 0}} | kwargs))


def drain(fq, limit=1000):
    out = []
    for _ in range(limit):
        try:
            out.append(fq.get(timeout=0.01))
        except queue.Empty:
            return out
    return out


# ------------------------------------------------------------------------------------------------- RolloutProgress
class TestRolloutProgress:
    def test_every_drop_reason_is_counted(self):
        progress = make_progress(n=len(DROP_REASONS) + 1)
        progress.train([0])
        for group_id, reason in enumerate(DROP_REASONS, start=1):
            if group_id == len(DROP_REASONS):
                with pytest.raises(RolloutStop) as stop:  # the last drop consumes the run: it ends the stream
                    progress.drop(group_id, reason)
                assert stop.value.error is None and stop.value.code == StopCode.DONE
            else:
                progress.drop(group_id, reason)
        assert progress.dropped == dict.fromkeys(DROP_REASONS, 1)
        report = progress.report(phase=LearnerPhase.RUNNING, global_step=3)
        assert report.dropped_total == len(DROP_REASONS) and report.groups_consumed == len(DROP_REASONS) + 1
        assert report.groups_trained == 1

    def test_consumed_is_the_trainers_own_set(self):
        consumed = set()
        progress = RolloutProgress(consumed, epochs_done=0, stall_groups=3, groups_per_epoch=4, epochs=1)
        progress.train([0, 2])
        progress.drop(1, DropReason.NO_SIGNAL)
        assert consumed == {0, 1, 2}  # TRL's resume cursor and epoch count read this very set

    def test_a_dropped_group_is_counted_once(self):
        progress = make_progress()
        progress.drop(2, "no_signal")
        progress.drop(2, "stale")
        assert progress.dropped["no_signal"] == 1 and progress.dropped["stale"] == 0

    def test_stall_after_a_full_pass_without_training(self):
        progress = make_progress(n=4, epochs=3)
        progress.train([0])
        for group_id in (1, 2, 3):
            progress.drop(group_id, "no_signal")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(4, "no_signal")
        assert stop.value.code == StopCode.STALLED and "4 prompt groups in a row" in stop.value.error

    def test_explicit_stall_limit(self):
        progress = make_progress(n=100, stall_groups=2)
        progress.drop(0, "truncated")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(1, "truncated")
        assert stop.value.code == StopCode.STALLED

    def test_check_order_stall_wins_over_all_consumed(self):
        # One epoch, everything dropped: "all consumed" is true too, but success with zero steps would hide it.
        progress = make_progress(n=3)
        progress.drop(0, "no_signal")
        progress.drop(1, "no_signal")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(2, "no_signal")
        assert stop.value.code == StopCode.STALLED

    def test_all_consumed_without_any_training_is_a_stall_even_below_the_limit(self):
        progress = make_progress(n=3, stall_groups=50)
        progress.drop(0, "no_signal")
        progress.drop(1, "no_signal")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(2, "no_signal")
        assert stop.value.code == StopCode.STALLED and "none trained" in stop.value.error

    def test_every_report_carries_the_stall_verdict_and_its_cause(self):
        # The operator reads the verdict as it is: it has no stall rule of its own.
        progress = make_progress(n=4, epochs=3, stall_groups=3)
        progress.train([0])
        progress.drop(1, "no_signal")
        progress.drop(2, "no_signal")
        running = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
        assert (running.stalled, running.stall_cause, running.stall_streak) == (False, None, 2)
        with pytest.raises(RolloutStop) as stop:
            progress.drop(3, "no_signal")
        assert stop.value.cause is StallCause.STREAK
        stalled = progress.report(phase=LearnerPhase.RUNNING, global_step=1)  # before the learner stops
        assert (stalled.stalled, stalled.stall_cause) == (True, StallCause.STREAK)
        assert parse_progress(stalled.termination_message()).stall_verdict

    def test_all_consumed_and_none_trained_is_its_own_cause(self):
        progress = make_progress(n=2, stall_groups=50)
        progress.drop(0, "no_signal")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(1, "no_signal")
        assert stop.value.cause is StallCause.NOTHING_TRAINED
        report = progress.report(phase=LearnerPhase.RUNNING, global_step=0)
        assert (report.stalled, report.stall_cause) == (True, StallCause.NOTHING_TRAINED)

    def test_streak_counts_consecutive_ids_not_arrival_order(self):
        # Group 1 is accepted and waits in the batcher while later groups are dropped: no stall, the pass trained.
        progress = make_progress(n=3, epochs=5)
        progress.drop(0, "no_signal")
        progress.drop(2, "no_signal")
        progress.drop(3, "no_signal")
        assert progress.stall_streak == 2
        progress.check()  # no stop
        progress.train([1])
        with pytest.raises(RolloutStop) as stop:
            progress.drop(4, "no_signal")
        assert progress.stall_streak == 3 and stop.value.code == StopCode.STALLED  # ids 2, 3, 4

    def test_overflow_past_the_bound_is_consumed_but_not_counted(self):
        progress = make_progress(n=2)
        progress.train([0, 2, 3])  # 2 and 3 are the next pass's groups riding in the last micro-batch
        assert progress.groups_trained == 1 and progress.groups_consumed == 1 and {2, 3} <= progress.consumed
        with pytest.raises(RolloutStop) as stop:
            progress.drop(1, "no_signal")
        assert stop.value.code == StopCode.DONE
        report = progress.report(phase=LearnerPhase.SUCCEEDED, global_step=1)
        assert report.groups_trained + report.dropped_total == report.groups_consumed == report.groups_total

    def test_collated_and_returned_never_decrease_and_give_trained(self):
        progress = make_progress()
        progress.train([0, 1, 2])
        progress.untrain([1, 2])  # a stop discarded their window: trained goes down, the two counters do not
        progress.train([1])
        report = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
        assert (report.groups_collated, report.groups_returned, report.groups_trained) == (4, 2, 2)
        checkpoint = ProgressState(first_unconsumed=0, consumed_after=[], dropped_after={}, prefix_streak=0,
                                   groups_trained=5, dropped={}, epochs_done=0)
        resumed = RolloutProgress.restore(checkpoint, set(), stall_groups=0, groups_per_epoch=6, epochs=1)
        assert (resumed.groups_collated, resumed.groups_returned, resumed.groups_trained) == (0, 0, 5)

    def test_training_a_group_dropped_earlier_moves_it(self):
        progress = make_progress()
        progress.drop(1, "lost")
        progress.train([1])
        assert progress.dropped["lost"] == 0 and progress.groups_trained == 1 and progress.stall_streak == 0

    def test_epochs_done_and_fractional_epochs(self):
        progress = make_progress(n=4, epochs=1.5)
        assert progress.groups_total == 6
        progress.train(range(4))
        assert progress.epochs_done == 1
        progress.train([4])
        with pytest.raises(RolloutStop) as stop:
            progress.train([5]) or progress.check()
        assert stop.value.code == StopCode.DONE

    @pytest.mark.parametrize(("epochs", "bound_epochs"), [(1, 1), (2, 2), (1.5, 1)])
    def test_epochs_done_stops_at_the_bound_while_the_worker_generates_past_it(self, epochs, bound_epochs):
        # TRL's worker keeps generating after the last epoch, and the groups consumed past the bound (the last
        # window's overflow; TRL's collator adds whatever it collates to the consumed set) moved the first
        # unconsumed id on: a 1-epoch agentic run reported epochsDone 57.
        progress = make_progress(n=4, epochs=epochs)
        bound = progress.groups_total
        progress.train(range(bound - 1))
        with pytest.raises(RolloutStop) as stop:
            progress.train([bound - 1]) or progress.check()
        assert stop.value.code == StopCode.DONE
        for next_pass in range(50):  # 50 more passes of overflow, trained in the last window or dropped
            first = bound + 4 * next_pass
            progress.train(range(first, first + 3))
            progress.drop(first + 3, "no_signal")
        report = progress.report(phase=LearnerPhase.SUCCEEDED, global_step=3)
        assert report.groups_consumed == report.groups_total == bound
        assert report.epochs_done == bound_epochs == report.groups_consumed // 4 <= math.ceil(epochs)
        # The final checkpoint, taken with the overflow consumed: a run resumed from it (a crash in the export)
        # is at its bound, with the same figures.
        state = progress.checkpoint_state()
        assert state.epochs_done == bound_epochs and state.first_unconsumed == bound
        resumed = RolloutProgress.restore(state, set(), stall_groups=0, groups_per_epoch=4, epochs=epochs)
        again = resumed.report(phase=LearnerPhase.SUCCEEDED, global_step=3)  # raises on a broken identity
        assert (again.groups_consumed, again.groups_trained, again.epochs_done) == (bound, report.groups_trained,
                                                                                   bound_epochs)
        with pytest.raises(RolloutStop) as stop:
            resumed.check()
        assert stop.value.code == StopCode.DONE

    def test_a_checkpoints_epochs_done_beyond_the_bound_is_not_carried_on(self):
        # Written before epochs were counted within the bound: the figure is derived again from the positions.
        state = ProgressState(first_unconsumed=4, consumed_after=[5, 6], dropped_after={}, prefix_streak=0,
                              groups_trained=4, dropped={}, epochs_done=57, bound=4)
        resumed = RolloutProgress.restore(state, set(), stall_groups=0, groups_per_epoch=4, epochs=1)
        assert resumed.epochs_done == 1 == resumed.groups_consumed // 4

    def test_state_round_trip_resumes_after_the_first_gap(self):
        progress = make_progress(n=5, epochs=2)
        progress.train([0, 1, 3])
        progress.drop(2, "no_signal")
        progress.drop(5, "stale")
        state = progress.checkpoint_state(exclude={3}).to_dict()  # 3 was collated but had not trained at the checkpoint
        assert state["first_unconsumed"] == 3 and state["consumed_after"] == [5] and state["groups_trained"] == 2
        assert state["dropped_after"] == {"stale": [5]} and state["prefix_streak"] == 1  # group 2, right before 3
        consumed = {99}
        resumed = RolloutProgress.restore(ProgressState.from_dict(state), consumed, stall_groups=0,
                                          groups_per_epoch=5, epochs=2)
        assert resumed.start_group == 3 and consumed == {2}  # absolute 5 is worker id 2 after the restart
        assert resumed.groups_consumed == 4 and resumed.dropped["stale"] == 1 and resumed.groups_trained == 2
        assert resumed.needs(6) and not resumed.needs(7)


    def test_a_regenerated_group_counts_neither_as_trained_nor_toward_the_streak(self):
        progress = make_progress(n=4, epochs=3)
        progress.drop(0, "no_signal")
        assert progress.regenerate(1)
        progress.drop(2, "no_signal")
        assert progress.stall_streak == 2  # 0 and 2: the regenerated 1 neither extends nor ends the streak
        assert progress.groups_consumed == 2 and progress.groups_trained == 0 and progress.regenerated == 1
        assert progress.needs(12) and not progress.needs(13)  # the bound moved by one: 13 groups, one stand-in

    def test_a_pass_that_trains_nothing_still_stalls_with_regeneration(self):
        progress = make_progress(n=3, epochs=5)
        progress.drop(0, "no_signal")
        progress.regenerate(1)
        progress.drop(2, "no_signal")
        with pytest.raises(RolloutStop) as stop:
            progress.drop(3, "no_signal")
        assert stop.value.code == StopCode.STALLED

    def test_regeneration_is_bounded_per_group(self):
        progress = make_progress(n=2, regenerate_limit=2)
        assert progress.regenerate(0)  # stand-in 2
        assert progress.regenerate(2)  # stand-in 3, the second regeneration of the same group
        assert not progress.regenerate(3)  # the caller drops it as stale: it counts toward the streak again
        assert progress.regenerated == 2 and progress.needs(3) and not progress.needs(4)

    def test_the_stand_in_skips_overflow_already_passed(self):
        progress = make_progress(n=2)
        progress.pass_overflow(2)  # the next pass's group 2 already went by, unfiltered
        progress.train([0, 2])
        assert progress.regenerate(1)
        assert not progress.needs(2) and progress.needs(3) and progress.groups_consumed == 1
        with pytest.raises(RolloutStop) as stop:
            progress.train([3]) or progress.check()
        assert stop.value.code == StopCode.DONE
        report = progress.report(phase=LearnerPhase.SUCCEEDED, global_step=2)
        assert report.groups_consumed == report.groups_total == 2 and report.groups_trained == 2

    def test_state_round_trip_keeps_the_moved_bound(self):
        progress = make_progress(n=4, epochs=1)
        progress.train([0])
        progress.regenerate(1)
        progress.train([2])
        state = progress.checkpoint_state().to_dict()
        consumed = set()
        resumed = RolloutProgress.restore(ProgressState.from_dict(state), consumed, stall_groups=0,
                                          groups_per_epoch=4, epochs=1)
        assert resumed.start_group == 3 and resumed.regenerated == 1 and resumed.groups_consumed == 2
        assert resumed.needs(1) and not resumed.needs(2)  # absolute 3 and the stand-in 4


# ------------------------------------------------------------------------------------------------- SampleFilterQueue
class TestSampleFilterQueue:
    def test_no_signal_by_reward_std_not_by_advantage(self):
        # Identical rewards: the advantage formula gives ~0 (1e-9-ish with float noise), reward_std is exactly 0.
        same = [sample(0, rewards=(0.7, 0.7), k=k) for k in range(2)]
        assert all(abs(s.advantage) < 1e-6 for s in same)
        # The group mean sample of a varied group has advantage exactly 0 and must train.
        mean_sample = sample(1, rewards=(0.0, 0.5, 1.0), k=1)
        assert mean_sample.advantage == 0.0
        progress = make_progress(n=10)
        fq = filter_queue(progress, [*same, mean_sample])
        assert drain(fq) == [mean_sample]
        assert progress.dropped["no_signal"] == 1 and 0 in progress.consumed

    def test_near_identical_rewards_within_epsilon_are_no_signal(self):
        progress = make_progress(n=10)
        fq = filter_queue(progress, [sample(0, std=1e-9, k=k) for k in range(2)], no_signal_epsilon=1e-6)
        assert drain(fq) == [] and progress.dropped["no_signal"] == 1

    def test_a_stop_request_while_the_queue_is_empty_ends_the_wait_before_its_timeout(self):
        # SIGTERM while the learner waits on an empty queue (the rollout servers drained with it): TRL's poll waits
        # 5 s at a time, and the pod's grace period must also hold the checkpoint and the worker child's stop.
        progress = make_progress(n=10)
        fq = filter_queue(progress, [])
        timer = threading.Timer(0.1, progress.request_stop, args=("preempted: SIGTERM received",))
        timer.start()
        try:
            with pytest.raises(RolloutStop) as stop:
                fq.get(timeout=30.0)
        finally:
            timer.cancel()
        assert stop.value.code == StopCode.PREEMPTED

    def test_nan_reward_std_is_no_signal(self):
        progress = make_progress(n=10)
        fq = filter_queue(progress, [sample(0, std=float("nan"), k=k) for k in range(2)])
        assert drain(fq) == [] and progress.dropped["no_signal"] == 1

    @staticmethod
    def unscored(group_id, k):
        """TRL's worker when every reward returned None for a completion: reward NaN, advantage 0."""
        unscored = sample(group_id, rewards=(float("nan"), float("nan")), k=k, std=float("nan"))
        unscored.advantage = 0.0
        return unscored

    @pytest.mark.parametrize("drop_no_signal", [True, False])
    def test_a_group_no_reward_could_score_is_unscorable_whatever_the_filter_says(self, drop_no_signal):
        progress = make_progress(n=10)
        fq = filter_queue(progress, [self.unscored(0, k) for k in range(2)], drop_no_signal=drop_no_signal)
        assert drain(fq) == []  # never trained, even with dropNoSignal off (it would train zero advantages)
        assert progress.dropped["unscorable"] == 1 and progress.dropped["no_signal"] == 0 and 0 in progress.consumed

    @pytest.mark.parametrize("reward", [float("inf"), float("-inf")])
    @pytest.mark.parametrize("drop_no_signal", [True, False])
    def test_a_group_whose_every_reward_is_infinite_is_unscorable(self, reward, drop_no_signal):
        # Unscorable means non-finite: an infinite reward is the reward's failure, not a group without signal (its
        # reward_std is NaN, which no_signal would otherwise take; with dropNoSignal off it would train).
        progress = make_progress(n=10)
        infinite = [sample(0, rewards=(reward, reward), k=k) for k in range(2)]
        assert drain(filter_queue(progress, infinite, drop_no_signal=drop_no_signal)) == []
        assert progress.dropped["unscorable"] == 1 and progress.dropped["no_signal"] == 0 and 0 in progress.consumed

    def test_a_sample_no_reward_could_score_leaves_a_group_that_trains(self):
        progress = make_progress(n=10)
        scored = sample(0, rewards=(0.0, 1.0), k=1)
        assert drain(filter_queue(progress, [self.unscored(0, 0), scored])) == [scored]
        assert progress.dropped["unscorable"] == 0 and 0 not in progress.consumed

    def test_a_pass_of_unscorable_groups_stalls_with_drop_no_signal_off(self):
        progress = make_progress(n=3, epochs=2)
        fq = filter_queue(progress, [self.unscored(g, k) for g in range(3) for k in range(2)], drop_no_signal=False)
        with pytest.raises(RolloutStop) as stop:
            drain(fq)
        assert stop.value.code == StopCode.STALLED and "unscorable 3" in stop.value.error

    def episodes_failed(self, group_id, failed: dict[str, int]):
        """A group of two episodes as the episode rollout loop stamps it (grpo_trainer.agentic.episodes.stamp_group),
        with `failed` of them failed in each environment; a group whose both failed is unscorable."""
        rows = ([self.unscored(group_id, k) for k in range(2)] if sum(failed.values()) == 2
                else [sample(group_id, rewards=(0.0, 1.0), k=k) for k in range(2)])
        rows[0].metrics[EPISODES_KEY] = {"episodes": 2, "rows": 2, "environment_failures": failed}
        return rows

    def stall_of(self, groups) -> str:
        """The stall message of a pass over `groups` read through the learner's episode counting."""
        counts = EpisodeCounts()
        progress = make_progress(n=len(groups), epochs=2, stall_cause=counts.failed_environments)
        fq = filter_queue(progress, [row for group in groups for row in group])
        fq.inner = EpisodeQueue(fq.inner, counts)
        with pytest.raises(RolloutStop) as stop:
            drain(fq)
        assert stop.value.code == StopCode.STALLED
        return stop.value.error

    def test_a_pass_in_which_every_episode_failed_stalls_naming_the_environment(self):
        error = self.stall_of([self.episodes_failed(g, {"guess": 2}) for g in range(3)])
        assert error.startswith("stalled: 3 prompt groups in a row were consumed without one training")
        assert "unscorable 3" in error
        assert "every episode of the last 3 groups failed in environment guess (6 episodes)" in error
        both = self.stall_of([self.episodes_failed(0, {"guess": 2}), self.episodes_failed(1, {"guess": 1, "sum": 1}),
                              self.episodes_failed(2, {"guess": 2})])
        assert "failed in environments guess (5 episodes), sum (1 episode)" in both

    def test_a_stall_of_drops_whose_episodes_did_not_all_fail_names_no_environment(self):
        # Two groups failed whole in the environment, the third has one episode that played (and no signal).
        mixed = [self.episodes_failed(0, {"guess": 2}), self.episodes_failed(1, {"guess": 2}),
                 [sample(2, rewards=(1.0, 1.0), k=k) for k in range(2)]]
        mixed[2][0].metrics[EPISODES_KEY] = {"episodes": 2, "rows": 2, "environment_failures": {"guess": 1}}
        error = self.stall_of(mixed)
        assert "unscorable 2" in error and "no_signal 1" in error and "environment" not in error

    def marked_failed(self, group_id, failed_rows=(0, 1)):
        """A group of two episodes as the episode rollout loop sends it when the environment failed the episodes
        `failed_rows` (grpo_trainer.rollout.worker.unscore marks their rows; the other one, alone, has no signal)."""
        rows = [self.unscored(group_id, k) if k in failed_rows else sample(group_id, rewards=(1.0,), k=0)
                for k in range(2)]
        for k in failed_rows:
            rows[k].metrics[ENVIRONMENT_FAILED_KEY] = 1.0
        rows[0].metrics[EPISODES_KEY] = {"episodes": 2, "rows": 2,
                                         "environment_failures": {"guess": len(failed_rows)}}
        return rows

    def test_a_group_an_environment_left_untrained_is_regenerated_within_the_slots_budget(self):
        progress = make_progress(n=4)
        counts = EpisodeCounts()
        fq = filter_queue(progress, [*self.marked_failed(0), *self.marked_failed(1, failed_rows=(1,))])
        fq.inner = EpisodeQueue(fq.inner, counts)
        assert drain(fq) == []
        # Neither trained: both regenerated (the second's one played episode had no signal alone), none dropped.
        assert progress.regenerated == progress.regenerated_for_environment == 2
        assert sum(progress.dropped.values()) == 0 and progress.stall_streak == 0
        assert progress.needs(5) and not progress.needs(6)  # the bound moved by two
        report = progress.report(phase=LearnerPhase.RUNNING, global_step=0)
        assert report.regenerated_environment == 2 and counts.report().environment_failures == {"guess": 3}
        state = ProgressState.from_json(progress.checkpoint_state().to_json())
        resumed = RolloutProgress.restore(state, set(), stall_groups=0, groups_per_epoch=4, epochs=1)
        assert resumed.regenerated_for_environment == 2

    def test_past_the_budget_a_group_the_environment_failed_is_dropped_and_a_pass_of_them_stalls(self):
        # One slot: the group (0), then its stand-ins 1 and 2 (REGENERATE_LIMIT 2), fail; the third try is dropped.
        progress = make_progress(n=1, stall_groups=1, stall_cause=EpisodeCounts().failed_environments)
        fq = filter_queue(progress, [row for g in range(3) for row in self.marked_failed(g)])
        with pytest.raises(RolloutStop) as stop:
            drain(fq)
        assert stop.value.code == StopCode.STALLED and "unscorable 1" in stop.value.error
        assert progress.regenerated_for_environment == 2 and progress.dropped["unscorable"] == 1

    def test_a_group_that_trains_despite_a_failed_episode_is_not_regenerated(self):
        progress = make_progress(n=4)
        rows = [self.unscored(0, 0), sample(0, rewards=(0.0, 1.0), k=0), sample(0, rewards=(0.0, 1.0), k=1)]
        rows[0].metrics[ENVIRONMENT_FAILED_KEY] = 1.0
        for row in rows:
            row.metrics[GROUP_ROWS_KEY] = 3.0
        passed = drain(filter_queue(progress, rows))
        assert passed == rows[1:] and progress.regenerated == 0
        assert all(ENVIRONMENT_FAILED_KEY not in row.metrics for row in passed)

    def test_stale_uses_trls_exact_rule(self):
        progress = make_progress(n=10)
        at_limit = [sample(0, version=3, k=k) for k in range(2)]  # 5 - 3 = 2 = max_staleness: kept
        too_old = [sample(1, version=2, k=k) for k in range(2)]  # 5 - 2 = 3 > 2: stale, regenerated
        fq = filter_queue(progress, [*at_limit, *too_old], version=5)
        assert drain(fq) == at_limit and progress.regenerated == 1

    def test_too_long_uses_the_token_budget(self):
        progress = make_progress(n=10)
        fits = [sample(0, tokens=8, k=k) for k in range(2)]
        too_long = [sample(1, tokens=9, k=k) for k in range(2)]
        fq = filter_queue(progress, [*fits, *too_long], token_budget=8)
        assert drain(fq) == fits and progress.dropped["too_long"] == 1

    def test_truncated_only_when_asked(self):
        truncated = [sample(0, last_token=7, k=k) for k in range(2)]
        progress = make_progress(n=10)
        assert drain(filter_queue(progress, truncated)) == truncated
        progress = make_progress(n=10)
        assert drain(filter_queue(progress, truncated, drop_truncated=True)) == []
        assert progress.dropped["truncated"] == 1

    def test_a_group_with_one_trainable_sample_is_not_dropped(self):
        progress = make_progress(n=10)
        kept = sample(0, tokens=6, k=1)
        fq = filter_queue(progress, [sample(0, tokens=9, k=0), kept], token_budget=8)
        assert drain(fq) == [kept]
        assert 0 not in progress.consumed  # it trains when its micro-batch is collated, not before

    def test_a_group_200_groups_late_but_within_staleness_trains(self):
        progress = make_progress(n=1000)
        later = [sample(g, k=k) for g in range(1, 201) for k in range(2)]
        late = [sample(0, k=k) for k in range(2)]
        fq = filter_queue(progress, [*later, *late], max_staleness=4)
        assert [id(s) for s in drain(fq)[-2:]] == [id(s) for s in late]
        assert progress.dropped["lost"] == 0 and 0 not in progress.consumed  # it trains once collated
        progress.train(range(201))
        assert progress.groups_trained == 201 and sum(progress.dropped.values()) == 0

    def test_a_stale_group_is_regenerated_not_consumed(self):
        progress = make_progress(n=4)
        fq = filter_queue(progress, [sample(0, version=2, k=k) for k in range(2)], version=5, max_staleness=2)
        assert drain(fq) == []
        assert progress.regenerated == 1 and progress.dropped["stale"] == 0 and progress.stall_streak == 0
        assert progress.groups_consumed == 0 and progress.needs(4) and not progress.needs(5)  # 4 takes its place

    def test_a_missing_group_whose_samples_would_be_stale_is_regenerated(self):
        # Group 0 never arrives. Group 1 was issued after it at version 0, so group 0's version is at most 0: once
        # the learner is at version 3 with max_staleness 2, its samples would be stale if they came.
        progress = make_progress(n=100)
        version = [0]
        inner = queue.Queue()
        fq = SampleFilterQueue(inner, progress, model_version_fn=lambda: version[0],
                               limits=SampleLimits(max_staleness=2, num_generations=2), end_token_ids={1, 0})
        for s in [sample(1, k=k) for k in range(2)]:
            inner.put(s)
        assert len(drain(fq)) == 2 and progress.regenerated == 0
        version[0] = 3
        for s in [sample(2, version=3, k=k) for k in range(2)]:
            inner.put(s)
        drain(fq)
        assert progress.regenerated == 1 and progress.dropped["lost"] == 0 and 0 in progress.consumed

    def test_a_missing_group_is_lost_after_the_time_limit(self):
        now = [0.0]
        progress = make_progress(n=100)
        inner = queue.Queue()
        fq = SampleFilterQueue(inner, progress, model_version_fn=lambda: 0,
                               limits=SampleLimits(max_staleness=1000, num_generations=2), end_token_ids={1, 0},
                               lost_after_s=60, clock=lambda: now[0])
        for s in [sample(1, k=k) for k in range(2)]:
            inner.put(s)
        drain(fq)
        now[0] = 61.0
        for s in [sample(2, k=k) for k in range(2)]:
            inner.put(s)
        drain(fq)
        assert progress.dropped["lost"] == 1 and 0 in progress.consumed and progress.regenerated == 0

    def test_a_partly_arrived_group_is_settled_with_its_samples_reason(self):
        now = [0.0]
        partial = sample(0, rewards=(1.0, 1.0), k=0)  # one of two samples arrives, without signal
        later = [sample(g, k=k) for g in range(1, 6) for k in range(2)]
        progress = make_progress(n=100)
        fq = filter_queue(progress, [partial, *later], lost_after_s=60, clock=lambda: now[0])
        assert len(drain(fq)) == len(later) and sum(progress.dropped.values()) == 0  # not yet past the limit
        now[0] = 61.0
        fq.inner.put(sample(6, k=0))
        drain(fq)
        # Its other sample never came: dropped with the reason its arrived sample was dropped for, not as lost.
        assert progress.dropped["no_signal"] == 1 and progress.dropped["lost"] == 0 and 0 in progress.consumed

    def test_overflow_past_the_bound_flows_unfiltered(self):
        # The batchers emit a micro-batch only when more samples arrive: the last needed group gets collated only
        # if the next pass's samples keep flowing, whatever their reward.
        progress = make_progress(n=2)
        overflow = [sample(5, rewards=(1.0, 1.0), k=k) for k in range(2)]
        fq = filter_queue(progress, overflow)
        assert drain(fq) == overflow and progress.dropped["no_signal"] == 0

    def test_empty_is_re_raised_so_the_health_check_runs(self):
        progress = make_progress(n=10)
        fq = filter_queue(progress, [sample(0, rewards=(1.0, 1.0), k=k) for k in range(2)])
        started = time.monotonic()
        with pytest.raises(queue.Empty):
            fq.get(timeout=0.2)
        assert time.monotonic() - started < 5

    def test_a_late_sample_of_a_dropped_group_does_not_train(self):
        progress = make_progress(n=10)
        late = sample(0, k=1)
        fq = filter_queue(progress, [late])
        progress.drop(0, "lost")
        assert drain(fq) == []


# ------------------------------------------------------------------------------------------------- StopAwareDataset
class TestStopAwareDataset:
    def test_yields_one_stop_then_ends_and_is_sticky(self):
        progress = make_progress(n=2)

        def batcher():
            yield "mb0"
            progress.train([0, 1])
            yield "mb1"
            yield "never"

        stream = StopAwareDataset(batcher(), progress)
        items = list(stream)
        assert items[:2] == ["mb0", "mb1"] and isinstance(items[2], RolloutStop) and len(items) == 3
        assert items[2].code == StopCode.DONE
        again = list(stream)  # the Trainer re-iterates the loader per "epoch"
        assert len(again) == 1 and again[0] is items[2]

    def test_a_stop_raised_inside_the_pipeline_becomes_the_stop_item(self):
        progress = make_progress(n=2)

        def batcher():
            yield "mb0"
            progress.drop(0, "no_signal")
            progress.drop(1, "no_signal")  # raises: the whole pass trained nothing

        items = list(StopAwareDataset(batcher(), progress))
        assert items[0] == "mb0" and items[1].code == StopCode.STALLED

    def test_any_pipeline_error_reaches_the_stream_as_an_error_stop(self):
        def batcher():
            yield "mb0"
            raise RuntimeError("rollout worker died")

        items = list(StopAwareDataset(batcher(), make_progress()))
        assert items[1].code == StopCode.PIPELINE_ERROR and "rollout worker died" in items[1].error
        assert isinstance(items[1].__cause__, RuntimeError)

    def test_check_runs_before_the_first_micro_batch(self):
        progress = make_progress(n=1)
        progress.train([0])
        items = list(StopAwareDataset(iter(["never"]), progress))
        assert len(items) == 1 and items[0].code == StopCode.DONE

    @pytest.mark.parametrize("window", [1, 2])
    def test_a_micro_batch_is_let_go_before_the_next_is_built(self, window):
        # Held by the stream while the batcher built the next one, each micro-batch's young objects doubled the
        # collector's live set and brought a collection inside every micro-batch. window=2 covers the fill path.
        progress = make_progress(n=3, epochs=10)
        previous: list[weakref.ref] = []
        alive_while_building: list[bool] = []

        class MicroBatch:
            pass

        def batcher():
            for group_id in range(3):
                alive_while_building.append(bool(previous) and previous[-1]() is not None)
                micro_batch = MicroBatch()
                previous.append(weakref.ref(micro_batch))
                progress.train([group_id])
                yield micro_batch
                del micro_batch

        iterator = iter(StopAwareDataset(batcher(), progress, window=window))
        kinds = []
        while not kinds or kinds[-1] != "RolloutStop":
            kinds.append(type(next(iterator)).__name__)  # the consumer keeps no reference
        assert kinds[-1] == "RolloutStop" and kinds.count("MicroBatch") == 3
        assert alive_while_building == [False, False, False]


# ------------------------------------------------------------------------------------------------- ProgressCollator
def _row(samples) -> TreeRow:
    row = TreeRow()
    for s in samples:
        row.add({"input_ids": s.input_ids, "completion_mask": s.completion_mask, "old_log_probs": s.old_log_probs,
                 "advantage": s.advantage, "group_id": s.group_id, "metrics": s.metrics})
    return row


class TestProgressCollator:
    def test_normal_micro_batch_reports_trained_groups(self):
        progress = make_progress(n=10)
        collator = ProgressCollator(0, 2, groups_trained=set(), progress=progress)
        rows = [_row([sample(3, k=0)]), _row([sample(4, k=1)])]
        batch = collator([rows])
        assert batch["input_ids"].shape[0] == 2 and STOP_KEY not in batch
        assert progress.consumed == {3, 4} and progress.groups_trained == 2
        assert list(collator.in_flight) == [frozenset({3, 4})]
        # TRL's collator fills the set it is given; the trainer hands it a throw-away one, so only progress.train
        # (drops included) decides what TRL's consumed set holds.
        assert collator.groups_trained is not progress.consumed
        assert progress.reward_mean == 0.5

    def test_an_infinite_reward_is_not_the_reported_mean(self):
        progress = make_progress(n=10)
        collator = ProgressCollator(0, 2, groups_trained=set(), progress=progress)
        collator([[_row([sample(3, rewards=(0.5, 0.5), k=0)])]])
        collator([[_row([sample(4, rewards=(float("inf"), 0.0), k=0)])]])
        assert progress.reward_mean == 0.5
        assert progress.report(phase="Running", global_step=2).reward_mean == 0.5  # a report holds finite numbers

    def test_stop_item_is_a_tensor_per_rank(self):
        progress = make_progress(n=4)
        collator = ProgressCollator(0, 3, groups_trained=set(), progress=progress)
        batch = collator([RolloutStop("stalled: x")])
        assert set(batch) == {STOP_KEY}
        assert all(isinstance(v, torch.Tensor) for v in batch.values())  # a str leaf breaks the multi-rank broadcast
        assert batch[STOP_KEY].shape == (3, 3)
        # what one rank sees after the dispatcher slices row i to rank i
        assert stop_from_batch({STOP_KEY: batch[STOP_KEY][1:2]})[0] == StopCode.STALLED
        assert stop_from_batch({"input_ids": torch.zeros(1)}) is None

    def test_without_progress_other_ranks_still_collate_the_stop(self):
        collator = ProgressCollator(0, 2, groups_trained=set())
        assert stop_from_batch(collator([RolloutStop()]))[0] == StopCode.DONE


# ------------------------------------------------------------------------------------------------- forked groups
def forked(group_id, rows, k=0, **kwargs) -> RolloutSample:
    """One row of a group the rollout loop stamped as `rows` rows (a conversation forked:
    grpo_trainer.agentic.episodes)."""
    row = sample(group_id, k=k, **kwargs)
    row.metrics[GROUP_ROWS_KEY] = float(rows)
    return row


class TestForkedGroups:
    def test_a_group_of_more_rows_than_generations_trains_its_fitting_row(self):
        # Two conversations, the first forked into two rows that are both too long: the third row still trains.
        progress = make_progress(n=10)
        kept = forked(0, 3, k=1, tokens=6)
        fq = filter_queue(progress, [forked(0, 3, tokens=9), forked(0, 3, tokens=9), kept], token_budget=8)
        assert drain(fq) == [kept]
        assert progress.dropped["too_long"] == 0 and 0 not in progress.consumed

    def test_a_group_is_dropped_once_when_every_one_of_its_rows_was(self):
        progress = make_progress(n=10)
        rows = [forked(0, 3, rewards=(1.0, 1.0), k=k % 2) for k in range(3)]
        fq = filter_queue(progress, rows)
        assert drain(fq) == []
        assert progress.dropped["no_signal"] == 1 and 0 in progress.consumed

    def test_a_group_of_fewer_rows_than_generations_is_settled_by_its_stamp(self):
        # Both conversations' rows dropped, but one conversation had no trained token and became no row.
        progress = make_progress(n=10)
        fq = filter_queue(progress, [forked(0, 1, rewards=(1.0, 1.0))])
        drain(fq)
        assert progress.dropped["no_signal"] == 1

    def test_the_stamps_leave_the_sample_before_trls_collator_averages_its_metrics(self):
        progress = make_progress(n=10)
        rows = [forked(0, 2, k=k) for k in range(2)]
        assert [set(row.metrics) for row in drain(filter_queue(progress, rows))] == [{"reward", "reward_std"}] * 2
