"""Experiment tracking: `spec.tracking` to transformers' `report_to` integrations (MLflow, TensorBoard, Weights &
Biases), the run's spec as the tracker's parameters, and our progress numbers beside TRL's curves.

Torch-free until a callback runs. TRL reaches the trackers through transformers' integrations, each configured by the
env it reads (`configure` sets it) and each logging the dict `Trainer.log` receives; `progress_logs` is what the
learner adds to that dict, so our progress numbers sit beside TRL's loss and entropy on the same steps. The trackers
are optional installs (the `tracking` extra): a run asking for one this image lacks ends at start with a config error
naming `spec.tracking.<name>`.

A learner that starts again (a restart, a resume) continues its trackers' runs rather than opening new ones: rank 0
records their ids beside the checkpoints when they start (`RUNS_FILE`), and `configure` hands them back to the
integrations (`MLFLOW_RUN_ID`; `WANDB_RUN_ID` with `WANDB_RESUME=allow`). TensorBoard appends to its directory anyway.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..contract.config import RunConfig
from ..contract.pod_env import MLFLOW_CREDENTIAL_ENV, WANDB_API_KEY_ENV
from ..contract.report import ProgressReport, TrackedRunReport

logger = logging.getLogger(__name__)

#: Prefix of the progress numbers in a tracker (TRL's own keys are `loss`, `entropy`, `completions/...`).
PROGRESS_PREFIX = "progress/"
#: Prefix of the run's spec among a tracker's parameters (transformers logs TrainingArguments unprefixed).
PARAMETER_PREFIX = "grporun."
#: tracker (`report_to` name) -> the module its integration imports; `tracking` extra in pyproject.toml.
TRACKER_MODULES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
#: MLflow refuses a parameter value longer than this.
MLFLOW_PARAM_MAX_CHARS = 6000
MLFLOW_PARAMS_PER_BATCH = 100
#: The trackers' runs a learner that starts again continues, beside the checkpoints (which outlive the pod).
RUNS_FILE = "tracking-runs.json"
#: More than a runs file ever holds: a bigger one is not read.
RUNS_FILE_MAX_BYTES = 64 * 1024


class TrackingConfigError(ValueError):
    """A tracker the run asks for that cannot work here; one line naming `spec.tracking.<name>`."""


def tracking_root(config: RunConfig) -> str:
    """Where the trackers' files go: the checkpoint directory (a volume that outlives the pod) when the run has one,
    else the output directory."""
    return config.checkpoint.directory or config.output_dir


def tracking_directory(config: RunConfig, tracker: str) -> str:
    """Where a file-writing tracker writes."""
    return os.path.join(tracking_root(config), tracker)


def runs_file(config: RunConfig) -> str:
    return os.path.join(tracking_root(config), RUNS_FILE)


class _RecordedRun(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # The characters MLflow and W&B accept in a run id, which also keeps the id harmless in a URL or a log line.
    run_id: str = Field(alias="runId", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


class RecordedMlflowRun(_RecordedRun):
    tracking_uri: str = Field(alias="trackingUri", min_length=1)
    experiment: str = Field(min_length=1)


class RecordedWandbRun(_RecordedRun):
    project: str = Field(min_length=1)
    entity: str | None = None


class RecordedRuns(BaseModel):
    """`RUNS_FILE`: the trackers' runs of one GRPORun (`run`: namespace/name), as rank 0 saw them start."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    run: str
    mlflow: RecordedMlflowRun | None = None
    wandb: RecordedWandbRun | None = None


def _run_key(config: RunConfig) -> str:
    return f"{config.namespace}/{config.run_name}"


def read_recorded_runs(config: RunConfig) -> RecordedRuns | None:
    """The runs the last start of this learner recorded; None, with a warning, for a file that cannot be trusted
    (torn, tampered with, another run's): the trackers then start new runs."""
    path = runs_file(config)
    try:
        with open(path, "rb") as file:
            data = file.read(RUNS_FILE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning(f"tracking: cannot read {path} ({error}): the trackers start new runs")
        return None
    if len(data) > RUNS_FILE_MAX_BYTES:
        logger.warning(f"tracking: {path} is over {RUNS_FILE_MAX_BYTES} bytes: the trackers start new runs")
        return None
    try:
        recorded = RecordedRuns.model_validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        logger.warning(f"tracking: {path} is not a runs file ({where}: {first['msg']}): the trackers start new runs")
        return None
    if recorded.run != _run_key(config):
        logger.warning(f"tracking: {path} records the runs of {recorded.run!r}, not of {_run_key(config)!r}: the "
                       "trackers start new runs")
        return None
    return recorded


def record_runs(config: RunConfig, runs: list[TrackedRunReport]) -> None:
    """Save the runs the trackers started, for the next start of this learner to continue (rank 0 only)."""
    ids = {run.tracker: run.run_id for run in runs}
    tracking = config.tracking
    recorded = RecordedRuns(run=_run_key(config))
    if tracking.mlflow is not None and "mlflow" in ids:
        recorded.mlflow = RecordedMlflowRun(runId=ids["mlflow"], trackingUri=tracking.mlflow.tracking_uri,
                                            experiment=mlflow_experiment(config))
    if tracking.wandb is not None and "wandb" in ids:
        recorded.wandb = RecordedWandbRun(runId=ids["wandb"], project=tracking.wandb.project,
                                          entity=tracking.wandb.entity)
    if recorded.mlflow is None and recorded.wandb is None:
        return
    from .checkpoints import write_json_atomically

    path = runs_file(config)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomically(path, recorded.model_dump(mode="json", by_alias=True, exclude_none=True))
    except OSError as error:
        logger.warning(f"tracking: cannot write {path} ({error}): a restarted learner will start new runs")


def continued_mlflow_run(config: RunConfig, recorded: RecordedMlflowRun) -> str | None:
    """The recorded MLflow run's id when the tracking server still has it, active, in the run's experiment; else
    None with a warning (MLflow refuses to continue such a run, and the learner would fail each start)."""
    mlflow = config.tracking.mlflow
    experiment = mlflow_experiment(config)
    if recorded.tracking_uri != mlflow.tracking_uri or recorded.experiment != experiment:
        logger.warning(f"tracking: MLflow run {recorded.run_id} was on {recorded.tracking_uri!r} in experiment "
                       f"{recorded.experiment!r}; spec.tracking.mlflow now names another: starting a new run")
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow.tracking_uri)
    try:
        run = client.get_run(recorded.run_id)
        run_experiment = client.get_experiment(run.info.experiment_id)
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            logger.warning(f"tracking: MLflow run {recorded.run_id} is not on {mlflow.tracking_uri} any more: "
                           "starting a new run")
            return None
        # The tracking server cannot say now; starting the run will meet the same trouble and report it.
        logger.warning(f"tracking: cannot check MLflow run {recorded.run_id} ({str(error).splitlines()[0]}): "
                       "continuing it")
        return recorded.run_id
    if run.info.lifecycle_stage != "active" or run_experiment.name != experiment:
        logger.warning(f"tracking: MLflow run {recorded.run_id} was deleted or moved out of experiment "
                       f"{experiment!r}: starting a new run")
        return None
    return recorded.run_id


def continued_runs_env(config: RunConfig) -> dict[str, str]:
    """The env that makes the trackers' integrations continue the runs this learner's last start recorded."""
    recorded = read_recorded_runs(config)
    if recorded is None:
        return {}
    env: dict[str, str] = {}
    tracking = config.tracking
    if tracking.mlflow is not None and recorded.mlflow is not None and (
            run_id := continued_mlflow_run(config, recorded.mlflow)):
        env["MLFLOW_RUN_ID"] = run_id
        # The run holds transformers' TrainingArguments parameters from its first start; logging them again would
        # have MLflow refuse each one whose value changed (a moved rollout server) with an error in the log.
        env["MLFLOW_MAX_LOG_PARAMS"] = "0"
    wandb = tracking.wandb
    if wandb is not None and recorded.wandb is not None:
        if (recorded.wandb.project, recorded.wandb.entity) == (wandb.project, wandb.entity):
            # allow: a run the W&B server does not know (an offline run never synced) starts under the same id.
            env.update(WANDB_RUN_ID=recorded.wandb.run_id, WANDB_RESUME="allow")
        else:
            logger.warning(f"tracking: W&B run {recorded.wandb.run_id} was in another project or entity than "
                           "spec.tracking.wandb names now: starting a new run")
    for tracker, variable in (("MLflow", "MLFLOW_RUN_ID"), ("W&B", "WANDB_RUN_ID")):
        if variable in env:
            logger.info(f"tracking: continuing the {tracker} run {env[variable]} of this learner's last start")
    return env


def mlflow_experiment(config: RunConfig) -> str:
    """The MLflow experiment the run's runs go to: the spec's, else the run's namespace."""
    return config.tracking.mlflow.experiment or config.namespace


def tracker_env(config: RunConfig) -> dict[str, str]:
    """The env transformers' integrations read for the trackers the run asks for (credentials excepted: the pod's
    env carries those, from Secrets)."""
    tracking = config.tracking
    env: dict[str, str] = {}
    if tracking.mlflow is not None:
        env["MLFLOW_TRACKING_URI"] = tracking.mlflow.tracking_uri
        env["MLFLOW_EXPERIMENT_NAME"] = mlflow_experiment(config)
        env["MLFLOW_TAGS"] = json.dumps({"grpo.dev/namespace": config.namespace, "grpo.dev/run": config.run_name})
    if tracking.tensorboard is not None:
        env["TENSORBOARD_LOGGING_DIR"] = tracking_directory(config, "tensorboard")
    if tracking.wandb is not None:
        env["WANDB_PROJECT"] = tracking.wandb.project
        env["WANDB_MODE"] = tracking.wandb.mode
        env["WANDB_DIR"] = tracking_directory(config, "wandb")
        if tracking.wandb.entity:
            env["WANDB_ENTITY"] = tracking.wandb.entity
    return env


def check_trackers(config: RunConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Raise TrackingConfigError when a tracker's package is not installed or its Secret gave no credential."""
    environ = os.environ if environ is None else environ
    tracking = config.tracking
    mlflow = tracking.mlflow
    credentials_given = any(environ.get(variable) for variable in MLFLOW_CREDENTIAL_ENV.values())
    if mlflow is not None and mlflow.credentials_secret and not credentials_given:
        raise TrackingConfigError(
            f"spec.tracking.mlflow.credentialsSecret: Secret {mlflow.credentials_secret!r} is missing or has "
            f"none of the keys {', '.join(MLFLOW_CREDENTIAL_ENV)}")
    wandb = tracking.wandb
    if wandb is not None and wandb.mode == "online" and not environ.get(WANDB_API_KEY_ENV):
        ref = wandb.api_key_secret
        where = f"Secret {ref.name!r} key {ref.key!r}" if ref else "no Secret"
        raise TrackingConfigError(f"spec.tracking.wandb.apiKeySecret: {where} gave no API key "
                                  "(the Secret or its key is missing)")
    for tracker in tracking.trackers:
        if importlib.util.find_spec(TRACKER_MODULES[tracker]) is None:
            raise TrackingConfigError(
                f"spec.tracking.{tracker}: this learner image has no {TRACKER_MODULES[tracker]} package "
                "(install grpo-operator's `tracking` extra in the image)")


def configure(config: RunConfig, environ: MutableMapping[str, str] | None = None, *,
              main_process: bool = True) -> list[str]:
    """Check the trackers, set the env their integrations read (continuing the runs this learner's last start
    recorded), make their directories; the `report_to` list. Only the main process (rank 0) logs to the trackers,
    so only it asks the tracking server whether the recorded run can be continued: one request per start, not one per
    rank."""
    environ = os.environ if environ is None else environ
    check_trackers(config, environ)
    env = tracker_env(config)
    if config.tracking.trackers and main_process:
        env.update(continued_runs_env(config))
    environ.update(env)
    for variable in ("TENSORBOARD_LOGGING_DIR", "WANDB_DIR"):
        if variable in env:
            os.makedirs(env[variable], exist_ok=True)
    return config.tracking.trackers


def progress_logs(report: ProgressReport) -> dict[str, float]:
    """The progress numbers a tracker plots per logged step: groups, drops by reason, stall streak, rollout wait."""
    logs = {
        f"{PROGRESS_PREFIX}groups_consumed": float(report.groups_consumed),
        f"{PROGRESS_PREFIX}groups_trained": float(report.groups_trained),
        f"{PROGRESS_PREFIX}groups_total": float(report.groups_total),
        f"{PROGRESS_PREFIX}epochs_done": float(report.epochs_done),
        f"{PROGRESS_PREFIX}stall_streak": float(report.stall_streak),
        f"{PROGRESS_PREFIX}rollout_wait_s": float(report.rollout_wait_seconds),
        f"{PROGRESS_PREFIX}weight_version": float(report.weight_version),
    }
    for reason, count in sorted(report.dropped.items()):
        logs[f"{PROGRESS_PREFIX}groups_dropped/{reason}"] = float(count)
    episodes = report.episodes
    if episodes is not None:
        logs.update({
            f"{PROGRESS_PREFIX}episodes": float(episodes.episodes),
            f"{PROGRESS_PREFIX}tool_calls": float(episodes.tool_calls),
            f"{PROGRESS_PREFIX}tool_failures": float(episodes.tool_failures),
            f"{PROGRESS_PREFIX}environment_failures": float(sum(episodes.environment_failures.values())),
        })
        if episodes.episodes:
            logs[f"{PROGRESS_PREFIX}turns_per_episode"] = episodes.turns_per_episode
            logs[f"{PROGRESS_PREFIX}fork_fraction"] = episodes.fork_fraction
    return logs


def run_parameters(config: RunConfig) -> dict[str, str]:
    """The run's resolved config, flat (`grporun.training.learningRate`), as the trackers' parameters. It holds no
    credential: Secrets are named, never read, in the config."""

    def flatten(value: Any, prefix: str) -> Iterator[tuple[str, str]]:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                yield from flatten(item, f"{prefix}.{key}")
        else:
            yield prefix, value if isinstance(value, str) else json.dumps(value)

    return dict(flatten(config.model_dump(mode="json", by_alias=True), PARAMETER_PREFIX.rstrip(".")))


def log_run_parameters(config: RunConfig, trackers: list[str], tensorboard_writer: Any = None) -> None:
    """Log the run's spec to each tracker's run, which its integration has started (`on_train_begin`)."""
    parameters = run_parameters(config)
    if "mlflow" in trackers:
        import mlflow

        if (active := mlflow.active_run()) is not None:
            fitting = {k: v for k, v in parameters.items() if len(v) <= MLFLOW_PARAM_MAX_CHARS}
            for key in sorted(set(parameters) - set(fitting)):
                logger.warning(f"mlflow: parameter {key} is over {MLFLOW_PARAM_MAX_CHARS} characters: not logged")
            # A continued run holds the parameters of its first start; MLflow refuses to change a parameter's value.
            logged = mlflow.get_run(active.info.run_id).data.params
            changed = sorted(key for key, value in fitting.items() if key in logged and logged[key] != value)
            if changed:
                more = " ..." if len(changed) > 5 else ""
                logger.warning(f"mlflow: run {active.info.run_id} keeps its first value of {len(changed)} "
                               f"parameter(s) changed since: {', '.join(changed[:5])}{more}")
            items = sorted((key, value) for key, value in fitting.items() if key not in logged)
            for start in range(0, len(items), MLFLOW_PARAMS_PER_BATCH):
                mlflow.log_params(dict(items[start:start + MLFLOW_PARAMS_PER_BATCH]))
    if "tensorboard" in trackers and tensorboard_writer is not None:
        tensorboard_writer.add_text("grporun/spec", "\n".join(f"    {k}: {v}" for k, v in sorted(parameters.items())))
        tensorboard_writer.flush()
    if "wandb" in trackers:
        import wandb

        if wandb.run is not None:
            wandb.config.update(parameters, allow_val_change=True)


def mlflow_run_uri(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where a user opens an MLflow run: its page in the tracking server's UI; for a tracking URI that is no web
    server (a file store, a database), the URI and the run id."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{tracking_uri}#{run_id}"


def _tracked_run(tracker: str, run_id: str, uri: str) -> TrackedRunReport | None:
    try:
        return TrackedRunReport(tracker=tracker, run_id=run_id, uri=uri)
    except ValidationError as error:
        logger.warning(f"tracking: {tracker} run {run_id[:128]!r} at {uri[:256]!r} is not reported "
                       f"({error.errors()[0]['msg']})")
        return None


def tracked_runs(trackers: list[str], run_name: str = "", tensorboard_writer: Any = None) -> list[TrackedRunReport]:
    """The runs the trackers' integrations started: MLflow's (its page on the tracking server), TensorBoard's (the
    run name, and the event files' directory to point `tensorboard --logdir` at), W&B's (its page; offline, the
    run's directory that `wandb sync` uploads)."""
    runs = []
    if "mlflow" in trackers:
        import mlflow

        if (active := mlflow.active_run()) is not None:
            info = active.info
            runs.append(_tracked_run("mlflow", info.run_id, mlflow_run_uri(
                mlflow.get_tracking_uri(), info.experiment_id, info.run_id)))
    if "tensorboard" in trackers and tensorboard_writer is not None:
        runs.append(_tracked_run("tensorboard", run_name, os.path.abspath(tensorboard_writer.get_logdir())))
    if "wandb" in trackers:
        import wandb

        if (run := wandb.run) is not None:
            runs.append(_tracked_run("wandb", run.id, run.sync_dir if run.offline else (run.url or "")))
    return [run for run in runs if run is not None]


def parameters_callback(config: RunConfig, trackers: list[str], callbacks: list):
    """A TrainerCallback that logs the run's spec once the trackers' runs have started, keeps their identity (its
    `tracked_runs()`, for the progress report) and records it for the next start to continue (`RUNS_FILE`). Added
    after transformers' integrations (`callbacks` is the trainer's list), so their `on_train_begin` has run when
    this one does."""
    from transformers import TrainerCallback

    class RunParameters(TrainerCallback):
        def __init__(self):
            self.runs: list[TrackedRunReport] = []

        def tracked_runs(self) -> list[TrackedRunReport]:
            return list(self.runs)

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            writer = next((getattr(cb, "tb_writer", None) for cb in callbacks
                           if type(cb).__name__ == "TensorBoardCallback"), None)
            log_run_parameters(config, trackers, writer)
            self.runs = tracked_runs(trackers, args.run_name or config.run_name, writer)
            record_runs(config, self.runs)

    return RunParameters()
