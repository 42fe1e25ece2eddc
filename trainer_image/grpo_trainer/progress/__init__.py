"""Progress accounting and termination for async GRPO's rollout stream.

TRL's rollout worker cycles the prompts forever, and TRL ends an epoch-bounded run only when an optimizer step ends.
Rollouts dropped before training (no reward signal, truncated, too stale, too long) complete no step, so a run whose
remaining rollouts are all dropped would generate forever (reproduced: ~30,000 samples dropped in 20 s, step 0).

SampleFilterQueue drops the rollouts that would train nothing. Every drop and every trained micro-batch reports to
RolloutProgress, which keeps TRL's set of consumed prompt groups (read for the epoch bound and for resume). When the
run's prompt groups are consumed, or a full pass over the prompts trains nothing, the rank-0 pipeline raises
RolloutStop. StopAwareDataset turns it into one stop micro-batch that accelerate's dispatcher hands to every rank, so
all ranks end training (or raise the stall error) at the same micro-batch.

Group ids are the worker's: they start at 0 when the worker starts and grow across passes. `start_group` is the
absolute position (prompts x passes) of worker group 0, non-zero after a resume.

Stale groups are regenerated, not consumed: a group whose samples are (or, for a group that never arrived, would be)
older than `max_staleness` versions counts neither as trained nor toward the stall streak, and the run's bound moves
by one so that the next group the worker generates takes its place. TRL's worker never generates a group id twice,
hence the stand-in. See docs/learner.md ("Stale and lost groups").

The package is cut along those seams: ids.py (the consumed set and the runs of drops), accounting.py
(RolloutProgress and the stops), state.py (the checkpointed state), filtering.py (SampleFilterQueue) and stream.py
(StopAwareDataset, ProgressCollator). Import the names from here.
"""

from .accounting import (
    REGENERATE_LIMIT,
    AccountingError,
    RolloutPipelineError,
    RolloutProgress,
    RolloutStop,
    StallError,
    StallVerdict,
    StopCode,
)
from .filtering import PRUNE_EVERY_GROUPS, SampleFilterQueue, SampleLimits, queue_bound
from .ids import ConsumedIds, DropRuns
from .state import PROGRESS_STATE_VERSION, ProgressState, ProgressStateError
from .stream import SAMPLE_GROUP_KEY, STOP_KEY, ProgressCollator, StopAwareDataset, stop_from_batch

__all__ = [
    "PROGRESS_STATE_VERSION", "PRUNE_EVERY_GROUPS", "REGENERATE_LIMIT", "SAMPLE_GROUP_KEY", "STOP_KEY",
    "AccountingError", "ConsumedIds", "DropRuns", "ProgressCollator", "ProgressState", "ProgressStateError",
    "RolloutPipelineError", "RolloutProgress", "RolloutStop", "SampleFilterQueue", "SampleLimits", "StallError",
    "StallVerdict", "StopAwareDataset", "StopCode", "queue_bound", "stop_from_batch",
]
