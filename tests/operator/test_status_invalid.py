"""InvalidSpec replayed through derive_status alone: what the pass read says why the spec cannot be run (a spec
that does not parse, the fit check, an object the API server refused), and the decision is one status, its event,
and the actions that end the run (its pods deleted, its Workload finished).
"""

from __future__ import annotations

import pytest

from grpo_operator.run_ref import RunRef
from grpo_operator.status import (
    CreateRejection,
    DeletePods,
    FinishWorkload,
    Observation,
    WorkloadObservation,
    derive_status,
)
from tests.operator.test_status import T0, at, condition, pod, reasons, running_pods, spec_of, step
from tests.support.specs import status_errors

EPOCHS = "spec.training.epochs: input should be greater than 0"
REFUSED = 'Pod r-learner-0 was rejected by the API server: Pod "r-learner-0" is invalid: spec.volumes[0]: bad'


def unparsed(status, now=T0, generation=1, **seen):
    """A pass over a stored spec the operator cannot parse: no spec, the error in the observation."""
    decision = derive_status(RunRef("r", "ns", "uid-r", generation), None, status,
                             Observation(seen.pop("pods", []), None, now, spec_error=EPOCHS, **seen))
    assert status_errors(decision.status) == [], decision.status
    return decision


def test_a_spec_that_cannot_be_parsed_fails_naming_the_field_once():
    decision = unparsed({}, generation=2)
    status = decision.status
    assert status["phase"] == "Failed" and status["observedGeneration"] == 2
    assert condition(status, "Failed") | {"lastTransitionTime": None} == {
        "type": "Failed", "status": "True", "reason": "InvalidSpec", "message": EPOCHS, "lastTransitionTime": None,
        "observedGeneration": 2}
    assert status["failure"] == {"role": "operator", "reason": "InvalidSpec", "message": EPOCHS}
    assert reasons(decision) == ["InvalidSpec"] and decision.actions == []
    again = unparsed(status, now=at(9), generation=2)
    assert again.events == [] and again.status == status and again.actions == []


def test_a_running_run_whose_spec_becomes_invalid_ends_deleting_its_pods_and_finishing_its_workload():
    running = step(spec_of(), {}, running_pods()).status
    workload = WorkloadObservation(exists=True, reserved=True)
    decision = unparsed(running, now=at(5), pods=running_pods() + [pod("r-rollout-1", terminating=True)],
                        workload=workload)
    assert decision.status["phase"] == "Failed"
    assert decision.actions == [DeletePods(("r-learner-0", "r-rollout-0"), reason="InvalidSpec"), FinishWorkload()]


def test_a_run_already_finished_deletes_nothing_more_and_its_finished_workload_is_left_alone():
    failed = unparsed({}).status
    again = unparsed(failed, now=at(5), pods=running_pods(),
                     workload=WorkloadObservation(exists=True, finished=True))
    assert again.actions == []


def test_a_refused_child_fails_the_run_and_deletes_the_pods_its_pass_created_unseen_or_seen():
    spec = spec_of()
    pending = step(spec, {}, []).status
    rejected = CreateRejection(REFUSED, created_pods=("r-rollout-0",))
    decision = step(spec, pending, [], now=at(1), create_rejected=rejected)
    assert decision.status["phase"] == "Failed" and condition(decision.status, "Failed")["message"] == REFUSED
    assert decision.actions == [DeletePods(("r-rollout-0",), reason="InvalidSpec")]
    assert reasons(decision) == ["InvalidSpec"]
    # Once Failed, the run is a finished run like any other: cleanPodPolicy and the TTL apply, nothing is created.
    after = step(spec_of(runPolicy={"ttlSecondsAfterFinished": 0}), decision.status, [pod("r-rollout-0")],
                 now=at(2), create_rejected=rejected)
    assert after.status["phase"] == "Failed" and after.status["failure"] == decision.status["failure"]
    assert reasons(after) == []
    assert [type(action).__name__ for action in after.actions] == ["DeletePods", "DeleteRun"]


@pytest.mark.parametrize("seen", [{"spec_error": "spec.learner: the learner needs ~122 GiB per GPU"},
                                  {"create_rejected": CreateRejection(REFUSED)}])
def test_a_spec_error_or_a_refusal_wins_over_everything_else_the_pass_read(seen):
    spec = spec_of()
    decision = step(spec, {}, [], workload=WorkloadObservation(exists=False), **seen)
    assert decision.status["phase"] == "Failed" and decision.actions == []  # no Workload to create, no pods


def test_a_pass_with_no_spec_must_say_why():
    with pytest.raises(ValueError, match="spec_error"):
        derive_status(RunRef("r", "ns", "uid-r"), None, {}, Observation([], None, T0))


def test_the_fit_checks_warnings_are_the_passes_events():
    decision = step(spec_of(), {}, [], fit_warnings=("spec.learner: likely past its GPU's memory",))
    assert "LikelyOutOfMemory" in reasons(decision)
