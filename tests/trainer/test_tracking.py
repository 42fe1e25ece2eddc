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


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from tests.support.mlflow_server import MISSING, MLFLOW, running_mlflow_server

    if not MLFLOW.exists():
        pytest.skip(MISSING)
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        server.wait_ready()
        yield server


@pytest.mark.slow
def test_a_real_mlflow_server_receives_the_spec_and_every_steps_metrics(mlflow_server, tmp_path, monkeypatch):
    """The learner's trackers as it wires them (transformers' MLflow integration from the env `configure` sets, our
    parameters callback after it), fed TRL-shaped logs with our progress numbers, against `mlflow server`."""
    from mlflow.tracking import MlflowClient
    from transformers import TrainerControl, TrainerState
    from transformers.integrations import MLflowCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig

    run = config(tmp_path, learner={"device": "cpu"}, training={"learningRate": 3e-6},
                 tracking={"mlflow": {"trackingUri": mlflow_server.uri, "experiment": "grpo-test",
                                      "runName": "tiny-1"}})
    environ: dict[str, str] = {}
    trackers = tracking.configure(run, environ)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = AsyncGRPOConfig(**trainer_arguments(run))
    assert args.report_to == ["mlflow"]
    integration = MLflowCallback()
    callbacks = [integration, tracking.parameters_callback(run, trackers, [integration])]
    state, control = TrainerState(), TrainerControl()
    for callback in callbacks:
        callback.on_train_begin(args, state, control, model=None)
    for step in (1, 2, 3):
        state.global_step = step
        report = c.ProgressReport(groups_total=9, groups_consumed=2 * step, groups_trained=step, stall_streak=0,
                                  dropped={"no_signal": step}, rollout_wait_seconds=0.5 * step)
        logs = {"loss": 0.25 * step, "entropy": 2.0, "kl": 0.01, "clip_ratio/region_mean": 0.0,
                "learning_rate": 3e-6, **tracking.progress_logs(report)}
        integration.on_log(args, state, control, logs=logs)
    integration.on_train_end(args, state, control)

    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("grpo-test")
    (tracked,) = client.search_runs([experiment.experiment_id])
    assert tracked.info.run_name == "tiny-1" and tracked.info.status == "FINISHED"
    assert tracked.data.tags["grpo.dev/run"] == "tiny" and tracked.data.tags["grpo.dev/namespace"] == "ml"
    parameters = tracked.data.params
    assert parameters["grporun.training.learningRate"] == "3e-06"
    assert parameters["grporun.tracking.mlflow.experiment"] == "grpo-test"
    assert parameters["learning_rate"] == "3e-06"  # transformers' own: the trainer arguments
    loss = client.get_metric_history(tracked.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    trained = client.get_metric_history(tracked.info.run_id, "progress/groups_trained")
    assert sorted((m.step, m.value) for m in trained) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    dropped = client.get_metric_history(tracked.info.run_id, "progress/groups_dropped/no_signal")
    assert [m.value for m in sorted(dropped, key=lambda m: m.step)] == [1.0, 2.0, 3.0]
    # What the learner's progress report carries to status.tracking: the run, and its page on the server.
    assert callbacks[1].tracked_runs() == [c.TrackedRunReport(tracker="mlflow", run_id=tracked.info.run_id, uri=(
        f"{mlflow_server.uri}/#/experiments/{experiment.experiment_id}/runs/{tracked.info.run_id}"))]


@pytest.mark.slow
def test_wandb_offline_writes_the_run_under_the_checkpoint_directory_without_network(tmp_path, monkeypatch):
    """transformers' W&B integration as the learner configures it (offline), with our parameters callback: the run's
    files land in WANDB_DIR, holding the spec and the step metrics."""
    from transformers import TrainerControl, TrainerState
    from transformers.integrations import WandbCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig

    run = config(tmp_path, learner={"device": "cpu"}, tracking={"wandb": {"project": "grpo", "mode": "offline"}})
    environ: dict[str, str] = {}
    trackers = tracking.configure(run, environ)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = AsyncGRPOConfig(**trainer_arguments(run))
    integration = WandbCallback()
    callbacks = [integration, tracking.parameters_callback(run, trackers, [integration])]
    state, control = TrainerState(), TrainerControl()
    for callback in callbacks:
        callback.on_train_begin(args, state, control, model=None)
    import wandb

    assert wandb.run is not None and wandb.run.config["grporun.runName"] == "tiny"
    for step in (1, 2):
        state.global_step = step
        integration.on_log(args, state, control, logs={"loss": 0.5 / step, "progress/groups_trained": float(step)})
    integration.on_train_end(args, state, control)
    wandb.finish()

    (offline_run,) = (tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*")
    (records,) = offline_run.glob("run-*.wandb")
    # The run's records (protobuf, what `wandb sync` uploads later) carry the spec and both steps' metrics by name.
    data = records.read_bytes()
    assert b"grporun.training.learningRate" in data
    assert b"train/loss" in data and b"train/progress/groups_trained" in data
