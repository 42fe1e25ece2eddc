"""A run that cannot be run as specified: InvalidSpec, decided like any other end of a run.

What the pass read says why (Observation.spec_error: a stored spec the operator cannot parse, or one past its GPU's
memory; Observation.create_rejected: an object made from the spec that the API server refused as invalid). The
decision fails the run at once with the field named (a retry cannot help, so there is never an endless one),
deletes the pods of a run that ends now (a permanent failure leaves no GPU pod behind), and finishes its Kueue
Workload, so Kueue frees the quota: one status write, then the actions, as in every pass.
"""

from __future__ import annotations

from ..api import FINISHED_PHASES, ConditionType, FailureStatus, GRPORunStatus, Phase, Reason, dump_status
from ..run_ref import RunRef
from .admission import workload_actions
from .conditions import Conditions, format_time
from .decision import Action, Decision, DeletePods, Event, Observation


def invalid_spec(seen: Observation) -> str | None:
    """Why the spec cannot be run, from what the pass read; None when nothing says so."""
    if seen.spec_error is not None:
        return seen.spec_error
    return seen.create_rejected.message if seen.create_rejected is not None else None


def fail_invalid_spec(run: RunRef, old: GRPORunStatus, seen: Observation, message: str) -> Decision:
    """Failed at once as InvalidSpec with `message` (the field named); its event once per message."""
    new = old.model_copy(deep=True)
    new.observed_generation = run.generation
    events = []
    if old.phase != Phase.FAILED or old.message != message:
        events.append(Event("Warning", Reason.INVALID_SPEC, message))
    ends_now = old.phase not in FINISHED_PHASES
    new.phase = Phase.FAILED
    new.completion_time = old.completion_time or format_time(seen.now)
    new.message = message
    new.failure = FailureStatus(role="operator", reason=Reason.INVALID_SPEC, message=message)
    conditions = Conditions(new, seen.now, run.generation)
    conditions.set(ConditionType.FAILED, "True", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.SUCCEEDED, "False", Reason.INVALID_SPEC, message)
    conditions.set(ConditionType.PROGRESSING, "False", Reason.INVALID_SPEC, message)
    actions: list[Action] = []
    live = {pod.name for pod in seen.pods if not pod.terminating}
    created = set(seen.create_rejected.created_pods) if seen.create_rejected is not None else set()
    if ends_now and live | created:
        actions.append(DeletePods(tuple(sorted(live | created)), reason=Reason.INVALID_SPEC))
    actions += workload_actions(seen.workload, finished=True, pods_exist=bool(live))
    return Decision(dump_status(new), events, actions)
