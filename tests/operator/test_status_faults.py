"""The pure state machine under a real cluster's faults: pods being deleted, disruptions, replayed passes, an
unreadable progress endpoint, an unready rollout server, transient create errors (the status package)."""

from __future__ import annotations

from grpo_operator.status import CreateChildren, RecreatePods
from grpo_trainer.contract import EXIT_STALLED
from tests.operator.test_status import at, condition, pod, reasons, report, running_pods, running_status, spec_of, step


def test_a_pod_being_deleted_holds_its_slot_and_the_run_says_it_waits_for_it():
    spec = spec_of()
    status = running_status(spec)
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1, terminating=True)]
    decision = step(spec, status, pods, now=at(10))
    assert CreateChildren() not in decision.actions  # a create now would be a 409 on the old pod's name
    assert decision.status["phase"] == "Pending"
    assert condition(decision.status, "Progressing")["reason"] == "PodTerminating"
    assert "r-learner-0 is being deleted" in decision.status["message"]
    assert decision.status.get("restarts", 0) == 0  # its exit was handled when it was deleted


def test_waiting_to_run_again_is_bounded_by_the_startup_deadline():
    spec = spec_of(progress={"startupDeadlineSeconds": 60})
    status = running_status(spec)
    waiting = [pod("r-rollout-0"), pod("r-learner-0", "Running", terminating=True)]
    status = step(spec, status, waiting, now=at(10)).status
    assert status["phase"] == "Pending"
    decision = step(spec, status, waiting, now=at(71))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "StartupDeadlineExceeded"
    assert "waited 61 s" in decision.status["message"] and "r-learner-0" in decision.status["message"]


def test_a_disruption_restarts_the_gang_without_counting_against_the_backoff_limit():
    spec = spec_of(learner={"nodes": 2}, runPolicy={"backoffLimit": 0, "maxDisruptions": 1})
    status = running_status(spec)
    pods = [pod("r-rollout-0"), pod("r-learner-0"),
            pod("r-learner-1", "Failed", False, exit_code=137, disruption="PreemptionByScheduler")]
    decision = step(spec, status, pods, now=at(10))
    assert decision.actions == [RecreatePods(("r-learner-0", "r-learner-1"))]
    assert decision.status["disruptions"] == 1 and decision.status.get("restarts", 0) == 0
    assert reasons(decision)[0] == "Disrupted" and decision.status["phase"] == "Pending"
    again = step(spec, {**decision.status, "phase": "Running"}, pods, now=at(20))
    assert again.status["phase"] == "Failed"
    assert condition(again.status, "Failed")["reason"] == "DisruptionLimitExceeded"


def test_a_learner_pod_removed_from_a_running_gang_restarts_the_gang():
    spec = spec_of(learner={"nodes": 2})
    status = step(spec, step(spec, {}, []).status, running_pods(nodes=2)).status
    decision = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0")], now=at(10))
    assert decision.actions == [RecreatePods(("r-learner-0",))]
    assert decision.status["disruptions"] == 1


def test_a_replayed_pass_does_not_count_the_same_crash_twice():
    spec = spec_of(runPolicy={"backoffLimit": 3})
    status = running_status(spec)
    crashed = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1, attempt=0)]
    first = step(spec, status, crashed, now=at(10))
    assert first.status["restarts"] == 1
    replayed = step(spec, first.status, crashed, now=at(11))  # the delete failed: the same pod again
    assert replayed.actions == [RecreatePods(("r-learner-0",))]
    assert replayed.status["restarts"] == 1 and "Restarting" not in reasons(replayed)


def test_unreadable_progress_is_unknown_and_never_fails_the_run():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Fail"})
    status = running_status(spec)
    decision = step(spec, status, running_pods(), now=at(100), progress_error="connection refused")
    assert decision.status["phase"] == "Running"
    assert condition(decision.status, "Stalled")["status"] == "Unknown"
    assert condition(decision.status, "Stalled")["reason"] == "ProgressUnknown"
    assert "ProgressUnknown" in reasons(decision)
    # Before the deadline a single failed read changes nothing; several in a row are reported.
    quiet = step(spec, status, running_pods(), now=at(5), progress_error="timeout")
    assert condition(quiet.status, "Stalled")["status"] == "False"
    lost = step(spec, status, running_pods(), now=at(5), progress_error="timeout", progress_lost=True)
    assert condition(lost.status, "Stalled")["reason"] == "ProgressUnknown"


def test_an_unready_rollout_server_keeps_a_running_run_running_and_its_clock_counting():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Report"})
    status = running_status(spec)
    unready = [pod("r-rollout-0", ready=False), pod("r-learner-0")]
    decision = step(spec, status, unready, now=at(10))
    assert decision.status["phase"] == "Running" and "Starting" not in reasons(decision)
    assert condition(decision.status, "RolloutReady")["status"] == "False"
    assert "ReplicasNotReady" in reasons(decision)
    later = step(spec, decision.status, unready, now=at(40))
    assert condition(later.status, "Stalled")["reason"] == "ProgressDeadlineExceeded"


def test_a_restarted_learner_back_at_its_checkpoint_is_not_idle():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Report"})
    status = running_status(spec, trained=20)
    resumed = step(spec, status, running_pods(), report(groupsConsumed=12, groupsTrained=12), now=at(25))
    later = step(spec, resumed.status, running_pods(), report(groupsConsumed=12, groupsTrained=12), now=at(40))
    assert condition(later.status, "Stalled")["status"] == "False"


def test_a_transient_create_error_shows_on_progressing_and_the_run_keeps_going():
    spec = spec_of()
    decision = step(spec, {}, [], create_error="creating Pod r-learner-0 failed (HTTP 403): exceeded quota")
    assert decision.status["phase"] == "Pending" and decision.actions == [CreateChildren()]
    assert condition(decision.status, "Progressing")["reason"] == "CreateFailed"
    assert "CreateFailed" in reasons(decision)


def test_the_pod_failure_policy_decides_before_the_defaults():
    spec = spec_of(runPolicy={"backoffLimit": 3, "podFailurePolicy": [
        {"action": "Fail", "onExitCodes": {"operator": "In", "values": [3]}},
        {"action": "Restart", "onExitCodes": {"operator": "In", "values": [42]}},
        {"action": "Ignore", "onPodConditions": [{"type": "NodeLost"}]},
    ]})
    status = running_status(spec)

    def crash(**fields):
        return step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, **fields)], now=at(10))

    failed = crash(exit_code=3)
    assert failed.status["phase"] == "Failed"
    assert condition(failed.status, "Failed")["reason"] == "PodFailurePolicy"
    restarted = crash(exit_code=42)  # stalled exits fail by default; this run's policy restarts them
    assert restarted.status["phase"] == "Pending" and restarted.status["restarts"] == 1
    ignored = crash(exit_code=137, conditions=frozenset({"NodeLost"}))
    assert ignored.status["disruptions"] == 1 and ignored.status.get("restarts", 0) == 0
    default = crash(exit_code=78)
    assert condition(default.status, "Failed")["reason"] == "InvalidConfig"


# --- a weight sync past its deadline ------------------------------------------------------------------------------
def _sync_stuck_exit(attempt: int | None = None):
    final = report(phase="Stalled", stallCause="weight_sync", groupsConsumed=3, groupsTrained=3,
                   message="weight sync stuck: still running after 60s")
    return [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=EXIT_STALLED, reason="Error",
                                    message=final.termination_message(), attempt=attempt)]


def test_a_stuck_weight_sync_fails_the_run_as_weight_sync_stuck_under_policy_fail():
    spec = spec_of(runPolicy={"backoffLimit": 5})
    decision = step(spec, running_status(spec), _sync_stuck_exit(), now=at(60))
    status = decision.status
    assert status["phase"] == "Failed"
    assert condition(status, "Stalled")["status"] == "True"
    assert condition(status, "Stalled")["reason"] == condition(status, "Failed")["reason"] == "WeightSyncStuck"
    assert status["failure"]["reason"] == "WeightSyncStuck" and status["failure"]["exitCode"] == EXIT_STALLED
    assert "weight sync stuck" in status["failure"]["message"]
    assert not any(isinstance(a, RecreatePods) for a in decision.actions)


def test_a_stuck_weight_sync_restarts_under_policy_report_and_stays_stalled_until_a_group_trains():
    spec = spec_of(progress={"stallPolicy": "Report"}, runPolicy={"backoffLimit": 1})
    decision = step(spec, running_status(spec), _sync_stuck_exit(attempt=0), now=at(60))
    assert decision.actions == [RecreatePods(("r-learner-0",))]
    assert decision.status["restarts"] == 1 and decision.status["phase"] == "Pending"
    assert condition(decision.status, "Stalled")["reason"] == "WeightSyncStuck"
    assert "WeightSyncStuck" in reasons(decision)
    # Back up, at its checkpoint: still stalled until a group trains again.
    back = step(spec, decision.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(70))
    assert condition(back.status, "Stalled")["status"] == "True"
    trained = step(spec, back.status, running_pods(), report(groupsConsumed=5, groupsTrained=5), now=at(80))
    assert condition(trained.status, "Stalled")["reason"] == "ProgressResumed"
    # Its backoff limit is the crash's: the next stuck sync fails the run, still named.
    again = step(spec, trained.status, _sync_stuck_exit(attempt=1), now=at(90))
    assert again.status["phase"] == "Failed"
    assert condition(again.status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert condition(again.status, "Stalled")["reason"] == "WeightSyncStuck"
