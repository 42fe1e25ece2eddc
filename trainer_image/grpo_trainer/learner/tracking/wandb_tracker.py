"""Weights & Biases: transformers' WandbCallback, online (with the API key from its Secret) or offline under the
checkpoint directory's `wandb/` (no network; `wandb sync` uploads it later); the run's spec as its config, its run on
/progress, and the recorded run continued by the learner's next start."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ...contract.config import RunConfig
from ...contract.pod_env import WANDB_API_KEY_ENV
from ...contract.report import TrackedRunReport
from .base import Integrations, RecordedRuns, RecordedWandbRun, TrackingConfigError, tracked_run, tracking_directory
from .guard import ThreadHooks

logger = logging.getLogger(__name__)


class WandbTracker:
    name = "wandb"
    package = "wandb"

    def check(self, config: RunConfig, environ: Mapping[str, str]) -> None:
        wandb = config.tracking.wandb
        if wandb.mode == "online" and not environ.get(WANDB_API_KEY_ENV):
            ref = wandb.api_key_secret
            where = f"Secret {ref.name!r} key {ref.key!r}" if ref else "no Secret"
            raise TrackingConfigError(f"spec.tracking.wandb.apiKeySecret: {where} gave no API key "
                                      "(the Secret or its key is missing)")

    def probe(self, config: RunConfig) -> None:
        pass  # not probed at start: reaching W&B's server is left to its own client

    def env(self, config: RunConfig) -> dict[str, str]:
        wandb = config.tracking.wandb
        env = {"WANDB_PROJECT": wandb.project, "WANDB_MODE": wandb.mode, "WANDB_DIR": self.directory(config)}
        if wandb.entity:
            env["WANDB_ENTITY"] = wandb.entity
        return env

    def directory(self, config: RunConfig) -> str | None:
        return tracking_directory(config, self.name)

    def location(self, config: RunConfig) -> str:
        wandb = config.tracking.wandb
        if wandb.mode == "offline":
            return tracking_directory(config, self.name)
        return f"W&B project {'/'.join(filter(None, (wandb.entity, wandb.project)))}"

    def thread_hooks(self, integration: Any) -> ThreadHooks:
        return ThreadHooks()

    def continued_env(self, config: RunConfig, recorded: RecordedRuns) -> dict[str, str]:
        wandb = config.tracking.wandb
        if recorded.wandb is None:
            return {}
        if (recorded.wandb.project, recorded.wandb.entity) != (wandb.project, wandb.entity):
            logger.warning(f"tracking: W&B run {recorded.wandb.run_id} was in another project or entity than "
                           "spec.tracking.wandb names now: starting a new run")
            return {}
        logger.info(f"tracking: continuing the W&B run {recorded.wandb.run_id} of this learner's last start")
        # allow: a run the W&B server does not know (an offline run never synced) starts under the same id.
        return {"WANDB_RUN_ID": recorded.wandb.run_id, "WANDB_RESUME": "allow"}

    def log_parameters(self, parameters: dict[str, str], integrations: Integrations) -> None:
        import wandb

        if wandb.run is not None:
            wandb.config.update(parameters, allow_val_change=True)

    def started_run(self, run_name: str, integrations: Integrations) -> TrackedRunReport | None:
        """Its page; offline, the run's directory that `wandb sync` uploads."""
        import wandb

        if (run := wandb.run) is None:
            return None
        return tracked_run("wandb", run.id, run.sync_dir if run.offline else (run.url or ""))

    def recorded(self, config: RunConfig, run_id: str) -> RecordedWandbRun:
        wandb = config.tracking.wandb
        return RecordedWandbRun(runId=run_id, project=wandb.project, entity=wandb.entity)
