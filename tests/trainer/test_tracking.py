"""Experiment tracking: spec.tracking to report_to and the trackers' env, one-line config errors for a tracker that
cannot work, our progress numbers and the run's spec as parameters."""

from __future__ import annotations

import pytest

from grpo_trainer import contract as c
from grpo_trainer import tracking
from grpo_trainer.learner_main import trainer_arguments


def config(tmp_path=None, **fields) -> c.RunConfig:
    base = {"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}], "runName": "tiny",
            "namespace": "ml"}
    if tmp_path is not None:
        base.update(checkpoint={"directory": str(tmp_path / "ckpt")}, outputDir=str(tmp_path / "out"),
                    terminationMessagePath=str(tmp_path / "termination-log"))
    return c.RunConfig.model_validate({**base, **fields})


MLFLOW = {"mlflow": {"trackingUri": "http://127.0.0.1:5000", "experiment": "grpo", "runName": "tiny-1"}}


def test_a_run_without_tracking_reports_to_nothing():
    assert trainer_arguments(config())["report_to"] == []
    assert tracking.configure(config(), environ={}) == []


def test_each_tracker_maps_to_report_to_and_the_env_its_integration_reads(tmp_path):
    wandb = {"wandb": {"project": "p", "mode": "offline", "entity": "team"}}
    run = config(tmp_path, tracking={**MLFLOW, "tensorboard": {}, **wandb})
    arguments = trainer_arguments(run)
    assert arguments["report_to"] == ["mlflow", "tensorboard", "wandb"]
    assert arguments["run_name"] == "tiny-1"  # the MLflow run name, when the spec gives one
    env = tracking.tracker_env(run)
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000" and env["MLFLOW_EXPERIMENT_NAME"] == "grpo"
    assert env["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "ckpt" / "tensorboard")  # on the checkpoint volume
    assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(tmp_path / "ckpt" / "wandb")
    assert env["WANDB_PROJECT"] == "p" and env["WANDB_ENTITY"] == "team"
    # The test tools hold MLflow's client and TensorBoard (W&B is the image's `tracking` extra alone).
    environ: dict[str, str] = {}
    assert tracking.configure(config(tmp_path, tracking={**MLFLOW, "tensorboard": {}}), environ) == [
        "mlflow", "tensorboard"]
    assert environ["TENSORBOARD_LOGGING_DIR"] == env["TENSORBOARD_LOGGING_DIR"]
    assert (tmp_path / "ckpt" / "tensorboard").is_dir()
    # Without an experiment the run's namespace groups its runs.
    assert tracking.tracker_env(config(tracking={"mlflow": {"trackingUri": "u"}}))["MLFLOW_EXPERIMENT_NAME"] == "ml"


def test_missing_credentials_are_one_line_naming_the_field():
    run = config(tracking={"mlflow": {"trackingUri": "u", "credentialsSecret": "mlflow-login"}})
    with pytest.raises(tracking.TrackingConfigError, match=r"^spec\.tracking\.mlflow\.credentialsSecret: Secret "
                                                           r"'mlflow-login' is missing"):
        tracking.check_trackers(run, environ={})
    tracking.check_trackers(run, environ={"MLFLOW_TRACKING_TOKEN": "t"})
    online = config(tracking={"wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "apiKey"}}})
    with pytest.raises(tracking.TrackingConfigError, match=r"^spec\.tracking\.wandb\.apiKeySecret: Secret 'wandb'"):
        tracking.check_trackers(online, environ={})


def test_a_learner_asked_for_a_tracker_it_lacks_exits_78_naming_the_field(tmp_path, monkeypatch):
    from grpo_trainer.learner_main import main

    monkeypatch.setitem(tracking.TRACKER_MODULES, "tensorboard", "grpo_no_such_tracker_package")
    run = config(tmp_path, tracking={"tensorboard": {}}, learner={"device": "cpu"})
    assert main(run) == c.EXIT_INVALID_CONFIG
    report = c.parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == c.LearnerPhase.FAILED
    assert report.message == ("spec.tracking.tensorboard: this learner image has no grpo_no_such_tracker_package "
                              "package (install grpo-operator's `tracking` extra in the image)")


def test_progress_numbers_for_the_trackers():
    report = c.ProgressReport(groups_total=9, groups_consumed=5, groups_trained=3, stall_streak=2,
                              dropped={"no_signal": 2}, rollout_wait_seconds=1.5, weight_version=4)
    logs = tracking.progress_logs(report)
    assert logs["progress/groups_trained"] == 3 and logs["progress/groups_consumed"] == 5
    assert logs["progress/groups_dropped/no_signal"] == 2 and logs["progress/stall_streak"] == 2
    assert logs["progress/rollout_wait_s"] == 1.5 and logs["progress/weight_version"] == 4


def test_the_run_spec_becomes_flat_string_parameters():
    parameters = tracking.run_parameters(config(training={"learningRate": 3e-6}, tracking=MLFLOW))
    assert parameters["grporun.training.learningRate"] == "3e-06"
    assert parameters["grporun.model"] == "m" and parameters["grporun.tracking.mlflow.experiment"] == "grpo"
    assert parameters["grporun.rewards"].startswith("[")
    assert all(isinstance(v, str) for v in parameters.values())
