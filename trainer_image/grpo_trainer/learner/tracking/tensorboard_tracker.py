"""TensorBoard: transformers' TensorBoardCallback, its event files under the checkpoint directory's `tensorboard/`
(the checkpoint volume: they outlive the pod). A learner that starts again appends to the same directory: there is
no run to continue."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...contract.config import RunConfig
from ...contract.report import TrackedRunReport
from .base import Integrations, RecordedRuns, tracked_run, tracking_directory
from .guard import ThreadHooks


class TensorBoardTracker:
    name = "tensorboard"
    package = "tensorboard"

    def check(self, config: RunConfig, environ: Mapping[str, str]) -> None:
        pass  # nothing to authenticate: it writes files

    def probe(self, config: RunConfig) -> None:
        pass  # it writes files: where they go is made at start (tracking.configure)

    def env(self, config: RunConfig) -> dict[str, str]:
        return {"TENSORBOARD_LOGGING_DIR": tracking_directory(config, self.name)}

    def directory(self, config: RunConfig) -> str | None:
        return tracking_directory(config, self.name)

    def location(self, config: RunConfig) -> str:
        return tracking_directory(config, self.name)

    def thread_hooks(self, integration: Any) -> ThreadHooks:
        return ThreadHooks()

    def continued_env(self, config: RunConfig, recorded: RecordedRuns) -> dict[str, str]:
        return {}

    def log_parameters(self, parameters: dict[str, str], integrations: Integrations) -> None:
        writer = integrations.tensorboard_writer
        if writer is None:
            return
        writer.add_text("grporun/spec", "\n".join(f"    {k}: {v}" for k, v in sorted(parameters.items())))
        writer.flush()

    def started_run(self, run_name: str, integrations: Integrations) -> TrackedRunReport | None:
        """The run name, and the event files' directory to point `tensorboard --logdir` at."""
        writer = integrations.tensorboard_writer
        if writer is None:
            return None
        return tracked_run("tensorboard", run_name, os.path.abspath(writer.get_logdir()))

    def recorded(self, config: RunConfig, run_id: str) -> None:
        return None
