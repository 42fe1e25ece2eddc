"""Experiment tracking: `spec.tracking` to transformers' `report_to` integrations (MLflow, TensorBoard, Weights &
Biases), the run's spec as the tracker's parameters, and our progress numbers beside TRL's curves.

Torch-free until a callback runs. TRL reaches the trackers through transformers' integrations, each configured by the
env it reads (`configure` sets it) and each logging the dict `Trainer.log` receives; `progress_logs` is what the
learner adds to that dict, so our progress numbers sit beside TRL's loss and entropy on the same steps. The trackers
are optional installs (the `tracking` extra): a run asking for one this image lacks ends at start with a config error
naming `spec.tracking.<name>`.

A learner that starts again (a restart, a resume) continues its trackers' runs rather than opening new ones: rank 0
records their ids beside the checkpoints when they start (grpo_trainer.learner.tracking.runs_file), and `configure`
hands them back to the integrations (`MLFLOW_RUN_ID`; `WANDB_RUN_ID` with `WANDB_RESUME=allow`). TensorBoard appends
to its directory anyway.

Each integration runs on a thread of its own once the trainer made it (grpo_trainer.learner.tracking.guard): a tracker
lost mid-run holds no training step, the run's end waits for it a bounded time, and the progress report names it.

What is particular to each tracker is its `Tracker` (grpo_trainer.learner.tracking.base, one module each, listed in
grpo_trainer.learner.tracking.registry); this module calls the run's trackers in turn.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from ...contract.config import RunConfig
from ...contract.report import (
    TRACKING_DEGRADED_LINE_MAX_CHARS,
    ExportReport,
    ProgressReport,
    TrackedRunReport,
    TrackerLossReport,
)
from .base import Integrations, RecordedRuns, TrackerUnavailable, TrackingConfigError
from .guard import TrackerLosses, guarded
from .registry import TRACKERS
from .runs_file import read_recorded_runs, run_key, write_recorded_runs

logger = logging.getLogger(__name__)

#: Prefix of the progress numbers in a tracker (TRL's own keys are `loss`, `entropy`, `completions/...`).
PROGRESS_PREFIX = "progress/"
#: Prefix of the run's spec among a tracker's parameters (transformers logs TrainingArguments unprefixed).
PARAMETER_PREFIX = "grporun."
#: How long the learner's end waits for the MLflow server to take the export's tags; past it, it ends without them.
EXPORT_TAGS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Tracking:
    """The learner's trackers once configured: those it reports to, and a line for each left out because it did not
    answer at start (`spec.tracking.onUnavailable: continue`; the operator's TrackingDegraded condition)."""

    trackers: list[str]
    unavailable: list[str]


def check_trackers(config: RunConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Raise TrackingConfigError when a tracker's Secret gave no credential or its package is not installed."""
    environ = os.environ if environ is None else environ
    trackers = [TRACKERS[name] for name in config.tracking.trackers]
    for tracker in trackers:
        tracker.check(config, environ)
    for tracker in trackers:
        if importlib.util.find_spec(tracker.package) is None:
            raise TrackingConfigError(
                f"spec.tracking.{tracker.name}: this learner image has no {tracker.package} package "
                "(install grpo-operator's `tracking` extra in the image)")


def tracker_env(config: RunConfig) -> dict[str, str]:
    """The env transformers' integrations read for the trackers the run asks for (credentials excepted: the pod's
    env carries those, from Secrets)."""
    env: dict[str, str] = {}
    for name in config.tracking.trackers:
        env.update(TRACKERS[name].env(config))
    return env


def continued_runs_env(config: RunConfig) -> dict[str, str]:
    """The env that makes the trackers' integrations continue the runs this learner's last start recorded."""
    recorded = read_recorded_runs(config)
    if recorded is None:
        return {}
    env: dict[str, str] = {}
    for name in config.tracking.trackers:
        env.update(TRACKERS[name].continued_env(config, recorded))
    return env


def available_trackers(config: RunConfig) -> tuple[list[str], list[str]]:
    """The trackers that answer now, and a line for each that does not (`Tracker.probe`). With
    `spec.tracking.onUnavailable: fail` (the default), TrackingConfigError for the first that does not."""
    available, unavailable = [], []
    for name in config.tracking.trackers:
        try:
            TRACKERS[name].probe(config)
        except TrackerUnavailable as error:
            if config.tracking.on_unavailable == "fail":
                raise TrackingConfigError(f"{error} (spec.tracking.onUnavailable: continue trains without it)") \
                    from None
            logger.warning("tracking: %s: training without %s (spec.tracking.onUnavailable: continue)", error, name)
            unavailable.append(f"{name}: {error}")
        else:
            available.append(name)
    return available, unavailable


def configure(config: RunConfig, environ: MutableMapping[str, str] | None = None, *,
              main_process: bool = True) -> Tracking:
    """Check the trackers, probe them, set the env their integrations read (continuing the runs this learner's last
    start recorded), make their directories; the trackers to report to (`report_to`) and the lines of those left
    out. Only the main process (rank 0) logs to the trackers, so only it probes them and asks the tracking server
    whether the recorded run can be continued: one request per start, not one per rank."""
    environ = os.environ if environ is None else environ
    check_trackers(config, environ)
    trackers, unavailable = available_trackers(config) if main_process else (config.tracking.trackers, [])
    env = tracker_env(config)
    if trackers and main_process:
        env.update(continued_runs_env(config))
    environ.update(env)
    for name in trackers:
        if (directory := TRACKERS[name].directory(config)) is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as error:
                raise TrackingConfigError(f"spec.tracking.{name}: cannot make its directory {directory}: "
                                          f"{error.strerror or error}") from None
    return Tracking(trackers, unavailable)


def record_runs(config: RunConfig, runs: list[TrackedRunReport]) -> None:
    """Save the runs the trackers started, for the next start of this learner to continue (rank 0 only)."""
    ids = {run.tracker: run.run_id for run in runs}
    recorded = RecordedRuns(run=run_key(config))
    kept = False
    for name in config.tracking.trackers:
        if name in ids and (entry := TRACKERS[name].recorded(config, ids[name])) is not None:
            setattr(recorded, name, entry)
            kept = True
    if kept:
        write_recorded_runs(config, recorded)


def record_export(config: RunConfig, report: ProgressReport, exported: ExportReport) -> None:
    """The export's URI and manifest digest as tags of the run's MLflow run (the other trackers have no place the
    learner can write after their run ended; the manifest names their runs), unless MLflow was lost during the run
    (`report.tracking_lost`). Waited for EXPORT_TAGS_TIMEOUT_S at most; a failure is a warning: the model is
    exported either way."""
    from ...rollout.sync_watchdog import DaemonCall
    from .mlflow_tracker import tag_export

    run = next((run for run in report.tracking if run.tracker == "mlflow"), None)
    if run is None or config.tracking.mlflow is None or any(lost.tracker == "mlflow" for lost in report.tracking_lost):
        return
    uri = config.tracking.mlflow.tracking_uri
    call = DaemonCall(lambda: tag_export(uri, run.run_id, exported), "grpo-mlflow-export-tags")
    if not call.join(EXPORT_TAGS_TIMEOUT_S):
        logger.warning("tracking: MLflow (%s) did not take the export's tags within %.0f s; run %s does not name the "
                       "model", uri, EXPORT_TAGS_TIMEOUT_S, run.run_id)
        return
    try:
        call.result()
    except Exception as error:  # noqa: BLE001 - any failure of the tracker's client; the export stands
        logger.warning("tracking: MLflow (%s) refused the export's tags for run %s: %s", uri, run.run_id,
                       str(error).splitlines()[0] if str(error) else type(error).__name__)


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
    integrations = Integrations(tensorboard_writer=tensorboard_writer)
    for name in trackers:
        TRACKERS[name].log_parameters(parameters, integrations)


def tracked_runs(trackers: list[str], run_name: str = "", tensorboard_writer: Any = None) -> list[TrackedRunReport]:
    """The runs the trackers' integrations started (each tracker's `started_run`)."""
    integrations = Integrations(tensorboard_writer=tensorboard_writer)
    runs = [TRACKERS[name].started_run(run_name, integrations) for name in trackers]
    return [run for run in runs if run is not None]


def guard_integrations(config: RunConfig, trackers: list[str], callbacks: list, losses: TrackerLosses) -> None:
    """Put each tracker's integration in `callbacks` (the trainer's list, in place) on a thread of its own, dropped
    into `losses` when it fails mid-run (grpo_trainer.learner.tracking.guard)."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    for name in trackers:
        tracker = TRACKERS[name]
        for index, callback in enumerate(callbacks):
            if type(callback) is INTEGRATION_TO_CALLBACK[name]:
                callbacks[index] = guarded(callback, name, tracker.location(config), losses,
                                           tracker.thread_hooks(callback))


def parameters_callback(config: RunConfig, tracking: Tracking, callbacks: list):
    """A TrainerCallback that logs the run's spec once the trackers' runs have started, keeps their identity (its
    `tracked_runs()`, for the progress report) and records it for the next start to continue (`RUNS_FILE`), and
    says which trackers do not get the run's metrics (its `degraded()`: left out at start; its `lost()`: dropped
    mid-run). Added after transformers' integrations (`callbacks` is the trainer's list, whose integrations it puts
    on their own threads: `guard_integrations`), so their `on_train_begin` has run when this one does."""
    from transformers import TrainerCallback

    trackers = tracking.trackers
    losses = TrackerLosses()
    guard_integrations(config, trackers, callbacks, losses)

    class RunParameters(TrainerCallback):
        def __init__(self):
            self.runs: list[TrackedRunReport] = []

        def tracked_runs(self) -> list[TrackedRunReport]:
            return list(self.runs)

        def degraded(self) -> list[str]:
            return [line[:TRACKING_DEGRADED_LINE_MAX_CHARS] for line in tracking.unavailable]

        def lost(self) -> list[TrackerLossReport]:
            return losses.reports()

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            writer = next((getattr(getattr(cb, "integration", cb), "tb_writer", None) for cb in callbacks
                           if type(getattr(cb, "integration", cb)).__name__ == "TensorBoardCallback"), None)
            reporting = [name for name in trackers if not losses.lost(name)]
            log_run_parameters(config, reporting, writer)
            self.runs = tracked_runs(reporting, args.run_name or config.run_name, writer)
            record_runs(config, self.runs)

    return RunParameters()
