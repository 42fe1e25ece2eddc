"""RolloutProgress at production shape: exact streaks across a resume, O(1) stall bookkeeping, folded id sets,
gradient-accumulation windows given back, and /progress read from another thread while the trainer reports."""

from __future__ import annotations

import json
import random
import threading
import urllib.request

import pytest

from grpo_trainer.contract.codes import LearnerPhase
from grpo_trainer.learner.exporter import ProgressServer
from grpo_trainer.progress import ConsumedIds, ProgressState, RolloutProgress, RolloutStop, StopCode


def make_progress(n=10, epochs=3, stall_groups=0, consumed=None) -> RolloutProgress:
    return RolloutProgress(set() if consumed is None else consumed, epochs_done=0, stall_groups=stall_groups,
                           groups_per_epoch=n, epochs=epochs)


def resumed(progress: RolloutProgress, n=10, epochs=3, stall_groups=0, exclude=()) -> RolloutProgress:
    # what the checkpoint file holds
    state = json.loads(json.dumps(progress.checkpoint_state(exclude=exclude).to_dict()))
    return RolloutProgress.restore(ProgressState.from_dict(state), ConsumedIds(), stall_groups=stall_groups,
                                   groups_per_epoch=n,
                                      epochs=epochs)


def drop_at(progress: RolloutProgress, position: int) -> None:
    """Drop an absolute position (the resumed worker numbers groups from its start)."""
    progress.drop(position - progress.start_group, "no_signal")


class TestExactResume:
    def test_a_trained_group_after_the_gap_ends_the_streak_before_it(self):
        progress = make_progress()
        progress.train([0, 1, 2, 3, 4, 6])
        for position in range(7, 16):
            drop_at(progress, position)
        again = resumed(progress)
        assert again.start_group == 5
        drop_at(again, 5)  # 6 trained: the true streak is 1
        assert again.stall_streak == 1

    def test_drops_after_the_gap_are_kept_by_identity(self):
        progress = make_progress()
        progress.train(range(5))
        for position in range(6, 15):
            drop_at(progress, position)
        again = resumed(progress)
        with pytest.raises(RolloutStop) as stop:
            drop_at(again, 15)  # 6..15: ten in a row, the limit
        assert stop.value.code == StopCode.STALLED and again.stall_streak == 10

    def test_a_streak_open_at_the_resume_point_continues(self):
        progress = make_progress()
        progress.train(range(3))
        for position in range(3, 9):
            drop_at(progress, position)
        again = resumed(progress)
        assert again.start_group == 9
        drop_at(again, 10)
        drop_at(again, 11)
        drop_at(again, 9)  # joins 3..8 from before the resume and 10..11 after it: 9 in a row
        assert again.stall_streak == 9
        with pytest.raises(RolloutStop) as stop:
            drop_at(again, 12)
        assert stop.value.code == StopCode.STALLED and again.stall_streak == 10

    @pytest.mark.parametrize("seed", range(20))
    def test_resumed_runs_see_the_streaks_an_uninterrupted_run_sees(self, seed):
        rng = random.Random(seed)
        n, limit = 10, 6
        events = [(g, "drop" if rng.random() < 0.8 else "train") for g in range(120)]
        rng.shuffle(events)  # groups finish out of order
        cut = rng.randrange(1, len(events))

        def replay(progress, events):
            for group, kind in events:
                relative = group - progress.start_group
                if relative < 0 or relative in progress.consumed:
                    continue
                try:
                    progress.drop(relative, "no_signal") if kind == "drop" else progress.train([relative])
                except RolloutStop as stop:
                    return stop.code, progress.stall_streak
            return None, None

        whole = make_progress(n=n, epochs=20, stall_groups=limit)
        expected = replay(whole, events)
        first = make_progress(n=n, epochs=20, stall_groups=limit)
        outcome = replay(first, events[:cut])
        if outcome != (None, None):
            assert outcome == expected
            return
        again = resumed(first, n=n, epochs=20, stall_groups=limit)
        # The resumed worker regenerates nothing before its start; groups consumed after it are skipped.
        assert replay(again, events[cut:]) == expected


class TestScale:
    def test_one_pass_of_100k_dropped_groups_stalls_exactly_at_the_limit(self):
        n = 100_000
        progress = make_progress(n=n, epochs=2, consumed=ConsumedIds())
        for group_id in range(n - 1):
            progress.drop(group_id, "no_signal")
        assert progress.stall_streak == n - 1
        with pytest.raises(RolloutStop) as stop:
            progress.drop(n - 1, "no_signal")
        assert stop.value.code == StopCode.STALLED and f"{n} prompt groups in a row" in stop.value.error

    def test_out_of_order_drops_join_runs_from_both_sides(self):
        progress = make_progress(n=100, epochs=1, stall_groups=7)
        for group_id in (5, 3, 1, 0, 4):
            progress.drop(group_id, "no_signal")
        assert progress.stall_streak == 3  # 3..5 and 0..1 are split by 2; the newest drop, 4, is in 3..5
        progress.drop(2, "no_signal")
        assert progress.stall_streak == 6
        progress.train([3])  # a late sample: 3 trained after all
        assert progress.stall_streak == 3  # the newest drop, 2, is in 0..2

    def test_folding_keeps_counts_and_checkpoints_but_not_the_ids(self):
        plain, folded = make_progress(n=1000, epochs=2), make_progress(n=1000, epochs=2, consumed=ConsumedIds())
        for progress in (plain, folded):
            for group_id in range(1500):
                progress.train([group_id]) if group_id % 3 else progress.drop(group_id, "no_signal")
            progress.drop(1501, "stale")
        folded.fold(1400)
        assert len(folded.consumed) == len(plain.consumed) == 1501 and folded.consumed.floor == 1400
        assert len(folded._trained_ids) + len(folded._drop_reason) < 110
        for key in ("groups_consumed", "groups_trained", "epochs_done", "first_unconsumed", "stall_streak"):
            assert getattr(folded, key) == getattr(plain, key), key
        assert folded.checkpoint_state(exclude={1450}).to_dict() == plain.checkpoint_state(exclude={1450}).to_dict()


class TestGivenBack:
    def test_untrained_groups_are_unconsumed_and_left_out_of_the_checkpoint(self):
        progress = make_progress(n=10, epochs=1)
        progress.train([0, 1, 2, 3])
        progress.untrain({2, 3})  # their accumulation window never reached an optimizer step
        assert progress.groups_trained == 2 and progress.first_unconsumed == 2 and progress.groups_consumed == 2
        state = progress.checkpoint_state().to_dict()
        assert state["first_unconsumed"] == 2 and state["consumed_after"] == [] and state["groups_trained"] == 2

    def test_a_group_whose_rows_reached_a_step_stays_trained_when_its_other_rows_are_discarded(self):
        # A multi-row group split across windows: its first rows stepped, its others are in the window a stop
        # discarded, or only collated when a checkpoint is saved. It trained: a resume must not train it again.
        progress = make_progress(n=10, epochs=1)
        progress.train([0, 1, 2])
        progress.stepped([0, 1, 2])
        progress.train([2, 3])  # group 2's other rows, with group 3's first
        assert progress.checkpoint_state(exclude={2, 3}).to_dict()["first_unconsumed"] == 3
        progress.untrain({2, 3})  # the stop discarded that window
        assert progress.groups_trained == 3 and progress.first_unconsumed == 3 and progress.groups_consumed == 3
        state = progress.checkpoint_state().to_dict()
        assert state["first_unconsumed"] == 3 and state["consumed_after"] == [] and state["groups_trained"] == 3

    def test_settled_groups_collated_again_are_not_left_out_of_the_checkpoint(self):
        # A late row of a group folded long ago (its other rows stepped): the checkpoint still starts after it.
        progress = make_progress(n=10, epochs=1, consumed=ConsumedIds())
        progress.train([0, 1, 2, 3])
        progress.stepped([0, 1, 2, 3])
        progress.fold(4)
        progress.train([1, 4])
        state = progress.checkpoint_state(exclude={1, 4}).to_dict()
        assert state["first_unconsumed"] == 4 and state["groups_trained"] == 4

    def test_consumed_ids_unfold_when_a_folded_group_is_given_back(self):
        ids = ConsumedIds(range(10))
        ids.fold(10)
        ids.discard(7)
        assert ids.floor == 7 and 7 not in ids and {8, 9} <= ids and len(ids) == 9


def test_progress_is_consistent_while_the_trainer_reports_from_another_thread():
    progress = make_progress(n=10**7, epochs=1, stall_groups=10**6, consumed=ConsumedIds())
    server = ProgressServer(lambda: progress.report(phase=LearnerPhase.RUNNING, global_step=0), port=0,
                            host="127.0.0.1").start()
    done = threading.Event()

    def hammer():
        group_id = 0
        while not done.is_set():
            # every other group trains and the rest drop: consumed stays ragged, the set keeps growing
            progress.train(range(group_id, group_id + 40, 2))
            for dropped in range(group_id + 41, group_id + 80, 2):
                progress.drop(dropped, "no_signal")
            group_id += 80

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        for _ in range(150):  # each read while the set grows; 500 took a minute of the suite for nothing more
            with urllib.request.urlopen(f"{server.url}/progress", timeout=10) as response:  # noqa: S310
                assert response.status == 200
                report = json.loads(response.read())
            assert report["groupsTrained"] + sum(report["dropped"].values()) == report["groupsConsumed"]
    finally:
        done.set()
        thread.join(10)
        server.stop()


class TestStops:
    def test_a_requested_stop_ends_the_stream_without_waiting_for_the_queue(self):
        import queue

        from grpo_trainer.progress import SampleFilterQueue, SampleLimits

        progress = make_progress()
        source = SampleFilterQueue(queue.Queue(), progress, model_version_fn=lambda: 0,
                                   limits=SampleLimits(max_staleness=1, num_generations=2))
        progress.request_stop("preempted: SIGTERM")
        with pytest.raises(RolloutStop) as stop:
            source.get(timeout=3600)  # an empty queue: without the flag check this waits an hour
        assert stop.value.code == StopCode.PREEMPTED

    def test_the_end_of_the_run_comes_at_a_window_boundary(self):
        from grpo_trainer.progress import StopAwareDataset

        progress = make_progress(n=2, epochs=1)

        def batcher():
            for group_id in range(100):  # the worker cycles: groups past the bound keep coming
                progress.train([group_id])
                yield f"micro-batch {group_id}"

        items = list(StopAwareDataset(batcher(), progress, window=4))
        assert items[:4] == [f"micro-batch {g}" for g in range(4)]  # the bound (2 groups) ends the 2nd; 2 fill
        assert isinstance(items[4], RolloutStop) and items[4].code == StopCode.DONE and len(items) == 5

    def test_other_stops_come_at_once(self):
        from grpo_trainer.progress import StopAwareDataset

        progress = make_progress(n=10, epochs=1)

        def batcher():
            yield "micro-batch 0"
            progress.request_stop("preempted")
            yield "micro-batch 1"

        items = list(StopAwareDataset(batcher(), progress, window=4))
        assert items[:2] == ["micro-batch 0", "micro-batch 1"]  # no fill: the trainer discards this partial window
        assert items[2].code == StopCode.PREEMPTED and len(items) == 3


def test_a_drop_past_the_bound_is_consumed_but_not_counted():
    """As a trained group past the bound: otherwise dropped exceeds consumed (seen when a fast run went past it)."""
    progress = make_progress(n=4, epochs=1, stall_groups=100, consumed=ConsumedIds())
    progress.train([0, 1])
    progress.drop(2, "no_signal")
    with pytest.raises(RolloutStop):  # the bound's last group: the stream is complete
        progress.drop(3, "no_signal")
    progress.drop(7, "no_signal")  # the next pass's overflow
    report = progress.report(phase=LearnerPhase.RUNNING, global_step=0)
    assert report.groups_trained + sum(report.dropped.values()) == report.groups_consumed == 4
