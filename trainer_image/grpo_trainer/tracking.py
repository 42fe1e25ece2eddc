"""Experiment tracking: `spec.tracking` to transformers' `report_to` integrations (MLflow, TensorBoard, Weights &
Biases), the run's spec as the tracker's parameters, and our progress numbers beside TRL's curves.

Torch-free until a callback runs. TRL reaches the trackers through transformers' integrations, each configured by the
env it reads (`configure` sets it) and each logging the dict `Trainer.log` receives; `progress_logs` is what the
learner adds to that dict, so our progress numbers sit beside TRL's loss and entropy on the same steps. The trackers
are optional installs (the `tracking` extra): a run asking for one this image lacks ends at start with a config error
naming `spec.tracking.<name>`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, MutableMapping
from typing import Any

from . import contract as c

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


class TrackingConfigError(ValueError):
    """A tracker the run asks for that cannot work here; one line naming `spec.tracking.<name>`."""


def tracking_directory(config: c.RunConfig, tracker: str) -> str:
    """Where a file-writing tracker writes: under the checkpoint directory (a volume that outlives the pod) when the
    run has one, else under the output directory."""
    return os.path.join(config.checkpoint.directory or config.output_dir, tracker)


def tracker_env(config: c.RunConfig) -> dict[str, str]:
    """The env transformers' integrations read for the trackers the run asks for (credentials excepted: the pod's
    env carries those, from Secrets)."""
    tracking = config.tracking
    env: dict[str, str] = {}
    if tracking.mlflow is not None:
        env["MLFLOW_TRACKING_URI"] = tracking.mlflow.tracking_uri
        env["MLFLOW_EXPERIMENT_NAME"] = tracking.mlflow.experiment or config.namespace
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


def check_trackers(config: c.RunConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Raise TrackingConfigError when a tracker's package is not installed or its Secret gave no credential."""
    environ = os.environ if environ is None else environ
    tracking = config.tracking
    mlflow = tracking.mlflow
    credentials_given = any(environ.get(variable) for variable in c.MLFLOW_CREDENTIAL_ENV.values())
    if mlflow is not None and mlflow.credentials_secret and not credentials_given:
        raise TrackingConfigError(
            f"spec.tracking.mlflow.credentialsSecret: Secret {mlflow.credentials_secret!r} is missing or has "
            f"none of the keys {', '.join(c.MLFLOW_CREDENTIAL_ENV)}")
    wandb = tracking.wandb
    if wandb is not None and wandb.mode == "online" and not environ.get(c.WANDB_API_KEY_ENV):
        ref = wandb.api_key_secret
        where = f"Secret {ref.name!r} key {ref.key!r}" if ref else "no Secret"
        raise TrackingConfigError(f"spec.tracking.wandb.apiKeySecret: {where} gave no API key "
                                  "(the Secret or its key is missing)")
    for tracker in tracking.trackers:
        if importlib.util.find_spec(TRACKER_MODULES[tracker]) is None:
            raise TrackingConfigError(
                f"spec.tracking.{tracker}: this learner image has no {TRACKER_MODULES[tracker]} package "
                "(install grpo-operator's `tracking` extra in the image)")


def configure(config: c.RunConfig, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Check the trackers, set the env their integrations read, make their directories; the `report_to` list."""
    environ = os.environ if environ is None else environ
    check_trackers(config, environ)
    env = tracker_env(config)
    environ.update(env)
    for variable in ("TENSORBOARD_LOGGING_DIR", "WANDB_DIR"):
        if variable in env:
            os.makedirs(env[variable], exist_ok=True)
    return config.tracking.trackers


def progress_logs(report: c.ProgressReport) -> dict[str, float]:
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


def run_parameters(config: c.RunConfig) -> dict[str, str]:
    """The run's resolved config, flat (`grporun.training.learningRate`), as the trackers' parameters. It holds no
    credential: Secrets are named, never read, in the config."""

    def flatten(value: Any, prefix: str) -> Iterator[tuple[str, str]]:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                yield from flatten(item, f"{prefix}.{key}")
        else:
            yield prefix, value if isinstance(value, str) else json.dumps(value)

    return dict(flatten(config.model_dump(mode="json", by_alias=True), PARAMETER_PREFIX.rstrip(".")))


def log_run_parameters(config: c.RunConfig, trackers: list[str], tensorboard_writer: Any = None) -> None:
    """Log the run's spec to each tracker's run, which its integration has started (`on_train_begin`)."""
    parameters = run_parameters(config)
    if "mlflow" in trackers:
        import mlflow

        if mlflow.active_run() is not None:
            fitting = {k: v for k, v in parameters.items() if len(v) <= MLFLOW_PARAM_MAX_CHARS}
            for key in sorted(set(parameters) - set(fitting)):
                logger.warning(f"mlflow: parameter {key} is over {MLFLOW_PARAM_MAX_CHARS} characters: not logged")
            items = sorted(fitting.items())
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


def tracked_runs(trackers: list[str]) -> list[c.TrackedRunReport]:
    """The runs the trackers' integrations started (MLflow's: the tracked run with an id on a server)."""
    runs = []
    if "mlflow" in trackers:
        import mlflow

        if (active := mlflow.active_run()) is not None:
            info = active.info
            runs.append(c.TrackedRunReport(tracker="mlflow", run_id=info.run_id, uri=mlflow_run_uri(
                mlflow.get_tracking_uri(), info.experiment_id, info.run_id)))
    return runs


def parameters_callback(config: c.RunConfig, trackers: list[str], callbacks: list):
    """A TrainerCallback that logs the run's spec once the trackers' runs have started, and keeps their identity
    (its `tracked_runs()`, for the progress report). Added after transformers' integrations (`callbacks` is the
    trainer's list), so their `on_train_begin` has run when this one does."""
    from transformers import TrainerCallback

    class RunParameters(TrainerCallback):
        def __init__(self):
            self.runs: list[c.TrackedRunReport] = []

        def tracked_runs(self) -> list[c.TrackedRunReport]:
            return list(self.runs)

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            writer = next((getattr(cb, "tb_writer", None) for cb in callbacks
                           if type(cb).__name__ == "TensorBoardCallback"), None)
            log_run_parameters(config, trackers, writer)
            self.runs = tracked_runs(trackers)

    return RunParameters()
