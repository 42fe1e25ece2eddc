"""Pure status derivation: derive_status(run, spec, last status, observation) -> Decision(new status, events,
actions); the observation holds the pods, the learner's progress, the time and, for a queued run, its Workload.

Everything the operator decides lives here, with no I/O and no clock of its own (`now` is an input), so the kopf
handlers and `grporun local` share one state machine and the tests can replay any lifecycle step by step.
`derive_status` is the single entry. The package is cut along its seams:

- derive.py: the orchestration of one pass (phases, pods, suspend, the end of a run);
- exits.py: the failure policy, `classify_failure` (exit codes, backoff, gang restarts);
- rollout_exits.py: rollout servers that exit, replaced alone within `runPolicy.rolloutRestartLimit`;
- servers.py: `status.rollout`, each server as its pod and the learner see it;
- scaling.py: a live replica change, the removed servers deleted once the learner has drained them, and the
  refusal of one a gang cannot take;
- invalid.py: a run that cannot be run as specified (InvalidSpec): failed, its pods deleted, its Workload finished;
- admission.py: the run's Kueue Workload: created, its quota given back on eviction, resized, finished; a size
  beyond what Kueue admitted refused;
- revision.py: one revision for the whole run: the hub model's and dataset's commits pinned before the first pod,
  and the spec every pod is built from;
- children.py: what an existing child object (the run config, the PodGroup) is patched to before pods start;
- urgency.py: which status changes are written at once and which wait for the status interval;
- clock.py: the progress clock (inactivity while Running, paused otherwise, kept in status);
- deadlines.py: activeDeadlineSeconds, startupDeadlineSeconds and the stall rules;
- conditions.py: metav1.Condition bookkeeping and the API server's time format;
- decision.py: PodObservation in, Decision (status, events, actions) out.

docs/operator.md describes the lifecycle, phases, conditions, exit-code rules and the clock for users.
A finished run never gets CreateChildren (kubeflow#2991 recreated children of finished jobs in a loop); it only
cleans pods per `cleanPodPolicy` and, past `ttlSecondsAfterFinished`, asks for its own deletion. `status.phase` is
the real state, not the last condition (Kubeflow's `State=conditions[-1]` column shows stale states,
kubeflow/trainer#3666).
"""

from .conditions import format_time, parse_time
from .decision import (
    Action,
    ConfigureRollout,
    CreateChildren,
    CreateRejection,
    CreateWorkload,
    Decision,
    DeletePods,
    DeleteRun,
    Event,
    FinishWorkload,
    Observation,
    PodObservation,
    ProbeFailure,
    RecordImages,
    RecreatePods,
    ReleaseQuota,
    ResizeWorkload,
    Role,
    WorkloadObservation,
)
from .derive import derive_status, progress_status
from .exits import classify_failure, failure_text, report_from_termination_message
from .messages import STUCK_WAITING_REASONS

__all__ = [
    "STUCK_WAITING_REASONS", "Action", "ConfigureRollout", "CreateChildren", "CreateRejection", "CreateWorkload",
    "Decision",
    "DeletePods", "DeleteRun", "Event", "FinishWorkload", "Observation", "PodObservation", "ProbeFailure",
    "RecordImages", "RecreatePods",
    "ReleaseQuota", "ResizeWorkload", "Role", "WorkloadObservation", "classify_failure", "derive_status",
    "failure_text",
    "format_time", "parse_time", "progress_status", "report_from_termination_message",
]
