"""Environment servers (spec.environments) in the pure derivation: their pods are created with the run's others,
replaced when they end, never taken for rollout servers or learners, and deleted with the run's pods."""

from __future__ import annotations

from typing import Any

from grpo_operator.status import CreateChildren, DeletePods, PodObservation, RecreatePods
from tests.operator.test_status import T0, at, report, running_pods, spec_of, step

ENVIRONMENTS = [{"name": "guess", "image": "guess:1", "replicas": 2}, {"name": "code", "image": "sandbox:1"}]
ENVIRONMENT_PODS = ("r-env-guess-0", "r-env-guess-1", "r-env-code-0")


def environment_pod(name: str, phase: str = "Running", ready: bool = True, **fields: Any) -> PodObservation:
    return PodObservation(name=name, role="environment", phase=phase, ready=ready, **fields)


def all_pods(**phases: str) -> list[PodObservation]:
    return running_pods() + [environment_pod(name, phases.get(name, "Running")) for name in ENVIRONMENT_PODS]


def running_status(spec) -> dict[str, Any]:
    first = step(spec, {}, [], now=T0)
    status = step(spec, first.status, all_pods(), report(groupsConsumed=3, groupsTrained=3), now=T0).status
    assert status["phase"] == "Running"
    return status


def test_a_running_run_with_every_environment_server_creates_nothing_and_counts_none_as_a_rollout_server():
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    decision = step(spec, status, all_pods(), report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == []
    assert decision.status["phase"] == "Running"
    assert decision.status["rollout"]["replicas"] == 1 and len(decision.status["rollout"]["servers"]) == 1


def test_a_missing_environment_server_is_created_without_disturbing_the_run():
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    pods = [p for p in all_pods() if p.name != "r-env-guess-1"]
    decision = step(spec, status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == [CreateChildren()]
    assert decision.status["phase"] == "Running" and decision.status["restarts"] == 0


def test_each_environment_numbers_its_own_servers():
    """guess's server 0 does not stand in for code's server 0."""
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    pods = [p for p in all_pods() if p.name != "r-env-code-0"]
    assert step(spec, status, pods, report(groupsConsumed=3, groupsTrained=3)).actions == [CreateChildren()]


def test_an_environment_server_whose_pod_ended_is_recreated_and_the_run_goes_on():
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    pods = all_pods(**{"r-env-guess-0": "Failed"})
    decision = step(spec, status, pods, report(groupsConsumed=3, groupsTrained=3), now=at(5))
    assert decision.actions == [RecreatePods(("r-env-guess-0",))]
    assert decision.status["phase"] == "Running"
    assert decision.status["restarts"] == 0 and decision.status.get("failure") is None


def test_a_new_run_waits_for_its_environment_servers_naming_the_one_that_cannot_start():
    spec = spec_of(environments=ENVIRONMENTS)
    first = step(spec, {}, [], now=T0)
    pods = [*running_pods(), environment_pod("r-env-guess-0"), environment_pod("r-env-code-0"),
            environment_pod("r-env-guess-1", "Pending", False, waiting_reason="ImagePullBackOff",
                            message="Back-off pulling image guess:1")]
    decision = step(spec, first.status, pods, now=at(10))
    assert decision.status["phase"] == "Pending"
    assert "r-env-guess-1" in decision.status["message"] and "ImagePullBackOff" in decision.status["message"]


def test_suspending_deletes_the_environment_servers_with_the_other_pods():
    spec = spec_of(environments=ENVIRONMENTS, runPolicy={"suspend": True})
    status = running_status(spec_of(environments=ENVIRONMENTS))
    decision = step(spec, status, all_pods())
    (delete,) = [action for action in decision.actions if isinstance(action, DeletePods)]
    assert set(ENVIRONMENT_PODS) <= set(delete.pods)


def test_status_lists_each_environment_with_its_servers_ready_and_restarted():
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    pods = [*running_pods(), environment_pod("r-env-guess-0", container_restarts=2),
            environment_pod("r-env-guess-1", ready=False, container_restarts=1)]
    decision = step(spec, status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.status["environments"] == [
        {"name": "guess", "wanted": 2, "replicas": 2, "ready": 1, "restarts": 3},
        {"name": "code", "wanted": 1, "replicas": 0, "ready": 0, "restarts": 0}]


def test_a_run_without_environments_has_no_environments_status():
    spec = spec_of()
    assert "environments" not in step(spec, {}, running_pods()).status
