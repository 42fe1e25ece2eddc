"""The learner's end of a run with `output`: every rank saves, rank 0 exports with the run's provenance, and an
export that fails ends the learner with the export-failed code and a message naming the path (the operator fails the
run on it: tests/operator/test_status.py). The learner here is a stand-in for what `main` calls on it; the real
learner's export runs in tests/operator/cli/test_local_run.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_trainer import contract as c
from grpo_trainer import learner_main
from grpo_trainer.model_export import verify_export


class FinishedLearner:
    """What learner_main.main reads of a learner that trained to its bound."""

    def __init__(self, is_main: bool = True):
        self.accelerator = SimpleNamespace(is_main_process=is_main, num_processes=1, process_index=0,
                                           unwrap_model=lambda model: model)
        self.model = SimpleNamespace(generation_config=None)
        self.state = SimpleNamespace(log_history=[{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}])
        self.phase, self.message = c.LearnerPhase.SUCCEEDED, ""
        self.saved: list[str] = []

    def request_preemption(self) -> bool:
        return True

    def train(self, resume_from_checkpoint=None) -> None:
        pass

    def save_model(self, folder: str) -> None:
        self.saved.append(folder)
        if self.accelerator.is_main_process:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model.safetensors").write_bytes(b"weights")

    def progress_report(self) -> c.ProgressReport:
        return c.ProgressReport(phase=c.LearnerPhase.SUCCEEDED, groups_total=4, groups_consumed=4, groups_trained=3,
                                dropped={"no_signal": 1}, global_step=2, epochs_done=1)

    def close(self) -> None:
        pass


def run_config(tmp_path: Path, model_dir: Path) -> c.RunConfig:
    return c.RunConfig.model_validate({
        "runName": "tiny", "model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu"}, "output_dir": str(tmp_path / "out"),
        "terminationMessagePath": str(tmp_path / "termination-log"),
        "output": {"directory": str(model_dir), "uri": model_dir.as_uri(), "runSpec": {"model": "m"}},
    })


@pytest.fixture
def learner(monkeypatch) -> FinishedLearner:
    finished = FinishedLearner()
    monkeypatch.setattr(learner_main, "build_learner", lambda config, config_path=None: finished)
    return finished


def test_a_learner_that_exported_reports_the_model_in_its_final_report(tmp_path, learner):
    model_dir = tmp_path / "models" / "tiny"
    assert learner_main.main(run_config(tmp_path, model_dir)) == c.EXIT_SUCCEEDED
    report = c.parse_progress((tmp_path / "termination-log").read_text())
    assert report.output is not None and report.output.path == str(model_dir) and report.output.step == 2
    assert report.message.endswith(f"; model exported to {model_dir.as_uri()}")
    manifest = verify_export(model_dir)
    assert manifest["run"] == {"name": "tiny", "namespace": "default"} and manifest["spec"] == {"model": "m"}
    assert manifest["progress"]["dropped"]["no_signal"] == 1
    assert manifest["progress"]["rewardTrend"] == [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}]
    assert json.loads((tmp_path / "termination-log").read_text())["output"]["sha256"] == report.output.sha256
    assert not (tmp_path / "out" / "final").exists()  # the export replaces the plain save


def test_a_failed_export_exits_with_its_own_code_naming_the_path(tmp_path, learner):
    (tmp_path / "models").write_text("a file where the volume's folder should be")
    model_dir = tmp_path / "models" / "tiny"
    assert learner_main.main(run_config(tmp_path, model_dir)) == c.EXIT_EXPORT_FAILED
    assert c.EXIT_EXPORT_FAILED in c.PERMANENT_EXIT_CODES
    report = c.parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == c.LearnerPhase.FAILED and report.output is None
    assert report.message.startswith(f"could not export the model to {model_dir}: ")


def test_other_ranks_save_with_rank_0_but_leave_the_writing_to_it(tmp_path):
    rank1 = FinishedLearner(is_main=False)
    model_dir = tmp_path / "models" / "tiny"
    assert learner_main.export_trained_model(run_config(tmp_path, model_dir), rank1) is None
    assert rank1.saved == [str(tmp_path / "models" / ".tiny.partial")]  # the same folder as rank 0's save
    assert not (tmp_path / "models").exists()
