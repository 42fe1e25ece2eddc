"""Experiment tracking: spec.tracking to report_to and the trackers' env, one-line config errors for a tracker that
cannot work, our progress numbers and the run's spec as parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, LearnerPhase
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.report import ProgressReport, TrackedRunReport, TrackerLossReport, parse_progress
from grpo_trainer.learner import tracking
from grpo_trainer.learner.main import trainer_arguments
from grpo_trainer.learner.tracking import base, mlflow_tracker, runs_file
from grpo_trainer.learner.tracking.registry import TRACKERS
from grpo_trainer.rollout.metrics_batch import is_invented_tool_metric


def config(tmp_path=None, **fields) -> RunConfig:
    base = {"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}], "runName": "tiny",
            "namespace": "ml"}
    if tmp_path is not None:
        base.update(checkpoint={"directory": str(tmp_path / "ckpt")}, outputDir=str(tmp_path / "out"),
                    terminationMessagePath=str(tmp_path / "termination-log"))
    return RunConfig.model_validate({**base, **fields})


MLFLOW = {"mlflow": {"trackingUri": "http://127.0.0.1:5000", "experiment": "grpo", "runName": "tiny-1"}}


@pytest.fixture(scope="module")
def answering_server():
    """A URI where an HTTP server answers every GET (what the trackers' start-up probe asks of a tracking server)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_run_without_tracking_reports_to_nothing():
    assert trainer_arguments(config())["report_to"] == []
    assert tracking.configure(config(), environ={}) == tracking.Tracking([], [])


def test_each_tracker_maps_to_report_to_and_the_env_its_integration_reads(tmp_path, answering_server):
    wandb = {"wandb": {"project": "p", "mode": "offline", "entity": "team"}}
    run = config(tmp_path, tracking={**MLFLOW, "tensorboard": {}, **wandb})
    arguments = trainer_arguments(run)
    assert arguments["report_to"] == ["mlflow", "tensorboard", "wandb"]
    assert arguments["run_name"] == "tiny-1"  # the MLflow run name, when the spec gives one
    env = tracking.tracker_env(run)
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000" and env["MLFLOW_EXPERIMENT_NAME"] == "grpo"
    # MLflow's client gives up on a server that stops answering within about a minute, not 20 minutes.
    assert (env["MLFLOW_HTTP_REQUEST_TIMEOUT"], env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) == ("20", "2")
    assert env["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "ckpt" / "tensorboard")  # on the checkpoint volume
    assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(tmp_path / "ckpt" / "wandb")
    assert env["WANDB_PROJECT"] == "p" and env["WANDB_ENTITY"] == "team"
    # The test tools hold MLflow's client and TensorBoard (W&B is the image's `tracking` extra alone).
    environ: dict[str, str] = {}
    answering = {"mlflow": {**MLFLOW["mlflow"], "trackingUri": answering_server}}
    assert tracking.configure(config(tmp_path, tracking={**answering, "tensorboard": {}}), environ).trackers == [
        "mlflow", "tensorboard"]
    assert environ["TENSORBOARD_LOGGING_DIR"] == env["TENSORBOARD_LOGGING_DIR"]
    assert (tmp_path / "ckpt" / "tensorboard").is_dir()
    # Without an experiment the run's namespace groups its runs.
    assert tracking.tracker_env(config(tracking={"mlflow": {"trackingUri": "u"}}))["MLFLOW_EXPERIMENT_NAME"] == "ml"


def test_every_tracker_the_spec_names_has_its_tracker_registered():
    """spec.tracking's fields, transformers' report_to names and the registry's keys are one list, in one order."""
    from grpo_trainer.contract.config import TrackingConfig

    assert list(TRACKERS) == [name for name in TrackingConfig.model_fields if name != "on_unavailable"]
    for name, tracker in TRACKERS.items():
        assert tracker.name == name and isinstance(tracker.package, str)


def test_missing_credentials_are_one_line_naming_the_field():
    run = config(tracking={"mlflow": {"trackingUri": "u", "credentialsSecret": "mlflow-login"}})
    with pytest.raises(base.TrackingConfigError, match=r"^spec\.tracking\.mlflow\.credentialsSecret: Secret "
                                                           r"'mlflow-login' is missing"):
        tracking.check_trackers(run, environ={})
    tracking.check_trackers(run, environ={"MLFLOW_TRACKING_TOKEN": "t"})
    online = config(tracking={"wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "apiKey"}}})
    with pytest.raises(base.TrackingConfigError, match=r"^spec\.tracking\.wandb\.apiKeySecret: Secret 'wandb'"):
        tracking.check_trackers(online, environ={})


def test_a_learner_asked_for_a_tracker_it_lacks_exits_78_naming_the_field(tmp_path, monkeypatch):
    from grpo_trainer.learner.main import main

    monkeypatch.setattr(TRACKERS["tensorboard"], "package", "grpo_no_such_tracker_package")
    run = config(tmp_path, tracking={"tensorboard": {}}, learner={"device": "cpu"})
    assert main(run) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED
    assert report.message == ("spec.tracking.tensorboard: this learner image has no grpo_no_such_tracker_package "
                              "package (install grpo-operator's `tracking` extra in the image)")


def test_a_tensorboard_directory_that_cannot_be_made_ends_the_learner_as_invalid_config_naming_it(tmp_path):
    from grpo_trainer.learner.main import main

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tensorboard").write_text("a file where the event files' folder goes")
    run = config(tmp_path, tracking={"tensorboard": {}}, learner={"device": "cpu"})
    assert main(run) == EXIT_INVALID_CONFIG  # was exit 1, FileExistsError
    report = parse_progress((tmp_path / "termination-log").read_text())
    directory = tmp_path / "ckpt" / "tensorboard"
    assert report.message == f"spec.tracking.tensorboard: cannot make its directory {directory}: File exists"


def test_an_mlflow_server_nothing_answers_at_start_ends_the_learner_within_seconds_naming_the_uri(tmp_path):
    # MLflow's client retried for about 5 minutes inside TRL's loop, then the learner exited 1: a crash, retried.
    from grpo_trainer.learner.main import main
    from tests.support.ports import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = config(tmp_path, tracking={"mlflow": {"trackingUri": uri}}, learner={"device": "cpu"})
    assert main(run) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message == (f"spec.tracking.mlflow.trackingUri: nothing answers at {uri} within 5s "
                              "(ConnectionError) (spec.tracking.onUnavailable: continue trains without it)")


def test_with_on_unavailable_continue_a_tracker_that_does_not_answer_is_left_out_and_reported(tmp_path, caplog):
    from tests.support.ports import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    run = config(tmp_path, tracking={"mlflow": {"trackingUri": uri}, "tensorboard": {}, "onUnavailable": "continue"})
    with caplog.at_level("WARNING", logger=tracking.__name__):
        configured = tracking.configure(run, environ={})
    assert configured.trackers == ["tensorboard"]  # report_to: MLflow's integration would retry for minutes
    line = f"mlflow: spec.tracking.mlflow.trackingUri: nothing answers at {uri} within 5s (ConnectionError)"
    assert configured.unavailable == [line]
    assert "training without mlflow (spec.tracking.onUnavailable: continue)" in caplog.text
    # What the learner's progress report carries to the operator (status condition TrackingDegraded).
    assert tracking.parameters_callback(run, configured, []).degraded() == [line]
    assert config(tracking={"tensorboard": {}}).tracking.on_unavailable == "fail"  # the default
    far = f"http://{'m' * 600}.example:5000"  # a tracking URI has no bound; a report line has
    lines = tracking.parameters_callback(run, tracking.Tracking(["tensorboard"], [f"mlflow: nothing answers at {far}"]),
                                         []).degraded()
    ProgressReport(tracking_degraded=lines)  # the report takes it


def test_progress_numbers_for_the_trackers():
    report = ProgressReport(groups_total=9, groups_consumed=5, groups_trained=3, stall_streak=2,
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


WANDB_OFFLINE = {"wandb": {"project": "grpo", "mode": "offline"}}


def test_a_learner_starting_again_continues_the_recorded_wandb_run(tmp_path):
    run = config(tmp_path, tracking=WANDB_OFFLINE)
    tracking.record_runs(run, [TrackedRunReport(tracker="wandb", run_id="a1b2c3d4", uri="/ckpt/wandb/run")])
    assert tracking.continued_runs_env(run) == {"WANDB_RUN_ID": "a1b2c3d4", "WANDB_RESUME": "allow"}
    # Another project (the spec changed between starts) is another run.
    moved = config(tmp_path, tracking={"wandb": {"project": "other", "mode": "offline"}})
    assert tracking.continued_runs_env(moved) == {}


def test_only_the_main_process_asks_to_continue_the_recorded_runs(tmp_path, monkeypatch):
    """Every rank configures its trackers, but only rank 0 logs to them: the other ranks neither ask the tracking
    server about the recorded run nor carry its id."""
    run = config(tmp_path, tracking={**MLFLOW, **WANDB_OFFLINE})
    tracking.record_runs(run, [TrackedRunReport(tracker="wandb", run_id="a1b2c3d4", uri="/ckpt/wandb/run"),
                               TrackedRunReport(tracker="mlflow", run_id="0f1e2d3c", uri="http://mlflow/run")])
    asked = []
    monkeypatch.setattr(mlflow_tracker, "continued_mlflow_run", lambda config, recorded: asked.append(recorded.run_id)
                        or recorded.run_id)
    other_rank: dict[str, str] = {}
    assert tracking.configure(run, other_rank, main_process=False).trackers == ["mlflow", "wandb"]
    assert asked == [] and "MLFLOW_RUN_ID" not in other_rank and "WANDB_RUN_ID" not in other_rank
    assert other_rank["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"  # the integration's own env all the same
    rank_0: dict[str, str] = {}
    monkeypatch.setattr(mlflow_tracker.MlflowTracker, "probe", lambda self, config: None)  # it answers
    tracking.configure(run, rank_0)
    assert asked == ["0f1e2d3c"]
    assert (rank_0["MLFLOW_RUN_ID"], rank_0["WANDB_RUN_ID"]) == ("0f1e2d3c", "a1b2c3d4")


@pytest.mark.parametrize("content, why", [
    (b"{not json", "not a runs file"),
    (b'{"run": "ml/tiny", "wandb": {"runId": "../../etc", "project": "grpo"}}', "wandb.runId"),
    (b'{"run": "ml/tiny", "wandb": {"runId": 7, "project": "grpo"}}', "wandb.runId"),
    (b'{"run": "ml/other-run", "wandb": {"runId": "a1b2c3d4", "project": "grpo"}}', "'ml/other-run', not of"),
    (b"[]", "not a runs file"),
    (b" " * (runs_file.RUNS_FILE_MAX_BYTES + 1), "bytes"),
])
def test_a_runs_file_that_cannot_be_trusted_starts_new_runs_with_a_warning(tmp_path, caplog, content, why):
    run = config(tmp_path, tracking=WANDB_OFFLINE)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / runs_file.RUNS_FILE).write_bytes(content)
    environ: dict[str, str] = {}
    with caplog.at_level("WARNING", logger=tracking.__name__):
        assert tracking.configure(run, environ).trackers == ["wandb"]
    assert "WANDB_RUN_ID" not in environ and "WANDB_RESUME" not in environ
    assert why in caplog.text and "the trackers start new runs" in caplog.text


def test_a_runs_report_too_long_for_the_status_is_left_out_with_a_warning(caplog):
    writer = type("Writer", (), {"get_logdir": lambda self: "/" + "d" * 2000})()
    with caplog.at_level("WARNING", logger=tracking.__name__):
        assert tracking.tracked_runs(["tensorboard"], "tiny", writer) == []
    assert "tensorboard run 'tiny'" in caplog.text


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from tests.support.servers.mlflow_server import MISSING, MLFLOW, running_mlflow_server

    if not MLFLOW.exists():
        pytest.skip(MISSING)
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        server.wait_ready()
        yield server


@pytest.mark.slow
def test_a_refusal_by_the_mlflow_server_is_told_from_a_server_that_is_not_there(mlflow_server, monkeypatch):
    """The guard keeps a tracker whose server refused one call's data (a 400) and drops one it cannot reach."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the closed port answers at once, every time
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tests.support.ports import LOOPBACK, free_port

    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("refusals")).info.run_id
    client.log_param(run_id, "learning_rate", "3e-06")
    with pytest.raises(MlflowException) as refused:
        client.log_param(run_id, "learning_rate", "1e-05")  # MLflow keeps a parameter's first value
    assert mlflow_tracker.refused_by_server(refused.value)
    # A step's metrics with a per-tool metric of a tool name the policy made up: the whole batch refused, as it
    # reached MLflow before the learner took such names out.
    step = {"loss": 0.5, "tools/guess/call_total": 2.0, "tools//call_total": 1.0}
    with pytest.raises(MlflowException) as invented:
        client.log_batch(run_id, metrics=[Metric(key, value, 0, 1) for key, value in step.items()])
    assert mlflow_tracker.refused_by_server(invented.value)
    step = {key: value for key, value in step.items() if not is_invented_tool_metric(key)}
    client.log_batch(run_id, metrics=[Metric(key, value, 0, 1) for key, value in step.items()])
    assert set(client.get_run(run_id).data.metrics) == {"loss", "tools/guess/call_total"}
    with pytest.raises(MlflowException) as unreachable:
        MlflowClient(f"http://{LOOPBACK}:{free_port()}").get_run(run_id)
    assert not mlflow_tracker.refused_by_server(unreachable.value)


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
        report = ProgressReport(groups_total=9, groups_consumed=2 * step, groups_trained=step, stall_streak=0,
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
    assert callbacks[1].tracked_runs() == [TrackedRunReport(tracker="mlflow", run_id=tracked.info.run_id, uri=(
        f"{mlflow_server.uri}/#/experiments/{experiment.experiment_id}/runs/{tracked.info.run_id}"))]


class TrackedLearner:
    """A learner's trackers as learner_main wires them (transformers' integration for each tracker from the env
    `configure` sets, our parameters callback after them), fed TRL-shaped logs: what a learner start does to its
    trackers, without the model."""

    def __init__(self, run: RunConfig, setenv):
        from transformers import TrainerControl, TrainerState
        from transformers.integrations import INTEGRATION_TO_CALLBACK
        from trl.experimental.async_grpo import AsyncGRPOConfig

        environ: dict[str, str] = {}
        trackers = tracking.configure(run, environ)
        for name, value in environ.items():
            setenv(name, value)
        self.environ = environ
        self.args = AsyncGRPOConfig(**trainer_arguments(run))
        self.integrations = [INTEGRATION_TO_CALLBACK[tracker]() for tracker in trackers.trackers]
        self.parameters = tracking.parameters_callback(run, trackers, self.integrations)
        self.state, self.control = TrainerState(), TrainerControl()
        for callback in (*self.integrations, self.parameters):
            callback.on_train_begin(self.args, self.state, self.control, model=None)

    def log_steps(self, steps) -> None:
        for step in steps:
            self.state.global_step = step
            for integration in self.integrations:
                integration.on_log(self.args, self.state, self.control, logs={"loss": 0.25 * step})

    def settle(self) -> None:
        """Wait for the steps logged so far to reach the trackers (each integration runs on its own thread)."""
        assert all(integration.settle(60) for integration in self.integrations)

    def end(self) -> None:
        for integration in self.integrations:
            integration.on_train_end(self.args, self.state, self.control)


#: A learner process killed after logging steps 1-3: its MLflow run stays RUNNING, as a kill leaves it.
KILLED_LEARNER = """
import os, signal, sys
from grpo_trainer.contract.config import RunConfig
from tests.trainer.learner.test_tracking import TrackedLearner
learner = TrackedLearner(RunConfig.model_validate_json(sys.argv[1]), os.environ.__setitem__)
learner.log_steps((1, 2, 3))
learner.settle()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_restarted_learner_continues_its_mlflow_run_killed_or_finished(mlflow_server, tmp_path, monkeypatch,
                                                                         caplog, capfd):
    """One MLflow run across three starts of a learner on the same checkpoint directory: killed after steps 1-3,
    then restarted (steps 4-5, ending), then resumed once more (step 6), on the real tracking server."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.support.paths import REPO

    mlflow = {"mlflow": {"trackingUri": mlflow_server.uri, "experiment": "grpo-continued"}}
    run = config(tmp_path, learner={"device": "cpu"}, tracking=mlflow)
    killed = subprocess.run([sys.executable, "-c", KILLED_LEARNER, run.model_dump_json(by_alias=True)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("grpo-continued")
    (first,) = client.search_runs([experiment.experiment_id])
    assert first.info.status == "RUNNING"  # nobody ended it

    # The rollout servers moved meanwhile: a changed parameter keeps its first value, and does not stop the start.
    moved = config(tmp_path, learner={"device": "cpu"}, tracking=mlflow, rollout={"urls": ["http://rollout-b:8000"]})
    with caplog.at_level("WARNING"):
        restarted = TrackedLearner(moved, monkeypatch.setenv)
    assert restarted.environ["MLFLOW_RUN_ID"] == first.info.run_id
    assert "keeps its first value of" in caplog.text and "grporun.rollout.urls" in caplog.text
    restarted.log_steps((4, 5))
    restarted.end()
    resumed = TrackedLearner(run, monkeypatch.setenv)
    resumed.log_steps((6,))
    resumed.end()

    assert "Changing param values is not allowed" not in capfd.readouterr().err  # MLflow's, logging params again
    (tracked,) = client.search_runs([experiment.experiment_id])
    assert tracked.info.run_id == first.info.run_id and tracked.info.status == "FINISHED"
    assert tracked.data.params["vllm_server_base_url"] == "http://127.0.0.1:8000"  # the first start's
    loss = client.get_metric_history(tracked.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == [(step, 0.25 * step) for step in range(1, 7)]
    assert tracked.data.params["grporun.rollout.urls"] == first.data.params["grporun.rollout.urls"]
    page = f"{mlflow_server.uri}/#/experiments/{experiment.experiment_id}/runs/{tracked.info.run_id}"
    expected = [TrackedRunReport(tracker="mlflow", run_id=tracked.info.run_id, uri=page)]
    assert restarted.parameters.tracked_runs() == resumed.parameters.tracked_runs() == expected


@pytest.mark.slow
def test_a_recorded_mlflow_run_the_server_no_longer_has_gives_way_to_a_new_run(mlflow_server, tmp_path, monkeypatch,
                                                                                caplog):
    """A run deleted on the tracking server, or one it never had (another server's, a database reset), cannot be
    continued: MLflow would refuse it at every start. The learner starts a new run, says so, and records it."""
    from mlflow.tracking import MlflowClient

    mlflow = {"mlflow": {"trackingUri": mlflow_server.uri, "experiment": "grpo-gone"}}
    run = config(tmp_path, learner={"device": "cpu"}, tracking=mlflow)
    recorded = base.RecordedMlflowRun(runId="0" * 32, trackingUri=mlflow_server.uri, experiment="grpo-gone")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / runs_file.RUNS_FILE).write_text(
        base.RecordedRuns(run="ml/tiny", mlflow=recorded).model_dump_json(by_alias=True))
    with caplog.at_level("WARNING", logger=tracking.__name__):
        unknown = TrackedLearner(run, monkeypatch.setenv)
    assert "MLFLOW_RUN_ID" not in unknown.environ
    assert f"MLflow run {'0' * 32} is not on {mlflow_server.uri} any more: starting a new run" in caplog.text
    unknown.log_steps((1,))
    unknown.end()
    (started,) = unknown.parameters.tracked_runs()
    new_run = started.run_id
    assert new_run != "0" * 32
    assert runs_file.read_recorded_runs(run).mlflow.run_id == new_run

    MlflowClient(mlflow_server.uri).delete_run(new_run)
    caplog.clear()
    with caplog.at_level("WARNING", logger=tracking.__name__):
        after_delete = TrackedLearner(run, monkeypatch.setenv)
    assert "MLFLOW_RUN_ID" not in after_delete.environ and "was deleted" in caplog.text
    after_delete.end()
    assert after_delete.parameters.tracked_runs()[0].run_id not in (new_run, "0" * 32)


@pytest.mark.slow
def test_wandb_offline_writes_the_run_under_the_checkpoint_directory_without_network(tmp_path, monkeypatch):
    """transformers' W&B integration as the learner configures it (offline), with our parameters callback: the run's
    files land in WANDB_DIR, holding the spec and the step metrics."""
    from transformers import TrainerControl, TrainerState
    from transformers.integrations import WandbCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig

    run = config(tmp_path, learner={"device": "cpu"}, tracking=WANDB_OFFLINE)
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
    # W&B's service process writes the run's records: it may still hold them after `finish` returns, until it ends
    # (as at the learner process's exit). Here the teardown ends it.
    wandb.teardown()

    (offline_run,) = (tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*")
    (records,) = offline_run.glob("run-*.wandb")
    # The run's records (protobuf, what `wandb sync` uploads later) carry the spec and both steps' metrics by name.
    data = records.read_bytes()
    assert b"grporun.training.learningRate" in data
    assert b"train/loss" in data and b"train/progress/groups_trained" in data
    # The run on the status: its id, and the offline run's directory (what `wandb sync` uploads).
    (first,) = callbacks[1].tracked_runs()
    assert offline_run.name.endswith(f"-{first.run_id}")
    assert first == TrackedRunReport(tracker="wandb", run_id=first.run_id, uri=str(offline_run))

    # A learner that starts again continues the same run, by its id. (A new process reads W&B's env afresh; here
    # the teardown above makes this one do so.)
    again = TrackedLearner(run, monkeypatch.setenv)
    assert again.environ["WANDB_RUN_ID"] == first.run_id and again.environ["WANDB_RESUME"] == "allow"
    assert wandb.run is not None and wandb.run.id == first.run_id
    again.log_steps((3,))
    again.end()
    (continued,) = again.parameters.tracked_runs()
    wandb.finish()
    assert continued.run_id == first.run_id and continued.uri != first.uri  # each start: its own offline directory
    assert (tmp_path / "ckpt" / "wandb" / "wandb" / Path(continued.uri).name).is_dir()


@pytest.mark.slow
def test_the_export_is_tagged_on_the_mlflow_run_and_a_server_that_does_not_answer_costs_a_bounded_wait(
        mlflow_server, tmp_path, monkeypatch, answering_server, caplog):
    from mlflow.tracking import MlflowClient

    from grpo_trainer.contract.report import ExportReport

    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("grpo-export-tags")).info.run_id
    exported = ExportReport(uri="s3://models/tiny", path="/models/tiny", step=8, bytes=100, sha256="a" * 64,
                            time=1700000000.0)
    tracked = ProgressReport(tracking=[TrackedRunReport(tracker="mlflow", run_id=run_id,
                                                        uri=f"{mlflow_server.uri}/#/runs/{run_id}")])
    tracking.record_export(config(tmp_path, tracking={"mlflow": {"trackingUri": mlflow_server.uri}}), tracked,
                           exported)
    tags = client.get_run(run_id).data.tags
    assert (tags[mlflow_tracker.EXPORT_URI_TAG], tags[mlflow_tracker.EXPORT_SHA256_TAG],
            tags[mlflow_tracker.EXPORT_STEP_TAG]) == ("s3://models/tiny", "a" * 64, "8")

    # MLflow lost during the run: its end is not waited on again.
    other = client.create_run(client.get_experiment_by_name("grpo-export-tags").experiment_id).info.run_id
    lost = ProgressReport(tracking=[TrackedRunReport(tracker="mlflow", run_id=other, uri=mlflow_server.uri)],
                          tracking_lost=[TrackerLossReport(tracker="mlflow", since=1700000000.0, reason="frozen")])
    tracking.record_export(config(tmp_path, tracking={"mlflow": {"trackingUri": mlflow_server.uri}}), lost, exported)
    assert mlflow_tracker.EXPORT_URI_TAG not in client.get_run(other).data.tags

    # A server that answers nothing MLflow understands: a warning, and the learner's end goes on.
    monkeypatch.setattr(tracking, "EXPORT_TAGS_TIMEOUT_S", 2.0)
    with caplog.at_level("WARNING", logger=tracking.__name__):
        tracking.record_export(config(tmp_path, tracking={"mlflow": {"trackingUri": answering_server}}), tracked,
                               exported)
    assert f"tracking: MLflow ({answering_server})" in caplog.text and run_id in caplog.text


@pytest.mark.slow
def test_a_tracking_server_frozen_mid_run_is_dropped_and_the_run_still_ends_at_its_bound(mlflow_server, tmp_path,
                                                                                         tiny_model_dir):
    """The real learner (TRL's trainer, a scripted rollout worker) reporting to a real MLflow server that stops
    answering at step 2 (SIGSTOP: connections are accepted and never answered, the worst a tracking server can do):
    the learner trains to the epoch bound and exits 0, its report names MLflow as lost since then, and the server has
    the steps logged before."""
    import os
    import signal

    from mlflow.tracking import MlflowClient

    from tests.trainer.learner.test_learner_runs import run as run_scenario

    try:
        (result,) = run_scenario(tiny_model_dir, tmp_path / "frozen", "--scenario", "third_no_signal",
                                 "--prompts", "9", "--mlflow", mlflow_server.uri, "--signal-tracker-at-step", "2",
                                 "--tracker-pgid", str(mlflow_server.process.pid), "--tracker-signal", "SIGSTOP")
    finally:
        os.killpg(mlflow_server.process.pid, signal.SIGCONT)
    progress = parse_progress(json.dumps(result["progress"]))
    assert progress.phase == LearnerPhase.SUCCEEDED and progress.groups_consumed == progress.groups_total == 9
    (lost,) = progress.tracking_lost
    assert lost.tracker == "mlflow" and mlflow_server.uri in lost.reason, lost
    assert result["tracker_signalled"] <= lost.since <= result["ended"], (result["tracker_signalled"], lost)
    print(f"the run ended {result['ended'] - result['tracker_signalled']:.1f}s after its tracking server froze; "
          f"MLflow dropped: {lost.reason}")
    # What reached the server before it froze is there (step 1 at least: step 2's log came after the freeze).
    client = MlflowClient(mlflow_server.uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name("frozen").experiment_id])
    assert 1 in {m.step for m in client.get_metric_history(tracked.info.run_id, "loss")}
    assert progress.tracking[0].run_id == tracked.info.run_id
