"""Which checkpoint a restarted learner resumes from, and the marker that vouches for it
(grpo_trainer.learner.checkpoints)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import pytest

from grpo_trainer.learner.checkpoints import (
    PROGRESS_STATE_FILE,
    MarkerError,
    UnusableCheckpoints,
    newest_checkpoint,
    read_marker,
    write_marker,
)
from grpo_trainer.progress import ProgressState, RolloutProgress


def progress_state() -> dict:
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=4, epochs=2)
    progress.train([0, 1, 3])
    progress.drop(2, "no_signal")
    return {**progress.checkpoint_state().to_dict(), "model_version": 3, "global_step": 3}


def complete_checkpoint(directory: Path, step: int) -> Path:
    checkpoint = directory / f"checkpoint-{step}"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"w" * 1000)
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "sub" / "rng_state_1.pth").write_bytes(b"r" * 10)
    write_marker(str(checkpoint), progress_state())
    return checkpoint


def marker_of(checkpoint: Path) -> Path:
    return checkpoint / PROGRESS_STATE_FILE


def test_a_complete_marker_reads_back_its_state(tmp_path):
    checkpoint = complete_checkpoint(tmp_path, 3)
    state = read_marker(str(checkpoint))
    assert {k: state[k] for k in progress_state()} == progress_state()
    contents = {"model.safetensors": b"w" * 1000, "sub/rng_state_1.pth": b"r" * 10, "trainer_state.json": b"{}"}
    assert state["files"] == {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                              for name, data in contents.items()}


def test_resume_skips_a_checkpoint_interrupted_while_saving(tmp_path):
    assert newest_checkpoint(str(tmp_path / "missing")) is None
    for step in (2, 10):
        complete_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-12").mkdir()  # no marker: cut short while saving
    (tmp_path / "checkpoint-x").mkdir()
    # checkpoint-12 is newest but was cut short; 10 beats 2 numerically, not by name
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_only_checkpoints_without_a_marker_mean_a_fresh_run(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    assert newest_checkpoint(str(tmp_path)) is None


def half_written(marker: Path) -> str:
    text = marker.read_text()
    marker.write_text(text[: len(text) // 2])
    return "is not valid JSON"


def empty(marker: Path) -> str:
    marker.write_text("")
    return "is empty"


def incomplete(marker: Path) -> str:
    payload = json.loads(marker.read_text())
    del payload["consumed_after"]
    marker.write_text(json.dumps(payload))
    return "consumed_after: Field required"


def not_an_object(marker: Path) -> str:
    marker.write_text("[1, 2]")
    return "holds a JSON list"


def edited(marker: Path) -> str:
    payload = json.loads(marker.read_text())
    payload["groups_trained"] += 1  # still schema-valid: only the digest tells
    marker.write_text(json.dumps(payload))
    return "does not match its digest"


def model_cut_short(marker: Path) -> str:
    (marker.parent / "model.safetensors").write_bytes(b"w" * 10)
    return "vouches for model.safetensors of 1000 bytes, but it has 10"


def file_missing(marker: Path) -> str:
    (marker.parent / "sub" / "rng_state_1.pth").unlink()
    return "vouches for sub/rng_state_1.pth, which is missing"


def damage_in_place(path: Path) -> None:
    """Bytes overwritten at the start of the file, its size unchanged (a safetensors header length turned huge)."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)


def model_damaged_in_place(marker: Path) -> str:
    damage_in_place(marker.parent / "model.safetensors")
    return f"vouches for model.safetensors, whose content changed after it was written: {marker.parent}/model"


TEARS = [half_written, empty, incomplete, not_an_object, edited, model_cut_short, file_missing, model_damaged_in_place]


@pytest.mark.parametrize("tear", TEARS, ids=[t.__name__ for t in TEARS])
def test_a_torn_checkpoint_is_skipped_for_the_newest_valid_one_with_a_warning_naming_it(tmp_path, tear, caplog):
    complete_checkpoint(tmp_path, 2)
    newest = complete_checkpoint(tmp_path, 4)
    why = tear(marker_of(newest))
    with pytest.raises(MarkerError, match=why):
        read_marker(str(newest))
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.learner.checkpoints"):
        assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(marker_of(newest)) in warning and why in warning


def test_when_no_marker_can_be_trusted_the_error_names_every_file_and_why(tmp_path):
    half = marker_of(complete_checkpoint(tmp_path, 2))
    incomplete_marker = marker_of(complete_checkpoint(tmp_path, 4))
    half_written(half)
    incomplete(incomplete_marker)
    (tmp_path / "checkpoint-6").mkdir()  # no marker at all: skipped as before
    with pytest.raises(UnusableCheckpoints) as error:
        newest_checkpoint(str(tmp_path))
    message = str(error.value)
    assert f"{half} is not valid JSON" in message and f"{incomplete_marker} is incomplete" in message
    assert "checkpoint.directory" in message and "\n" not in message


def test_when_the_only_checkpoint_has_a_damaged_file_the_error_names_that_file(tmp_path):
    checkpoint = complete_checkpoint(tmp_path, 2)
    damage_in_place(checkpoint / "sub" / "rng_state_1.pth")
    with pytest.raises(UnusableCheckpoints) as error:
        newest_checkpoint(str(tmp_path))
    assert f"{checkpoint}/sub/rng_state_1.pth is damaged" in str(error.value)


def test_a_file_damaged_after_a_resume_checked_it_is_found_by_the_next_check(tmp_path):
    checkpoint = complete_checkpoint(tmp_path, 2)
    read_marker(str(checkpoint))
    model = checkpoint / "model.safetensors"
    damage_in_place(model)
    (checkpoint / "model.safetensors").touch()  # another modification time, whatever the clock's resolution
    with pytest.raises(MarkerError, match="model.safetensors is damaged"):
        read_marker(str(checkpoint))


# --- markers of earlier learners ------------------------------------------------------------------------------
def write_size_only_marker(checkpoint: Path, state: dict) -> None:
    """The marker as learners wrote it before the files' hashes (write_marker and checkpoint_files of then)."""
    files = {}
    for path in checkpoint.rglob("*"):
        relative = path.relative_to(checkpoint).as_posix()
        if path.is_file() and relative not in (PROGRESS_STATE_FILE, PROGRESS_STATE_FILE + ".tmp"):
            files[relative] = path.stat().st_size
    payload = {**state, "files": dict(sorted(files.items()))}
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    payload["digest"] = hashlib.sha256(canonical.encode()).hexdigest()
    (checkpoint / PROGRESS_STATE_FILE).write_text(json.dumps(payload))


def before_regeneration_attempts() -> dict:
    """The first marker's progress state: no `version`, no `regeneration_attempts` (nor the later
    `regenerated_environment`)."""
    state = {k: v for k, v in progress_state().items() if k not in ("version", "regeneration_attempts",
                                                                       "regenerated_environment")}
    assert set(state) == {"first_unconsumed", "consumed_after", "dropped_after", "prefix_streak", "regenerated",
                          "bound", "transparent_before", "transparent_after", "groups_trained", "dropped",
                          "epochs_done", "model_version", "global_step"}
    return state


def with_version_one() -> dict:
    """The marker's progress state before the files' hashes: version 1, `regeneration_attempts` included."""
    return {**progress_state(), "version": 1}


@pytest.mark.parametrize("state", [before_regeneration_attempts, with_version_one])
def test_a_size_only_marker_of_an_earlier_learner_is_resumed_from(tmp_path, state):
    complete_checkpoint(tmp_path, 2)
    earlier = complete_checkpoint(tmp_path, 4)
    write_size_only_marker(earlier, state())
    assert newest_checkpoint(str(tmp_path)) == str(earlier)
    restored = ProgressState.from_dict(read_marker(str(earlier)))
    assert restored == dataclasses.replace(ProgressState.from_dict(progress_state()), version=1)
    # Its files are still checked by size.
    model_cut_short(marker_of(earlier))
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_a_learner_whose_checkpoints_cannot_be_trusted_fails_once_with_the_invalid_config_code(tmp_path):
    # The operator fails the run at once on this code (PERMANENT_EXIT_CODES) instead of retrying until the backoff
    # limit: a restart would find the same files. The check comes before the model loads (this model does not exist).
    from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, PERMANENT_EXIT_CODES, LearnerPhase
    from grpo_trainer.contract.config import RunConfig
    from grpo_trainer.contract.report import parse_progress
    from grpo_trainer.learner.main import main

    empty(marker_of(complete_checkpoint(tmp_path / "checkpoints", 2)))
    config = RunConfig.model_validate({
        "model": str(tmp_path / "no-model"), "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu"}, "checkpoint": {"directory": str(tmp_path / "checkpoints")},
        "output_dir": str(tmp_path / "out"), "terminationMessagePath": str(tmp_path / "termination-log"),
    })
    assert main(config) == EXIT_INVALID_CONFIG
    assert EXIT_INVALID_CONFIG in PERMANENT_EXIT_CODES
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED
    assert "checkpoint-2/grpo_progress.json is empty" in report.message


def test_a_checkpoint_rewritten_in_place_is_not_resumed_from_while_torn(tmp_path, monkeypatch):
    # The end-of-run (or preemption) save at the step of a step save writes into the same checkpoint-N directory.
    # Killed meanwhile, the old marker vouched for a directory holding half of the new files.
    from types import SimpleNamespace

    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    from grpo_trainer.learner.trainer import GRPOLearner

    for step in (2, 4):
        complete_checkpoint(tmp_path, step)

    def killed_while_saving(self, model, trial):
        (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt("SIGKILL stands in here")

    monkeypatch.setattr(AsyncGRPOTrainer, "_save_checkpoint", killed_while_saving)
    learner = object.__new__(GRPOLearner)  # only what _save_checkpoint reads
    learner.accelerator = SimpleNamespace(is_main_process=True)
    learner.state = SimpleNamespace(global_step=4)
    learner._get_output_dir = lambda trial: str(tmp_path)
    learner.checkpoint_uploads = None  # checkpoints stay in their folder
    try:
        learner._save_checkpoint(None, None)
    except KeyboardInterrupt:
        pass
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


@pytest.mark.slow
def test_a_real_learner_vouches_for_its_checkpoints_and_a_restart_skips_a_torn_one(tiny_model_dir, tmp_path):
    from tests.trainer.learner.test_learner_runs import run

    common = ["--scenario", "third_no_signal", "--prompts", "9", "--epochs", "2", "--save-steps", "1"]
    (first,) = run(tiny_model_dir, tmp_path / "first", *common, "--max-steps", "3")
    checkpoints = tmp_path / "first" / "checkpoints"
    saved = {step: read_marker(str(checkpoints / f"checkpoint-{step}")) for step in (1, 2, 3)}  # each one passes
    assert "trainer_state.json" in saved[3]["files"]
    model = checkpoints / "checkpoint-3" / "model.safetensors"
    assert saved[3]["files"]["model.safetensors"] == {
        "size": model.stat().st_size, "sha256": hashlib.sha256(model.read_bytes()).hexdigest()}
    # The newest model file is damaged in place, its size unchanged (every restart failed loading it, naming no
    # file), and the marker before it is cut short on the volume: the restart resumes from the one before both.
    damage_in_place(model)
    half_written(marker_of(checkpoints / "checkpoint-2"))
    (second,) = run(tiny_model_dir, tmp_path / "second", *common, "--resume-newest", str(checkpoints))
    assert second["resumed_from"] == str(checkpoints / "checkpoint-1")
    assert second["outcome"] == "succeeded" and second["start_position"] == saved[1]["first_unconsumed"]
    assert second["consumed_absolute"] == list(range(18))
    assert second["progress"]["groupsTrained"] + sum(second["progress"]["dropped"].values()) == 18


def resumed_through_a_checkpoint(progress: RolloutProgress, directory: Path) -> RolloutProgress:
    """What a restart does: the state into a marker, the marker checked and read back, a new RolloutProgress."""
    directory.mkdir()
    write_marker(str(directory), {**progress.checkpoint_state().to_dict(), "model_version": 0, "global_step": 0})
    return RolloutProgress.restore(ProgressState.from_dict(read_marker(str(directory))), set(), stall_groups=0,
                                      groups_per_epoch=progress.groups_per_epoch, epochs=progress.epochs)


def test_the_regeneration_limit_of_a_slot_holds_across_resumes(tmp_path):
    # Without the per-slot count in the checkpoint, a learner preempted between regenerations regenerated a slot
    # without bound: each restart began its count again.
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=2, epochs=1,
                               regenerate_limit=2)
    assert progress.regenerate(0)
    stand_in = progress.start_group + progress.needed_end - 1  # absolute position of the slot's stand-in
    for attempt in (2, 3):
        progress = resumed_through_a_checkpoint(progress, tmp_path / f"checkpoint-{attempt}")
        regenerated = progress.regenerate(stand_in - progress.start_group)
        assert regenerated == (attempt <= progress.regenerate_limit), attempt
        stand_in = progress.start_group + progress.needed_end - 1
    assert progress.regenerated == 2  # the third stale generation of the slot is the caller's to drop as stale
