"""Environment servers (spec.environments) in the pure derivation: their pods are created with the run's others,
replaced when they end, never taken for rollout servers or learners, and deleted with the run's pods."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_operator.status import CreateChildren, DeletePods, PodObservation, ProbeFailure, RecreatePods
from grpo_operator.status.messages import probe_failure_words
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


# --- a live change of spec.environments[].replicas --------------------------------------------------------------------

TRAINED = report(groupsConsumed=3, groupsTrained=3)


def _scaled(guess: int) -> list[dict[str, Any]]:
    return [{**ENVIRONMENTS[0], "replicas": guess}, ENVIRONMENTS[1]]


def _guess(status: dict[str, Any]) -> dict[str, Any]:
    return next(entry for entry in status["environments"] if entry["name"] == "guess")


def test_a_live_scale_down_deletes_the_servers_past_the_new_count_and_says_so():
    pods = [*all_pods(), environment_pod("r-env-guess-2")]
    first = step(spec_of(environments=_scaled(3)), {}, [], now=T0)
    status = step(spec_of(environments=_scaled(3)), first.status, pods, TRAINED).status
    assert status["phase"] == "Running"
    decision = step(spec_of(environments=_scaled(1)), status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == [DeletePods(("r-env-guess-1", "r-env-guess-2"), reason="environment scaled down")]
    assert decision.status["phase"] == "Running" and decision.status["restarts"] == 0
    (event,) = [event for event in decision.events if event.reason == "Scaled"]
    assert event.type == "Normal" and event.message == (
        "environment guess scaled from 3 to 1 servers: deleting r-env-guess-1, r-env-guess-2; the episodes they hold "
        "fail and count as environment failures")
    # The deleted servers count until they are gone: status shows the pool converging on the new count.
    assert _guess(decision.status) == {"name": "guess", "wanted": 1, "replicas": 3, "ready": 3, "restarts": 0}
    going = [dataclasses.replace(p, terminating=True) if p.name in ("r-env-guess-1", "r-env-guess-2") else p
             for p in pods]
    after = step(spec_of(environments=_scaled(1)), decision.status, going, report(groupsConsumed=3, groupsTrained=3))
    assert after.actions == [] and "Scaled" not in [event.reason for event in after.events]
    assert _guess(after.status) == {"name": "guess", "wanted": 1, "replicas": 1, "ready": 1, "restarts": 0}


def test_a_live_scale_up_creates_the_new_servers_and_says_so():
    pods = [p for p in all_pods() if p.name != "r-env-guess-1"]
    first = step(spec_of(environments=_scaled(1)), {}, [], now=T0)
    status = step(spec_of(environments=_scaled(1)), first.status, pods, TRAINED).status
    assert status["phase"] == "Running"
    decision = step(spec_of(environments=_scaled(3)), status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == [CreateChildren()]
    assert decision.status["phase"] == "Running"
    assert [event.message for event in decision.events if event.reason == "Scaled"] == [
        "environment guess scaled from 1 to 3 servers: creating 2 server pod(s)"]
    assert _guess(decision.status) == {"name": "guess", "wanted": 3, "replicas": 1, "ready": 1, "restarts": 0}


def test_scaling_to_zero_deletes_every_server_of_that_environment_only():
    status = running_status(spec_of(environments=ENVIRONMENTS))
    decision = step(spec_of(environments=_scaled(0)), status, all_pods(), report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == [DeletePods(("r-env-guess-0", "r-env-guess-1"), reason="environment scaled down")]


def test_a_surplus_server_whose_pod_ended_is_deleted_not_recreated():
    status = running_status(spec_of(environments=ENVIRONMENTS))
    pods = all_pods(**{"r-env-guess-1": "Failed"})
    decision = step(spec_of(environments=_scaled(1)), status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == [DeletePods(("r-env-guess-1",), reason="environment scaled down")]


def test_an_environment_whose_name_prefixes_another_keeps_its_servers_apart():
    """`a` and `a-1`: a-1's server 0 (r-env-a-1-0) is neither a's server nor past a's count."""
    environments = [{"name": "a", "image": "a:1", "replicas": 1}, {"name": "a-1", "image": "b:1", "replicas": 1}]
    pods = [*running_pods(), environment_pod("r-env-a-0"), environment_pod("r-env-a-1-0")]
    status = step(spec_of(environments=environments), {}, [], now=T0).status
    status = step(spec_of(environments=environments), status, pods, report(groupsConsumed=3, groupsTrained=3)).status
    decision = step(spec_of(environments=environments), status, pods, report(groupsConsumed=3, groupsTrained=3))
    assert decision.actions == []
    assert [entry["replicas"] for entry in decision.status["environments"]] == [1, 1]


def test_the_created_event_counts_the_environment_servers():
    decision = step(spec_of(environments=ENVIRONMENTS), {}, [], now=T0)
    (created,) = [event for event in decision.events if event.reason == "Created"]
    assert created.message == "creating 1 rollout, 1 learner and 3 environment pods"
    (plain,) = [event for event in step(spec_of(), {}, [], now=T0).events if event.reason == "Created"]
    assert plain.message == "creating 1 rollout and 1 learner pods"


# --- EnvironmentsReady ------------------------------------------------------------------------------------------------

GAME = [{"name": "guess", "image": "guess:1", "port": 8765}]
NOT_READY = "ContainersNotReady: containers with unready status: [environment]"


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == kind), None)


def test_a_server_that_runs_but_is_never_ready_holds_the_run_in_starting_and_fails_it_at_the_startup_deadline():
    """A server whose port never answers: the run does not claim to be Running, EnvironmentsReady names the server,
    its probe and its pod's Ready condition, and the startup deadline's failure names it too."""
    spec = spec_of(environments=GAME, progress={"startupDeadlineSeconds": 60})
    first = step(spec, {}, [], now=T0)
    pods = [*running_pods(), environment_pod("r-env-guess-0", ready=False, not_ready=NOT_READY)]
    waiting = step(spec, first.status, pods, now=at(5))
    assert waiting.status["phase"] == "Starting"
    ready = condition(waiting.status, "EnvironmentsReady")
    assert (ready["status"], ready["reason"]) == ("False", "EnvironmentsNotReady")
    assert ready["message"] == ("0/1 environment servers ready; r-env-guess-0 is not ready: its readiness probe (TCP "
                                f"connect to port 8765) does not pass ({NOT_READY})")
    assert condition(waiting.status, "Progressing")["status"] == "False"
    assert "r-env-guess-0" in condition(waiting.status, "Progressing")["message"]
    failed = step(spec, waiting.status, pods, now=at(61))
    assert failed.status["phase"] == "Failed"
    assert condition(failed.status, "Failed")["reason"] == "StartupDeadlineExceeded"
    assert "r-env-guess-0 is not ready: its readiness probe (TCP connect to port 8765) does not pass" in (
        failed.status["message"])


def test_a_running_runs_server_that_turns_unready_is_named_with_an_event_and_the_run_goes_on():
    spec = spec_of(environments=ENVIRONMENTS)
    status = running_status(spec)
    ready = condition(status, "EnvironmentsReady")
    assert (ready["status"], ready["reason"], ready["message"]) == ("True", "AllEnvironmentsReady",
                                                                    "3/3 environment servers ready")
    crashing = [*running_pods(), environment_pod("r-env-guess-0"), environment_pod("r-env-code-0"),
                environment_pod("r-env-guess-1", ready=False, waiting_reason="CrashLoopBackOff",
                                message="back-off 40s restarting failed container", container_restarts=4)]
    decision = step(spec, status, crashing, TRAINED, now=at(5))
    assert decision.status["phase"] == "Running"
    message = ("2/3 environment servers ready; r-env-guess-1 is not ready: CrashLoopBackOff: back-off 40s restarting "
               "failed container, restarted 4 times")
    assert condition(decision.status, "EnvironmentsReady")["message"] == message
    assert [(e.type, e.reason, e.message) for e in decision.events] == [("Warning", "EnvironmentsNotReady", message)]
    back = step(spec, decision.status, all_pods(), TRAINED, now=at(10))
    assert condition(back.status, "EnvironmentsReady")["status"] == "True"
    assert [(e.type, e.reason) for e in back.events] == [("Normal", "EnvironmentsReady")]


def test_an_http_probe_or_a_missing_server_is_named_as_it_is():
    spec = spec_of(environments=[{**GAME[0], "replicas": 2, "readinessProbe": {"httpGet": {"path": "/health",
                                                                                           "port": "http"}}}])
    first = step(spec, {}, [], now=T0)
    pods = [*running_pods(), environment_pod("r-env-guess-0", ready=False)]
    decision = step(spec, first.status, pods, now=at(5))
    assert condition(decision.status, "EnvironmentsReady")["message"] == (
        "0/2 environment servers ready; r-env-guess-0 is not ready: its readiness probe (HTTP GET /health on port "
        "http) does not pass; r-env-guess-1 is not ready: it has no pod yet")


REFUSED = ProbeFailure("readiness", 'Get "http://10.0.0.5:8765/health": dial tcp 10.0.0.5:8765: connect: connection '
                       "refused", count=5, seconds=40.2)


def test_the_kubelets_probe_failure_says_why_a_server_is_not_ready_and_the_startup_deadline_says_it_too():
    """The pod's Ready condition says only that the container is not ready; its Unhealthy Event says why."""
    spec = spec_of(environments=GAME, progress={"startupDeadlineSeconds": 60})
    first = step(spec, {}, [], now=T0)
    pods = [*running_pods(), environment_pod("r-env-guess-0", ready=False, not_ready=NOT_READY,
                                             probe_failure=REFUSED)]
    waiting = step(spec, first.status, pods, now=at(5))
    message = ("0/1 environment servers ready; r-env-guess-0 is not ready: its readiness probe (TCP connect to port "
               "8765) does not pass: readiness probe failed: connection refused (5 times in 40 s)")
    assert condition(waiting.status, "EnvironmentsReady")["message"] == message
    failed = step(spec, waiting.status, pods, now=at(61))
    assert condition(failed.status, "Failed")["reason"] == "StartupDeadlineExceeded"
    assert message.split("; ", 1)[1] in failed.status["message"]
    assert "readiness probe failed: connection refused (5 times in 40 s)" in failed.status["failure"]["message"]


def test_a_new_count_of_the_same_probe_failure_is_no_new_event():
    """The kubelet counts each failed probe on one Event: a running run's condition takes the new count, and its
    Warning is posted once, when the server turned unready."""
    spec = spec_of(environments=GAME)
    status = step(spec, step(spec, {}, [], now=T0).status, [*running_pods(), environment_pod("r-env-guess-0")],
                  TRAINED, now=T0).status
    failing = [*running_pods(), environment_pod("r-env-guess-0", ready=False, probe_failure=REFUSED)]
    turned = step(spec, status, failing, TRAINED, now=at(5))
    assert [(e.type, e.reason) for e in turned.events] == [("Warning", "EnvironmentsNotReady")]
    again = dataclasses.replace(REFUSED, count=9, seconds=80)
    failing = [*running_pods(), environment_pod("r-env-guess-0", ready=False, probe_failure=again)]
    counted = step(spec, turned.status, failing, TRAINED, now=at(45))
    assert "connection refused (9 times in 80 s)" in condition(counted.status, "EnvironmentsReady")["message"]
    assert counted.events == []


def test_a_probe_failures_cause_is_said_without_the_request_and_the_address():
    def words(cause: str, count: int = 3, probe: str = "readiness") -> str:
        return probe_failure_words(ProbeFailure(probe, cause, count, seconds=20))

    assert words("dial tcp 10.0.0.5:8765: i/o timeout") == "readiness probe failed: i/o timeout (3 times in 20 s)"
    assert words('Get "http://10.0.0.5:8765/health": context deadline exceeded (Client.Timeout exceeded while '
                 "awaiting headers)", count=1, probe="liveness") == (
        "liveness probe failed: context deadline exceeded (Client.Timeout exceeded while awaiting headers) (once)")
    assert words("HTTP probe failed with statuscode: 503") == (
        "readiness probe failed: HTTP probe failed with statuscode: 503 (3 times in 20 s)")
    assert words("(combined from similar events): sandbox\n  not warm yet\n") == (
        "readiness probe failed: sandbox not warm yet (3 times in 20 s)")
    assert len(words("x" * 5000)) < 260
    assert words("") == "readiness probe failed: no cause given (3 times in 20 s)"


def test_a_run_without_environments_has_no_environments_ready_condition():
    assert condition(step(spec_of(), {}, running_pods()).status, "EnvironmentsReady") is None
