"""The trackers the learner knows, by their `spec.tracking` names: a new tracker is a module with a `Tracker` class
(grpo_trainer.learner.tracking.base) and its line here (and its field in the contract's TrackingConfig)."""

from __future__ import annotations

from .base import Tracker
from .mlflow_tracker import MlflowTracker
from .tensorboard_tracker import TensorBoardTracker
from .wandb_tracker import WandbTracker

#: In the order the learner sets them up (TrackingConfig.trackers lists a run's in the same order).
TRACKERS: dict[str, Tracker] = {
    tracker.name: tracker for tracker in (
        MlflowTracker(),
        TensorBoardTracker(),
        WandbTracker(),
    )
}
