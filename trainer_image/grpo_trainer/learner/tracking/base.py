"""What every experiment tracker is to the learner (`Tracker`), and what they share: where their files go, the
one-line config error, the run a tracker reports, the runs a learner that starts again continues.

transformers' integrations do the logging (`report_to`); a Tracker sets its integration up and reads back what it
started. The learner calls the run's trackers at fixed points, each in the registry's order
(grpo_trainer.learner.tracking.registry):
- at start, before the model loads, on every rank: `check` (what cannot work here ends the learner as a config
  error: a missing credential), `probe` (whether the place it reports to answers now: a tracker that does not fails
  the run or is left out, as `spec.tracking.onUnavailable` says), `env` and `directory` (what its integration
  reads, and where it writes);
- at start, rank 0 only: `continued_env` (continue the run this learner's last start recorded);
- once the integrations started their runs (rank 0, `on_train_begin`): `log_parameters`, `started_run`, `recorded`
  (what the runs file keeps for the next start).
- once the trainer made the integrations: `location` and `thread_hooks`, for the guard that calls each
  integration on a thread of its own and drops a tracker that fails mid-run (grpo_trainer.learner.tracking.guard).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...contract.config import RunConfig
from ...contract.report import TrackedRunReport
from .guard import ThreadHooks

logger = logging.getLogger(__name__)


class TrackingConfigError(ValueError):
    """A tracker the run asks for that cannot work here; one line naming `spec.tracking.<name>`."""


class TrackerUnavailable(Exception):
    """The place a tracker reports to does not answer now; one line naming the field and the URI."""


@dataclass(frozen=True)
class Integrations:
    """What transformers' tracker integrations hold once their runs started, for the trackers that read it:
    TensorBoard's SummaryWriter (MLflow's and W&B's integrations keep their run in their module)."""

    tensorboard_writer: Any = None


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
    """The runs file's content (grpo_trainer.learner.tracking.runs_file): the trackers' runs of one GRPORun (`run`:
    namespace/name), as rank 0 saw them start; one field per tracker that continues its runs (its
    `Tracker.recorded`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    run: str
    mlflow: RecordedMlflowRun | None = None
    wandb: RecordedWandbRun | None = None


class Tracker(Protocol):
    """One experiment tracker (the module docstring says when the learner calls what)."""

    #: Its `spec.tracking` field, and transformers' `report_to` name for its integration.
    name: str
    #: The module its integration imports (the `tracking` extra); a run asking for a tracker without it is refused.
    package: str

    def check(self, config: RunConfig, environ: Mapping[str, str]) -> None:
        """Raise TrackingConfigError, naming the field, for what cannot work here (a Secret that gave nothing)."""

    def probe(self, config: RunConfig) -> None:
        """Raise TrackerUnavailable, naming the field and the URI, when the place it reports to does not answer now
        (within seconds: its integration would retry for minutes inside the training loop)."""

    def env(self, config: RunConfig) -> dict[str, str]:
        """The env its integration reads (credentials excepted: the pod's env carries those, from Secrets)."""

    def directory(self, config: RunConfig) -> str | None:
        """Where it writes files (made at start), or None."""

    def location(self, config: RunConfig) -> str:
        """Where it reports (the tracking URI, the directory), as the warning that drops it mid-run names it."""

    def thread_hooks(self, integration: Any) -> ThreadHooks:
        """Make `integration` fit to be called from its own thread; what its client needs around that thread."""

    def continued_env(self, config: RunConfig, recorded: RecordedRuns) -> dict[str, str]:
        """The env that makes its integration continue the run recorded by this learner's last start; {} to start a
        new one."""

    def log_parameters(self, parameters: dict[str, str], integrations: Integrations) -> None:
        """Log the run's spec (flat parameters) to the run its integration started."""

    def started_run(self, run_name: str, integrations: Integrations) -> TrackedRunReport | None:
        """The run its integration started, as the progress report names it; None before it started."""

    def recorded(self, config: RunConfig, run_id: str) -> BaseModel | None:
        """What the runs file keeps of its run `run_id` for the next start to continue; None: nothing to continue."""


def tracking_root(config: RunConfig) -> str:
    """Where the trackers' files go: the checkpoint directory (a volume that outlives the pod) when the run has one,
    else the output directory."""
    return config.checkpoint.directory or config.output_dir


def tracking_directory(config: RunConfig, tracker: str) -> str:
    """Where a file-writing tracker writes."""
    return os.path.join(tracking_root(config), tracker)


def tracked_run(tracker: str, run_id: str, uri: str) -> TrackedRunReport | None:
    """A tracker's run for the progress report; None, with a warning, for one the report cannot carry."""
    try:
        return TrackedRunReport(tracker=tracker, run_id=run_id, uri=uri)
    except ValidationError as error:
        logger.warning(f"tracking: {tracker} run {run_id[:128]!r} at {uri[:256]!r} is not reported "
                       f"({error.errors()[0]['msg']})")
        return None
