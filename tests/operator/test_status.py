"""Unit tests of the pure status derivation (grpo_operator.status): one lifecycle step at a time, clock as input.

Every status derived here is also checked against the CRD's status schema (tests.support.specs.status_errors),
since the API server prunes or rejects what the schema does not declare.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from grpo_operator.api import parse_spec
from grpo_operator.apitime import format_time
from grpo_operator.run_ref import RunRef
from grpo_operator.status import (
    CreateChildren,
    Decision,
    DeletePods,
    DeleteRun,
    Observation,
    PodObservation,
    RecreatePods,
    derive_status,
)
from grpo_trainer.contract.codes import (
    DROP_REASONS,
    EXIT_EXPORT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    EXIT_STALLED,
)
from grpo_trainer.contract.report import ExportReport, ProgressReport, TrackedRunReport, parse_progress
from tests.support.specs import minimal_spec, status_errors

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def spec_of(**overrides: Any):
    return parse_spec(minimal_spec(**overrides))


def pod(name: str, phase: str = "Running", ready: bool = True, **fields: Any) -> PodObservation:
    role = "learner" if "-learner-" in name else "rollout"
    return PodObservation(name=name, role=role, phase=phase, ready=ready, **fields)


def running_pods(run: str = "r", replicas: int = 1, nodes: int = 1) -> list[PodObservation]:
    return [pod(f"{run}-rollout-{i}") for i in range(replicas)] + [pod(f"{run}-learner-{r}") for r in range(nodes)]


def report(**fields: Any) -> ProgressReport:
    return ProgressReport.model_validate({"phase": "Running", "groupsTotal": 40, **fields})


def step(spec, status, pods, progress=None, now=T0, **kwargs) -> Decision:
    run = RunRef("r", "ns", "uid-r", kwargs.pop("generation", 1))
    decision = derive_status(run, spec, status, Observation(pods, progress, now, **kwargs))
    assert status_errors(decision.status) == [], decision.status
    return decision


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def reasons(decision: Decision) -> list[str]:
    return [event.reason for event in decision.events]


def running_status(spec, trained: int = 3, now=T0) -> dict[str, Any]:
    first = step(spec, {}, [], now=now)
    progress = report(groupsConsumed=trained, groupsTrained=trained)
    return step(spec, first.status, running_pods(), progress, now=now).status


# --- creation and phases ----------------------------------------------------------------------------------------
def test_a_new_run_is_pending_creates_children_and_declares_every_condition():
    decision = step(spec_of(), {}, [])
    status = decision.status
    assert status["phase"] == "Pending" and status["startTime"] == "2026-01-01T12:00:00Z"
    assert status["observedGeneration"] == 1
    assert decision.actions == [CreateChildren()]
    assert [c["type"] for c in status["conditions"]] == [
        "RolloutReady", "Progressing", "Stalled", "Suspended", "Succeeded", "Failed"]
    assert all(c["status"] == "False" for c in status["conditions"])
    assert reasons(decision)[-1] == "Created"


def _warnings(decision: Decision) -> list[str]:
    return [event.message for event in decision.events if event.type == "Warning"]


def test_a_run_that_would_lose_its_work_with_the_learner_pod_says_so_once_at_start():
    spec = spec_of()  # no checkpoint volume, no output
    first = step(spec, {}, [])
    assert reasons(first) == ["WorkNotKept", "WorkNotKept", "Created"]
    assert [line.split(":")[0] for line in _warnings(first)] == ["spec.checkpoint.volume", "spec.output"]
    assert "a restarted learner starts over" in _warnings(first)[0]
    later = step(spec, first.status, running_pods(), report(groupsTrained=1), now=at(10))
    assert "WorkNotKept" not in reasons(later)


@pytest.mark.parametrize(("checkpoint", "output", "warned"), [
    ({"volume": {"emptyDir": {}}}, {"uri": "s3://models/runs"}, ["spec.checkpoint.volume"]),
    ({"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}, None, []),
    ({"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}, {"volume": {"emptyDir": {}}},
     ["spec.output.volume"]),
])
def test_only_what_a_pods_end_would_lose_is_warned_of(checkpoint, output, warned):
    spec = spec_of(checkpoint=checkpoint, **({"output": output} if output else {}))
    assert [line.split(":")[0] for line in _warnings(step(spec, {}, []))] == warned


def test_a_local_run_keeps_its_work_in_its_folder_and_is_not_warned():
    assert _warnings(step(spec_of(), {}, [], work_kept_locally=True)) == []


def test_children_are_recreated_after_an_operator_restart_only_by_idempotent_create():
    spec = spec_of()
    status = running_status(spec)
    assert step(spec, status, running_pods()).actions == []
    assert step(spec, status, running_pods(), children_exist=False).actions == [CreateChildren()]


def test_phase_moves_pending_starting_running_with_events_on_transitions_only():
    spec = spec_of()
    pending = step(spec, {}, [])
    starting = step(spec, pending.status, [pod("r-rollout-0", ready=False), pod("r-learner-0")], now=at(10))
    assert starting.status["phase"] == "Starting" and reasons(starting) == ["Starting"]
    running = step(spec, starting.status, running_pods(), now=at(20))
    assert running.status["phase"] == "Running"
    assert reasons(running) == ["RolloutReady", "Running"]
    assert condition(running.status, "RolloutReady")["lastTransitionTime"] == "2026-01-01T12:00:20Z"
    again = step(spec, running.status, running_pods(), now=at(30))
    assert again.events == [] and again.actions == []
    assert condition(again.status, "RolloutReady")["lastTransitionTime"] == "2026-01-01T12:00:20Z"


def test_derivation_is_deterministic():
    spec, pods = spec_of(), running_pods()
    status = running_status(spec)
    first = step(spec, status, pods, report(groupsTrained=5), now=at(5))
    second = step(spec, json.loads(json.dumps(status)), pods, report(groupsTrained=5), now=at(5))
    assert first == second


def test_progress_fields_land_in_status():
    spec = spec_of()
    status = running_status(spec)
    decision = step(spec, status, running_pods(), report(groupsConsumed=10, groupsTrained=8, dropped={"no_signal": 2},
                                                         epochsDone=0, globalStep=4, rewardMean=0.5,
                                                         samplesScored=64, samplesMasked={"importance_ratio": 8}),
                  now=at(7))
    progress = decision.status["progress"]
    assert progress == {"epoch": 0, "epochs": 1.0, "groupsConsumed": 10, "groupsTotal": 40, "groupsTrained": 8,
                        "groupsDropped": 2, "groupsRegenerated": 0, "groupsRegeneratedEnvironment": 0,
                        "dropped": {"no_signal": 2, "truncated": 0, "stale": 0, "too_long": 0,
                                                        "unscorable": 0, "lost": 0, "excluded": 0},
                        "stallStreak": 0, "stallLimit": 0, "stalled": False, "globalStep": 4, "percent": 25.0,
                        "rewardMean": 0.5, "maskedFraction": 0.125,
                        # 7 groups in the 7 s since the first sample: 30 to go, 30 s.
                        "progressPercentage": 25, "estimatedRemainingSeconds": 30,
                        "lastUpdatedTime": "2026-01-01T12:00:07Z"}
    assert decision.status["lastProgressTime"] == "2026-01-01T12:00:07Z"
    assert decision.status["progressClock"]["anchorTime"] == "2026-01-01T12:00:07Z"



EPISODES = {"episodes": 16, "rows": 18, "turns": 30, "toolCalls": 14, "toolFailures": 2, "forked": 2,
            "environmentFailures": {"arithmetic": 3, "sandbox": 0}}


def test_a_tool_using_runs_episode_counts_land_in_status_progress():
    """What the learner's /progress says of episodes is status.progress.episodes, under the same names; a field only
    a newer learner knows is not copied (the API server would prune it)."""
    spec = spec_of()
    status = running_status(spec)
    decision = step(spec, status, running_pods(),
                    parse_progress(json.dumps({"phase": "Running", "groupsTotal": 40, "groupsConsumed": 5,
                                               "groupsTrained": 4, "episodes": {**EPISODES, "sandboxSeconds": 9}})),
                    now=at(7))
    assert decision.status["progress"]["episodes"] == EPISODES


def test_a_run_without_tools_has_no_episodes_in_status_progress():
    spec = spec_of()
    with_tools = step(spec, running_status(spec), running_pods(),
                      report(groupsConsumed=4, groupsTrained=4, episodes=EPISODES), now=at(5)).status
    assert "episodes" in with_tools["progress"]
    decision = step(spec, with_tools, running_pods(), report(groupsConsumed=5, groupsTrained=5), now=at(7))
    assert "episodes" not in decision.status["progress"]
    assert decision.status["progress"]["groupsTrained"] == 5


def test_regenerated_groups_and_those_an_environment_caused_are_on_status_progress():
    spec = spec_of()
    decision = step(spec, running_status(spec), running_pods(),
                    report(groupsConsumed=4, groupsTrained=4, regenerated=5, regeneratedEnvironment=3,
                           episodes=EPISODES), now=at(5))
    progress = decision.status["progress"]
    assert (progress["groupsRegenerated"], progress["groupsRegeneratedEnvironment"]) == (5, 3)


def test_a_newer_learners_report_keeps_the_run_progressing_with_what_status_can_hold():
    """A learner image newer than the operator: a drop reason the CRD does not list counts in groupsDropped
    (status.progress.dropped lists the reasons the CRD declares, which the API server would otherwise prune), a
    replica state it does not know leaves the server's state and whether it serves unset (unknown: the learner may
    be holding it back), and Progressing stays True."""
    spec = spec_of()
    status = running_status(spec)
    newer = parse_progress(json.dumps({
        "phase": "Balancing", "groupsTotal": 40, "groupsConsumed": 10, "groupsTrained": 7, "newCounter": 5,
        "dropped": {"no_signal": 1, "reward_timeout": 2},
        "rollout": [{"replica": 0, "url": "u", "ready": True, "state": "warming", "samples": 4, "gpuUtil": 0.9}]}))
    decision = step(spec, status, running_pods(), newer, now=at(7))
    progress = decision.status["progress"]
    assert progress["groupsDropped"] == 3 and progress["dropped"]["no_signal"] == 1
    assert set(progress["dropped"]) == set(DROP_REASONS)
    server = decision.status["rollout"]["servers"][0]
    assert server["samples"] == 4 and "state" not in server and "serving" not in server
    assert condition(decision.status, "Progressing")["status"] == "True"
    assert condition(decision.status, "Stalled")["status"] == "False"

# --- exits ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "deleted"), [("Running", ("r-rollout-0",)),
                                                 ("All", ("r-learner-0", "r-rollout-0")), ("None", None)])
def test_learner_exit_zero_succeeds_and_cleans_pods_per_policy(policy, deleted):
    spec = spec_of(runPolicy={"cleanPodPolicy": policy})
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=38, epochsDone=1)
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    status = decision.status
    assert status["phase"] == "Succeeded" and status["completionTime"] == "2026-01-01T12:01:00Z"
    assert status["progress"]["percent"] == 100.0  # read from the termination message, the learner being gone
    assert condition(status, "Succeeded")["status"] == "True"
    assert condition(status, "Succeeded")["reason"] == "EpochBoundReached"
    assert condition(status, "Failed")["status"] == "False"
    expected = [DeletePods(deleted, reason=f"cleanPodPolicy {policy}")] if deleted else []
    assert decision.actions == expected
    assert "Succeeded" in reasons(decision)


def test_stall_exit_fails_at_once_with_reason_stalled():
    spec = spec_of(runPolicy={"backoffLimit": 5})
    final = report(phase="Stalled", stallStreak=40, stallLimit=40, message="a full pass trained nothing")
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_STALLED, reason="Error",
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    status = decision.status
    assert status["phase"] == "Failed"
    assert condition(status, "Failed")["reason"] == "Stalled"
    assert condition(status, "Stalled")["status"] == "True"
    assert status["failure"] == {"role": "learner", "pod": "r-learner-0", "exitCode": EXIT_STALLED,
                                 "reason": "Stalled", "message": "a full pass trained nothing"}
    assert not any(isinstance(a, RecreatePods) for a in decision.actions)
    assert status.get("restarts", 0) == 0


def test_invalid_config_exit_fails_without_retry():
    spec = spec_of()
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_INVALID_CONFIG,
                                    message="rewards[0].name: unknown reward 'nope'")]
    decision = step(spec, running_status(spec), pods, now=at(5))
    assert condition(decision.status, "Failed")["reason"] == "InvalidConfig"
    assert decision.status["failure"]["message"] == "rewards[0].name: unknown reward 'nope'"


OUTPUT = {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}
EXPORTED = ExportReport(uri="pvc://models/r", path="/var/lib/grpo/model/r", step=12, bytes=4096, sha256="ab" * 32,
                        time=T0.timestamp() + 59)


def test_the_exported_model_goes_on_the_status_with_an_event():
    spec = spec_of(output=OUTPUT)
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=38, output=EXPORTED.to_wire())
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    assert decision.status["phase"] == "Succeeded"
    assert decision.status["output"] == {"uri": "pvc://models/r", "step": 12, "bytes": 4096, "sha256": "ab" * 32,
                                         "time": "2026-01-01T12:00:59Z"}
    exported = next(event for event in decision.events if event.reason == "Exported")
    assert exported.type == "Normal"
    assert exported.message == f"model exported to pvc://models/r: step 12, 4096 bytes, manifest sha256 {'ab' * 32}"
    # A later pass (the run finished) keeps it and says it once.
    again = step(spec, decision.status, pods, None, now=at(65))
    assert again.status["output"] == decision.status["output"] and "Exported" not in reasons(again)


def test_a_learner_killed_after_its_export_fails_the_run_with_the_model_on_the_status():
    """The learner's final report names the exported model, then the pod is killed (137) with no retry left: the
    run fails BackoffLimitExceeded, and status.output still says where the model is."""
    spec = spec_of(output=OUTPUT, runPolicy={"backoffLimit": 0})
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=38, output=EXPORTED.to_wire())
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=137, reason="Error",
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    assert condition(decision.status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert decision.status["output"]["uri"] == "pvc://models/r" and decision.status["output"]["step"] == 12
    assert reasons(decision).count("Exported") == 1


def test_an_export_reported_while_running_stays_on_the_status_whatever_comes_after():
    spec = spec_of(output=OUTPUT, runPolicy={"backoffLimit": 0})
    exported = report(groupsConsumed=40, groupsTrained=38, output=EXPORTED.to_wire())
    decision = step(spec, running_status(spec), running_pods(), exported, now=at(30))
    assert decision.status["phase"] == "Running" and decision.status["output"]["uri"] == "pvc://models/r"
    assert reasons(decision) == ["Exported"]
    # Killed with no termination message of its own: the run fails, the model it exported stays on the status.
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=137, reason="Error", message="")]
    failed = step(spec, decision.status, pods, None, now=at(40))
    assert failed.status["phase"] == "Failed" and failed.status["output"] == decision.status["output"]
    assert "Exported" not in reasons(failed)


TRACKED = TrackedRunReport(tracker="mlflow", run_id="0f1e2d", uri="http://mlflow:5000/#/experiments/3/runs/0f1e2d")


#: The other trackers' runs as the learner reports them: TensorBoard's directory, an offline W&B run's directory.
TRACKED_FILES = [
    TrackedRunReport(tracker="tensorboard", run_id="tiny", uri="/checkpoints/tensorboard"),
    TrackedRunReport(tracker="wandb", run_id="a1b2c3d4",
                     uri="/checkpoints/wandb/wandb/offline-run-20261203_141500-a1b2c3d4"),
]


def test_the_trackers_run_goes_on_the_status_and_stays_while_a_restarted_learner_has_none_yet():
    spec = spec_of(tracking={"mlflow": {"trackingUri": "http://mlflow:5000"}, "tensorboard": {},
                             "wandb": {"project": "grpo", "mode": "offline"}})
    status = running_status(spec)
    assert "tracking" not in status
    runs = [TRACKED, *TRACKED_FILES]
    tracked = step(spec, status, running_pods(), report(groupsTrained=4, tracking=[r.to_wire() for r in runs]),
                   now=at(5))
    assert tracked.status["tracking"] == [
        {"tracker": "mlflow", "runId": "0f1e2d", "uri": "http://mlflow:5000/#/experiments/3/runs/0f1e2d"},
        {"tracker": "tensorboard", "runId": "tiny", "uri": "/checkpoints/tensorboard"},
        {"tracker": "wandb", "runId": "a1b2c3d4", "uri": TRACKED_FILES[1].uri}]
    starting = step(spec, tracked.status, running_pods(), report(groupsTrained=4), now=at(10))
    assert starting.status["tracking"] == tracked.status["tracking"]


def test_a_tracker_left_out_at_start_shows_as_tracking_degraded_until_a_start_reaches_every_tracker():
    spec = spec_of(tracking={"mlflow": {"trackingUri": "http://mlflow:5000"}, "tensorboard": {},
                             "onUnavailable": "continue"})
    status = running_status(spec)
    assert not any(c["type"] == "TrackingDegraded" for c in status["conditions"])  # only once a learner says so
    line = "mlflow: spec.tracking.mlflow.trackingUri: nothing answers at http://mlflow:5000 within 5s (ConnectionError)"
    degraded = step(spec, status, running_pods(), report(groupsTrained=4, tracking=[TRACKED_FILES[0].to_wire()],
                                                         trackingDegraded=[line]), now=at(5))
    condition = next(c for c in degraded.status["conditions"] if c["type"] == "TrackingDegraded")
    assert (condition["status"], condition["reason"], condition["message"]) == ("True", "TrackersUnavailable", line)
    reached = step(spec, degraded.status, running_pods(),
                   report(groupsTrained=5, tracking=[TRACKED.to_wire(), TRACKED_FILES[0].to_wire()]), now=at(10))
    condition = next(c for c in reached.status["conditions"] if c["type"] == "TrackingDegraded")
    assert (condition["status"], condition["reason"]) == ("False", "TrackersReporting")


def test_a_tracker_lost_mid_run_turns_tracking_degraded_with_metrics_lost_and_a_warning_event_once():
    spec = spec_of(tracking={"mlflow": {"trackingUri": "http://mlflow:5000"}, "tensorboard": {},
                             "onUnavailable": "continue"})
    runs = [TRACKED.to_wire(), TRACKED_FILES[0].to_wire()]
    reporting = step(spec, running_status(spec), running_pods(), report(groupsTrained=4, tracking=runs), now=at(5))
    assert not any(c["type"] == "TrackingDegraded" for c in reporting.status["conditions"])
    lost = {"tracker": "mlflow", "since": at(7).timestamp(),
            "reason": "ConnectionError: nothing answers (http://mlflow:5000)"}
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=38, tracking=runs, trackingLost=[lost])
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    ended = step(spec, reporting.status, pods, None, now=at(60))
    assert ended.status["phase"] == "Succeeded"
    degraded = condition(ended.status, "TrackingDegraded")
    message = (f"mlflow lost the run's metrics since {format_time(at(7))}: ConnectionError: nothing answers "
               "(http://mlflow:5000)")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "MetricsLost", message)
    assert [(e.type, e.message) for e in ended.events if e.reason == "MetricsLost"] == [("Warning", message)]
    # Reported on /progress while the run goes on: the event comes once, when the condition turns True.
    running = step(spec, reporting.status, running_pods(), report(groupsTrained=5, tracking=runs, trackingLost=[lost]),
                   now=at(10))
    assert reasons(running).count("MetricsLost") == 1
    assert condition(running.status, "TrackingDegraded")["status"] == "True"
    again = step(spec, running.status, running_pods(), report(groupsTrained=6, tracking=runs, trackingLost=[lost]),
                 now=at(15))
    assert "MetricsLost" not in reasons(again)


def test_a_tracker_left_out_at_start_raises_a_warning_event_when_tracking_degraded_turns_true():
    spec = spec_of(tracking={"mlflow": {"trackingUri": "http://mlflow:5000"}, "onUnavailable": "continue"})
    line = "mlflow: spec.tracking.mlflow.trackingUri: nothing answers at http://mlflow:5000 within 5s (ConnectionError)"
    degraded = step(spec, running_status(spec), running_pods(), report(groupsTrained=4, trackingDegraded=[line]),
                    now=at(5))
    assert [(e.type, e.reason, e.message) for e in degraded.events] == [("Warning", "TrackersUnavailable", line)]
    again = step(spec, degraded.status, running_pods(), report(groupsTrained=5, trackingDegraded=[line]), now=at(10))
    assert "TrackersUnavailable" not in reasons(again)


@pytest.mark.parametrize("termination_message", [
    # a learner image that does not export
    report(phase="Succeeded", groupsConsumed=40, groupsTrained=38).termination_message(),
    report(phase="Succeeded", groupsConsumed=40).termination_message().replace(
        '"output":null', '"output":' + json.dumps({**EXPORTED.to_wire(), "sha256": "not a digest"})),
    None,
])
def test_a_run_with_an_output_never_succeeds_without_its_model(termination_message):
    spec = spec_of(output=OUTPUT)
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0, message=termination_message)]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    assert decision.status["phase"] == "Failed" and "output" not in decision.status
    assert condition(decision.status, "Failed")["reason"] == "ExportFailed"
    assert decision.status["failure"]["reason"] == "ExportFailed"
    assert "without reporting an exported model" in decision.status["failure"]["message"]
    assert not any(isinstance(a, RecreatePods) for a in decision.actions)


def test_without_an_output_a_success_needs_no_model():
    spec = spec_of()
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=38)
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    assert decision.status["phase"] == "Succeeded" and "output" not in decision.status
    assert "Exported" not in reasons(decision)


@pytest.mark.parametrize(("output", "cause"), [
    (OUTPUT, "could not export the model to /var/lib/grpo/model/r: No space left on device "
             "(/var/lib/grpo/model/.r.partial)"),
    ({"uri": "s3://models/r", "credentialsSecret": "s3"},
     "could not upload the model: s3://models/r/grpo-export.json: the secret key (AWS_SECRET_ACCESS_KEY) does not "
     "match the access key (SignatureDoesNotMatch)"),
    ({"uri": "s3://models/r"}, "could not upload the model: s3://models/r/grpo-export.json: the bucket 'models' does "
                               "not exist"),
])
def test_an_export_failure_fails_the_run_at_once_naming_the_cause(output, cause):
    spec = spec_of(output=output, runPolicy={"backoffLimit": 5})
    final = report(phase="Failed", groupsConsumed=40, groupsTrained=38, message=cause)
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_EXPORT_FAILED, reason="Error",
                                    message=final.termination_message())]
    decision = step(spec, running_status(spec), pods, None, now=at(60))
    status = decision.status
    assert status["phase"] == "Failed" and status.get("restarts", 0) == 0
    assert condition(status, "Failed")["reason"] == "ExportFailed"
    assert cause in condition(status, "Failed")["message"]
    assert status["failure"] == {"role": "learner", "pod": "r-learner-0", "exitCode": EXIT_EXPORT_FAILED,
                                 "reason": "ExportFailed", "message": cause}
    assert not any(isinstance(a, RecreatePods) for a in decision.actions)


def test_a_crash_restarts_the_whole_learner_gang_within_the_backoff_limit():
    spec = spec_of(learner={"nodes": 2}, runPolicy={"backoffLimit": 2})
    status = step(spec, step(spec, {}, []).status, running_pods(nodes=2)).status
    pods = [pod("r-rollout-0"), pod("r-learner-0"), pod("r-learner-1", "Failed", False, exit_code=1,
                                                         message="NCCL timeout")]
    decision = step(spec, status, pods, now=at(30))
    assert decision.actions == [RecreatePods(("r-learner-0", "r-learner-1"))]
    assert decision.status["restarts"] == 1 and decision.status["learner"]["restarts"] == 1
    assert decision.status["phase"] == "Pending"
    assert reasons(decision) == ["Restarting", "Pending"]
    assert "restart 1/2" in decision.events[0].message and "NCCL timeout" in decision.events[0].message
    # The next pass sees the pods gone and creates them again.
    assert step(spec, decision.status, [pod("r-rollout-0")], now=at(31)).actions == [CreateChildren()]


def test_a_preempted_learner_restarts_without_counting_against_the_backoff_limit():
    spec = spec_of(runPolicy={"backoffLimit": 1})
    status = {**running_status(spec), "restarts": 1}  # the limit is used up: a crash now would fail the run
    final = report(phase="Preempted", message="preempted: SIGTERM received; checkpoint saved for the restart")
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_PREEMPTED, reason="Error",
                                    message=final.termination_message())]
    decision = step(spec, status, pods, now=at(40))
    assert decision.status["phase"] == "Pending" and decision.status["restarts"] == 1
    assert decision.actions == [RecreatePods(("r-learner-0",))]


def test_a_run_ended_by_max_steps_succeeds_with_its_own_reason():
    spec = spec_of()
    final = report(phase="Succeeded", groupsTotal=40, groupsConsumed=12, groupsTrained=12,
                   message="stopped at max_steps=3 before the epoch bound (12/40 groups consumed): ...")
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    status = step(spec, running_status(spec), pods, None, now=at(60)).status
    assert status["phase"] == "Succeeded"
    assert condition(status, "Succeeded")["reason"] == "MaxStepsReached"
    assert "max_steps=3" in condition(status, "Succeeded")["message"]


def test_a_crash_past_the_backoff_limit_fails_with_the_termination_message():
    spec = spec_of(runPolicy={"backoffLimit": 1})
    status = {**running_status(spec), "restarts": 1}
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=137, reason="OOMKilled",
                                    message="Killed")]
    decision = step(spec, status, pods, now=at(40))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert decision.status["failure"] == {"role": "learner", "pod": "r-learner-0", "exitCode": 137,
                                          "reason": "OOMKilled", "message": "Killed"}
    assert decision.actions == [DeletePods(("r-rollout-0",), reason="cleanPodPolicy Running")]


def test_a_rollout_server_that_exits_is_restarted_alone():
    spec = spec_of(rollout={"replicas": 2})
    status = step(spec, {}, []).status
    pods = [pod("r-rollout-0"), pod("r-rollout-1", "Failed", False, exit_code=1), pod("r-learner-0")]
    decision = step(spec, status, pods, now=at(5))
    assert decision.actions == [RecreatePods(("r-rollout-1",))]


# --- finished runs ----------------------------------------------------------------------------------------------
def test_a_finished_run_never_recreates_children_and_honours_its_ttl():
    spec = spec_of(runPolicy={"ttlSecondsAfterFinished": 60})
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0)]
    finished = step(spec, running_status(spec), pods, now=at(100)).status
    later = step(spec, finished, [], now=at(130), children_exist=False)
    assert later.actions == [] and later.status["phase"] == "Succeeded"
    assert step(spec, finished, [], now=at(160)).actions == [DeleteRun()]


def test_a_finished_run_keeps_cleaning_pods_that_are_still_running():
    spec = spec_of()
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0)]
    finished = step(spec, running_status(spec), pods, now=at(100)).status
    assert step(spec, finished, pods, now=at(101)).actions == [DeletePods(("r-rollout-0",), "cleanPodPolicy Running")]



def test_a_finished_run_claims_no_server_once_its_rollout_pods_go():
    """status.rollout.replicas is the scale subresource's count and `kubectl get`'s: after cleanPodPolicy deleted
    the servers, a finished run shows none, and RolloutReady says why (quietly: no event after the end)."""
    spec = spec_of()
    learner_done = pod("r-learner-0", "Succeeded", False, exit_code=0)
    finished = step(spec, running_status(spec), [pod("r-rollout-0"), learner_done], now=at(100))
    assert finished.actions == [DeletePods(("r-rollout-0",), "cleanPodPolicy Running")]
    going = step(spec, finished.status, [pod("r-rollout-0", terminating=True), learner_done], now=at(101))
    gone = step(spec, going.status, [learner_done], now=at(102))
    for after in (going, gone):
        assert after.actions == [] and after.events == [] and after.status["phase"] == "Succeeded"
        rollout = after.status["rollout"]
        assert (rollout["replicas"], rollout["ready"]) == (0, 0)
        assert rollout["servers"][0]["pod"] == "r-rollout-0" and not rollout["servers"][0]["ready"]
        ready = condition(after.status, "RolloutReady")
        assert (ready["status"], ready["reason"]) == ("False", "Finished")
        assert ready["message"] == "the run has finished: 0/1 rollout servers ready"
        assert after.status["learner"]["ready"] == 0


def test_a_finished_run_that_keeps_its_servers_shows_them():
    spec = spec_of(runPolicy={"cleanPodPolicy": "None"})
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0)]
    finished = step(spec, running_status(spec), pods, now=at(100)).status
    later = step(spec, finished, pods, now=at(101)).status
    assert (later["rollout"]["replicas"], later["rollout"]["ready"]) == (1, 1)
    assert condition(later, "RolloutReady")["status"] == "True"

# --- stall detection --------------------------------------------------------------------------------------------
def test_the_learners_stall_verdict_marks_stalled_and_its_exit_fails_the_run():
    spec = spec_of()
    stalled = report(groupsConsumed=44, groupsTrained=3, stallStreak=40, stallLimit=40, stalled=True,
                     stallCause="streak")
    decision = step(spec, running_status(spec), running_pods(), stalled, now=at(5))
    # The learner ends itself (exit 42 with its final report); the operator does not race that exit.
    assert decision.status["phase"] == "Running" and not decision.actions
    assert condition(decision.status, "Stalled")["reason"] == "StallLimitReached"
    assert condition(decision.status, "Progressing")["status"] == "False"
    assert "Stalled" in reasons(decision)
    exited = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_STALLED,
                                     message=stalled.termination_message())]
    failed = step(spec, decision.status, exited, stalled, now=at(6))
    assert failed.status["phase"] == "Failed"
    assert condition(failed.status, "Failed")["reason"] == "Stalled"
    assert failed.status["failure"]["exitCode"] == EXIT_STALLED and failed.status["failure"]["reason"] == "Stalled"


@pytest.mark.parametrize(("verdict", "streak", "stalled"), [
    ({"stalled": True, "stallCause": "streak"}, 2, "True"),  # a learner whose rule stalls below its limit
    ({"stalled": False}, 40, "False"),  # or not at its limit
    ({}, 40, "False"),  # an older learner, which says it only by stopping as stalled (its exit decides)
])
def test_the_operator_shows_the_learners_verdict_not_a_rule_of_its_own(verdict, streak, stalled):
    spec = spec_of()
    running = report(groupsConsumed=44, groupsTrained=3, stallStreak=streak, stallLimit=40, **verdict)
    decision = step(spec, running_status(spec), running_pods(), running, now=at(5))
    assert decision.status["phase"] == "Running" and not decision.actions
    assert condition(decision.status, "Stalled")["status"] == stalled
    assert decision.status["progress"]["stalled"] is (stalled == "True")


def test_a_stall_rule_changed_in_the_learner_reaches_the_status_with_no_operator_change(monkeypatch):
    from grpo_trainer.contract.codes import LearnerPhase, StallCause
    from grpo_trainer.progress import RolloutProgress, RolloutStop, StallVerdict

    def two_in_a_row(progress):  # a stricter rule than the limit of 40 the report still carries
        return StallVerdict(StallCause.STREAK, "stalled: 2 in a row") if progress.stall_streak >= 2 else None

    monkeypatch.setattr(RolloutProgress, "stall_verdict", two_in_a_row)
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=40, groups_per_epoch=40, epochs=1)
    progress.train([0])
    progress.drop(1, "no_signal")
    spec = spec_of()
    status = running_status(spec, trained=1)
    quiet = step(spec, status, running_pods(), progress.report(phase=LearnerPhase.RUNNING, global_step=1), now=at(5))
    assert condition(quiet.status, "Stalled")["status"] == "False"
    with pytest.raises(RolloutStop):  # the learner's stream stops on its rule
        progress.drop(2, "no_signal")
    learner = progress.report(phase=LearnerPhase.RUNNING, global_step=1)
    assert (learner.stall_streak, learner.stall_limit) == (2, 40)
    decision = step(spec, quiet.status, running_pods(), parse_progress(learner.model_dump_json(by_alias=True)),
                    now=at(6))
    assert condition(decision.status, "Stalled")["reason"] == "StallLimitReached"
    assert "2 groups consumed in a row" in condition(decision.status, "Stalled")["message"]
    assert decision.status["progress"]["stallCause"] == "streak"


@pytest.mark.parametrize(("cause", "reason", "named"), [
    ("nothing_trained", "Stalled", "all 40 groups of the run were consumed and none trained"),
    ("weight_sync", "WeightSyncStuck", "weight sync"),
    ("reward_timeout", "Stalled", "(reward_timeout)"),  # a newer learner's cause, by its name
])
def test_the_stalled_condition_names_the_learners_cause(cause, reason, named):
    spec = spec_of()
    verdict = report(groupsConsumed=40, groupsTrained=0, stalled=True, stallCause=cause)
    decision = step(spec, running_status(spec), running_pods(), verdict, now=at(5))
    assert decision.status["phase"] == "Running"  # the learner's exit decides, with its own message
    assert condition(decision.status, "Stalled")["reason"] == reason
    assert named in condition(decision.status, "Stalled")["message"]
    assert decision.status["progress"]["stallCause"] == cause


def test_the_progress_deadline_fails_the_run_under_policy_fail():
    spec = spec_of(progress={"progressDeadlineSeconds": 100})
    decision = step(spec, running_status(spec, trained=3), running_pods(), report(groupsTrained=3), now=at(100))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "Stalled"
    assert condition(decision.status, "Stalled")["reason"] == "ProgressDeadlineExceeded"
    assert decision.status["failure"]["role"] == "learner" and decision.status["failure"]["reason"] == "Stalled"


def test_policy_report_only_reports_a_stall():
    spec = spec_of(progress={"stallPolicy": "Report"})
    decision = step(spec, running_status(spec), running_pods(), report(groupsTrained=3, stallStreak=40,
                                                                         stallLimit=40, stalled=True,
                                                                         stallCause="streak"), now=at(5))
    assert decision.status["phase"] == "Running"
    assert condition(decision.status, "Stalled")["status"] == "True"
    assert condition(decision.status, "Progressing")["status"] == "False"
    assert not any(isinstance(a, DeletePods) for a in decision.actions)


def test_no_trained_group_for_the_deadline_stalls_and_progress_clears_it():
    spec = spec_of(progress={"progressDeadlineSeconds": 100, "stallPolicy": "Report"})
    status = running_status(spec, trained=3)
    quiet = step(spec, status, running_pods(), report(groupsTrained=3), now=at(99))
    assert condition(quiet.status, "Stalled")["status"] == "False"
    stalled = step(spec, quiet.status, running_pods(), report(groupsTrained=3), now=at(100))
    assert condition(stalled.status, "Stalled")["reason"] == "ProgressDeadlineExceeded"
    assert reasons(stalled) == ["Stalled"]
    still = step(spec, stalled.status, running_pods(), report(groupsTrained=3), now=at(150))
    assert still.events == []  # a transition is announced once
    resumed = step(spec, still.status, running_pods(), report(groupsTrained=4), now=at(160))
    assert condition(resumed.status, "Stalled")["status"] == "False"
    assert condition(resumed.status, "Stalled")["reason"] == "ProgressResumed"
    assert reasons(resumed) == ["ProgressResumed"]


def test_the_stall_clock_pauses_while_pending_and_survives_an_operator_restart():
    spec = spec_of(progress={"progressDeadlineSeconds": 300, "stallPolicy": "Report"})
    status = running_status(spec)  # anchored at T0
    restarting = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1)],
                      now=at(100)).status
    assert restarting["progressClock"]["pausedSince"] == "2026-01-01T12:01:40Z"
    pending = step(spec, restarting, [pod("r-rollout-0"), pod("r-learner-0", "Pending", False)], now=at(350)).status
    assert condition(pending, "Stalled")["status"] == "False"  # 350 s old, but only 100 s of it running
    # A fresh operator has only what is in the status: serialise it and go on.
    resumed = step(spec, json.loads(json.dumps(pending)), running_pods(), now=at(400)).status
    assert resumed["progressClock"]["pausedSeconds"] == 300.0
    assert condition(step(spec, resumed, running_pods(), now=at(599)).status, "Stalled")["status"] == "False"
    assert condition(step(spec, resumed, running_pods(), now=at(600)).status, "Stalled")["status"] == "True"


# --- suspend, deadlines, stuck pods -----------------------------------------------------------------------------
def test_suspend_deletes_pods_keeps_the_run_and_resume_recreates_them():
    spec = spec_of(runPolicy={"suspend": True})
    status = running_status(spec_of())
    suspended = step(spec, status, running_pods(), now=at(10))
    assert suspended.status["phase"] == "Suspended"
    assert suspended.actions == [DeletePods(("r-learner-0", "r-rollout-0"), reason="suspended")]
    assert condition(suspended.status, "Suspended")["status"] == "True"
    assert reasons(suspended) == ["Suspended"]
    assert step(spec, suspended.status, [], now=at(20)).events == []
    resumed = step(spec_of(), suspended.status, [], now=at(1000))
    assert resumed.actions == [CreateChildren()]
    assert resumed.status["startTime"] == "2026-01-01T12:16:40Z"  # the active deadline counts from the resume
    assert condition(resumed.status, "Suspended")["reason"] == "Resumed"
    assert "Resumed" in reasons(resumed)


def test_active_deadline_fails_the_run():
    spec = spec_of(runPolicy={"activeDeadlineSeconds": 600})
    status = running_status(spec)
    assert step(spec, status, running_pods(), now=at(599)).status["phase"] == "Running"
    decision = step(spec, status, running_pods(), now=at(600))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "DeadlineExceeded"
    assert decision.actions == [DeletePods(("r-learner-0", "r-rollout-0"), reason="cleanPodPolicy Running")]


def test_a_pod_stuck_on_an_image_pull_surfaces_and_then_hits_the_startup_deadline():
    spec = spec_of(progress={"startupDeadlineSeconds": 900})
    created = step(spec, {}, []).status
    stuck = [pod("r-rollout-0", "Pending", False, waiting_reason="ImagePullBackOff",
                 message='Back-off pulling image "vllm:nope"'), pod("r-learner-0")]
    first = step(spec, created, stuck, now=at(60))
    assert condition(first.status, "Progressing")["reason"] == "ImagePullBackOff"
    assert "r-rollout-0" in first.status["message"] and "vllm:nope" in first.status["message"]
    assert reasons(first) == ["ImagePullBackOff"]
    assert step(spec, first.status, stuck, now=at(120)).events == []
    failed = step(spec, first.status, stuck, now=at(900))
    assert failed.status["phase"] == "Failed"
    assert condition(failed.status, "Failed")["reason"] == "StartupDeadlineExceeded"
    assert "ImagePullBackOff" in condition(failed.status, "Failed")["message"]


def test_an_unschedulable_pod_surfaces_its_reason():
    spec = spec_of()
    pods = [pod("r-rollout-0", "Pending", False, reason="Unschedulable", message="0/3 nodes have nvidia.com/gpu"),
            pod("r-learner-0", "Pending", False)]
    decision = step(spec, step(spec, {}, []).status, pods, now=at(5))
    assert decision.status["phase"] == "Pending"
    assert condition(decision.status, "Progressing")["reason"] == "Unschedulable"


def test_the_newest_checkpoint_in_the_object_store_goes_on_the_status_and_stays_through_a_restart():
    spec = spec_of(checkpoint={"uri": "s3://ckpts/r"})
    uploaded = {"step": 20, "uri": "s3://ckpts/r/checkpoint-20", "time": T0.timestamp() + 29}
    decision = step(spec, running_status(spec), running_pods(),
                    report(groupsConsumed=40, groupsTrained=38, checkpoint=uploaded), now=at(30))
    assert decision.status["checkpoint"] == {"step": 20, "uri": "s3://ckpts/r/checkpoint-20",
                                             "time": "2026-01-01T12:00:29Z"}
    # A learner restarted on another node reports none until its own first upload: the last one stays.
    restarted = step(spec, decision.status, running_pods(), report(groupsConsumed=40, groupsTrained=38), now=at(40))
    assert restarted.status["checkpoint"] == decision.status["checkpoint"]
