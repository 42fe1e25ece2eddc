"""The checkpointed progress as a typed value (grpo_trainer.progress.ProgressState): its versioned JSON form, the
errors for a torn or newer state, and RolloutProgress restored from it."""

from __future__ import annotations

import json

import pytest

from grpo_trainer.contract.codes import LearnerPhase
from grpo_trainer.learner.checkpoints import MarkerError, read_marker, write_marker
from grpo_trainer.progress import PROGRESS_STATE_VERSION, ProgressState, ProgressStateError, RolloutProgress


def trained_and_dropped() -> RolloutProgress:
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=4, epochs=2)
    progress.train([0, 1, 4])
    progress.drop(3, "no_signal")
    assert progress.regenerate(5)
    return progress


def test_the_state_round_trips_through_json_with_its_version():
    state = trained_and_dropped().checkpoint_state()
    text = state.to_json()
    assert json.loads(text)["version"] == PROGRESS_STATE_VERSION
    assert ProgressState.from_json(text) == state
    assert state.first_unconsumed == 2 and state.dropped_after == {"no_signal": [3]}


def test_restore_takes_the_typed_state_and_continues_where_the_run_stopped():
    original = trained_and_dropped()
    consumed: set[int] = set()
    resumed = RolloutProgress.restore(ProgressState.from_json(original.checkpoint_state().to_json()), consumed,
                                      stall_groups=0, groups_per_epoch=4, epochs=2)
    assert resumed.start_group == 2 and consumed == {1, 2, 3}  # absolute 3, 4 and the regenerated 5
    before = original.report(phase=LearnerPhase.RUNNING, global_step=1)
    after = resumed.report(phase=LearnerPhase.RUNNING, global_step=1)
    assert (after.groups_trained, after.groups_consumed, after.dropped, after.regenerated) == (
        before.groups_trained, before.groups_consumed, before.dropped, before.regenerated)


def test_a_state_written_before_the_version_field_reads_as_version_one():
    payload = trained_and_dropped().checkpoint_state().to_dict()
    del payload["version"]
    assert ProgressState.from_dict(payload).version == 1


def test_a_newer_version_is_refused_by_name_not_misread():
    payload = {**trained_and_dropped().checkpoint_state().to_dict(), "version": PROGRESS_STATE_VERSION + 1}
    with pytest.raises(ProgressStateError, match=f"version {PROGRESS_STATE_VERSION + 1}, newer than this learner"):
        ProgressState.from_dict(payload)


@pytest.mark.parametrize("text, problem", [
    ("", "is empty"),
    ('{"first_unconsumed": 2, "consumed_after": [3', "is not valid JSON"),
    ('{"first_unconsumed": 2}', "consumed_after: Field required"),
    ('[1, 2]', "holds a JSON list"),
])
def test_a_torn_state_raises_a_clear_error(text, problem):
    with pytest.raises(ProgressStateError, match=problem):
        ProgressState.from_json(text)


def test_the_checkpoint_marker_refuses_a_newer_state(tmp_path):
    state = {**trained_and_dropped().checkpoint_state().to_dict(), "model_version": 1, "global_step": 1,
             "version": PROGRESS_STATE_VERSION + 1}
    write_marker(str(tmp_path), state)
    with pytest.raises(MarkerError, match="newer than this learner"):
        read_marker(str(tmp_path))


def test_the_checkpoint_marker_holds_the_state_it_was_given(tmp_path):
    state = trained_and_dropped().checkpoint_state()
    write_marker(str(tmp_path), {**state.to_dict(), "model_version": 1, "global_step": 1})
    assert ProgressState.from_dict(read_marker(str(tmp_path))) == state
