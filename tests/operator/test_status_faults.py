"""The pure state machine under a real cluster's faults: pods being deleted, disruptions, replayed passes, an
unreadable progress endpoint, an unready rollout server, transient create errors (the status package)."""

from __future__ import annotations

from grpo_operator.status import CreateChildren, RecreatePods
from grpo_trainer.contract.codes import EXIT_STALLED
from tests.operator.test_status import at, condition, pod, reasons, report, running_pods, running_status, spec_of, step


def test_a_pod_being_deleted_holds_its_slot_and_the_run_says_it_waits_for_it():
    spec = spec_of()
    crashed = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1, attempt=0)]
    restarting = step(spec, running_status(spec), crashed, now=at(5))  # the operator deletes the crashed pod
    assert restarting.actions == [RecreatePods(("r-learner-0",))]
    pods = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1, terminating=True, attempt=0)]
    decision = step(spec, restarting.status, pods, now=at(10))
    assert CreateChildren() not in decision.actions  # a create now would be a 409 on the old pod's name
    assert decision.status["phase"] == "Pending"
    assert condition(decision.status, "Progressing")["reason"] == "PodTerminating"
    assert "r-learner-0 is being deleted" in decision.status["message"]
    assert decision.status["restarts"] == 1 and decision.status.get("disruptions", 0) == 0  # its exit, counted once


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


def test_a_learner_pod_seen_terminating_in_a_running_gang_restarts_the_gang_once_it_is_gone():
    # The Eviction API or `kubectl delete pod` of one rank: a pass may see it Terminating before it is gone. Rank 0
    # must not be left alone waiting on a rendezvous that ended, then joined by a new rank 1.
    spec = spec_of(learner={"nodes": 2})
    status = step(spec, step(spec, {}, []).status, running_pods(nodes=2)).status
    evicted = [pod("r-rollout-0"), pod("r-learner-0"), pod("r-learner-1", terminating=True)]
    decision = step(spec, status, evicted, now=at(10))
    assert decision.actions == [RecreatePods(("r-learner-0",))]
    assert decision.status["disruptions"] == 1 and decision.status.get("restarts", 0) == 0
    gone = step(spec, decision.status, [pod("r-rollout-0"), pod("r-learner-0", terminating=True)], now=at(11))
    assert gone.status["disruptions"] == 1  # one removal, counted once
    assert RecreatePods(("r-learner-0",)) not in gone.actions


def test_a_drained_run_whose_only_learner_is_terminating_counts_one_disruption():
    # `kubectl drain`: the Eviction API takes every pod of a one-learner run at once. A pass that sees them all
    # Terminating must count the disruption then: once they are gone the gaps look like pods still to create.
    spec = spec_of()
    status = running_status(spec)
    drained = [pod("r-rollout-0", terminating=True), pod("r-learner-0", terminating=True)]
    decision = step(spec, status, drained, now=at(10))
    assert decision.status["phase"] == "Pending" and decision.status["disruptions"] == 1, decision.status
    assert decision.status.get("restarts", 0) == 0 and "Disrupted" in reasons(decision)
    [disrupted] = [e.message for e in decision.events if e.reason == "Disrupted"]
    assert disrupted.endswith("resuming from the last checkpoint"), disrupted  # the learner does not go on
    assert not [a for a in decision.actions if isinstance(a, RecreatePods)]  # both are going already
    gone = step(spec, decision.status, [], now=at(11))
    assert gone.status["disruptions"] == 1  # one drain, counted once
    assert any(isinstance(a, CreateChildren) for a in gone.actions)


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


def test_stalled_returns_to_false_when_progress_can_be_read_again():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Report"})
    status = running_status(spec)
    lost = step(spec, status, running_pods(), now=at(5), progress_error="timeout", progress_lost=True)
    assert condition(lost.status, "Stalled")["status"] == "Unknown"
    back = step(spec, lost.status, running_pods(), report(groupsConsumed=4, groupsTrained=4), now=at(10))
    stalled = condition(back.status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("False", "ProgressResumed")
    assert condition(back.status, "Progressing")["reason"] == "Training"
    assert "ProgressResumed" in reasons(back)
    # A report that trained nothing new clears it too: the progress is known again, and within the deadline.
    same = step(spec, lost.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(10))
    assert condition(same.status, "Stalled")["status"] == "False"


def test_no_report_the_learner_can_send_makes_a_status_the_api_server_refuses():
    """The largest values the report accepts, through every derived field (totals, percentages, the estimate)."""
    spec = spec_of()
    most = 2**63 - 1
    status = running_status(spec)
    for now, consumed in ((10, 4), (80, 5), (150, 6)):  # samples a minute apart: the estimate is computed
        hostile = report(groupsTotal=most, groupsConsumed=consumed, groupsTrained=consumed, globalStep=most,
                         dropped={"lost": most // 2, "stale": most // 2}, stallStreak=most - 1, stallLimit=most,
                         epochsDone=most, epochs=1.7e308, rewardMean=-1.7e308)
        status = step(spec, status, running_pods(), hostile, now=at(now)).status  # step() checks status_errors
    assert status["phase"] == "Running" and status["progress"]["globalStep"] == most
    assert status["progress"]["estimatedRemainingSeconds"] == most  # years beyond count, capped to what int64 holds
    assert status["trainerStatus"]["estimatedRemainingSeconds"] == 2**31 - 1  # KEP-2779's int32


def test_a_termination_message_is_read_under_the_same_rules_as_a_report():
    spec = spec_of()
    status = running_status(spec)
    final = '{"phase": "Succeeded", "groupsTotal": 40, "groupsConsumed": 40, "groupsTrained": 40, "rewardMean": NaN}'
    done = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                                      message=final)], now=at(10))
    assert done.status["phase"] == "Succeeded"
    assert done.status["progress"]["groupsTrained"] == 3  # the refused report changed nothing: the last good one
    huge = final.replace("NaN", "0.5").replace('"groupsTrained": 40', f'"groupsTrained": {2**64}')
    crashed = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1,
                                                         message=huge)], now=at(10))
    assert crashed.status["progress"]["groupsTrained"] == 3 and crashed.status["restarts"] == 1


def test_an_oom_killed_learner_is_named_so_with_its_container_and_memory_limit():
    spec = spec_of(runPolicy={"backoffLimit": 1})
    status = running_status(spec)
    oom = dict(exit_code=137, reason="OOMKilled", container="learner", memory_limit="16Gi")
    restarted = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, **oom)], now=at(10))
    event = next(e for e in restarted.events if e.reason == "Restarting")
    message = condition(restarted.status, "Progressing")["message"]
    for text in (event.message, message):
        assert "OOMKilled" in text and "container learner" in text and "memory limit 16Gi" in text, text
    failed = step(spec, {**restarted.status, "phase": "Running"},
                  [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, attempt=1, **oom)], now=at(20))
    assert failed.status["phase"] == "Failed" and failed.status["failure"]["reason"] == "OOMKilled"
    for text in (condition(failed.status, "Failed")["message"],
                 next(e for e in failed.events if e.reason == "BackoffLimitExceeded").message):
        assert "OOMKilled" in text and "memory limit 16Gi" in text, text
    unlimited = step(spec, status, [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=137,
                                                           reason="OOMKilled", container="learner")], now=at(10))
    assert "no memory limit" in condition(unlimited.status, "Progressing")["message"]


def test_a_create_blocked_for_a_minute_is_one_event_not_one_a_pass():
    spec = spec_of()
    error = "creating Pod r-rollout-0 failed (HTTP 403): exceeded quota: pods; retrying"
    status, events = {}, []
    for second in range(0, 61, 5):  # a pass every 5 s (the default interval) for 60 s
        decision = step(spec, status, [], now=at(second), create_error=error, children_exist=False)
        status, events = decision.status, events + reasons(decision)
    assert events.count("CreateFailed") == 1, events
    assert condition(status, "Progressing")["reason"] == "CreateFailed"


def test_a_stuck_pod_while_a_create_is_blocked_is_one_event_each():
    spec = spec_of(rollout={"replicas": 2})
    error = "creating Pod r-rollout-1 failed (HTTP 403): exceeded quota: pods; retrying"
    stuck = [pod("r-rollout-0", "Pending", False, waiting_reason="ImagePullBackOff", message="back-off pulling"),
             pod("r-learner-0", "Pending", False)]
    status, events = {}, []
    for second in range(0, 61, 5):
        decision = step(spec, status, stuck, now=at(second), create_error=error if second < 40 else None)
        status, events = decision.status, events + reasons(decision)
    assert events.count("CreateFailed") == 1 and events.count("ImagePullBackOff") == 1, events
    assert condition(status, "Progressing")["reason"] == "ImagePullBackOff"

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
    # The verdict was the ended learner's: while the new one starts, the run waits for its pods, still Stalled.
    assert decision.status["progress"]["stalled"] is False
    pending = [pod("r-rollout-0"), pod("r-learner-0", "Pending", False)]
    waiting = step(spec, decision.status, pending, now=at(65))
    assert condition(waiting.status, "Progressing")["reason"] == "PodsPending"
    assert condition(waiting.status, "Stalled")["reason"] == "WeightSyncStuck"
    # Back up, at its checkpoint: still stalled until a group trains again.
    back = step(spec, waiting.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(70))
    assert condition(back.status, "Stalled")["status"] == "True"
    trained = step(spec, back.status, running_pods(), report(groupsConsumed=5, groupsTrained=5), now=at(80))
    assert condition(trained.status, "Stalled")["reason"] == "ProgressResumed"
    # Its backoff limit is the crash's: the next stuck sync fails the run, still named.
    again = step(spec, trained.status, _sync_stuck_exit(attempt=1), now=at(90))
    assert again.status["phase"] == "Failed"
    assert condition(again.status, "Failed")["reason"] == "BackoffLimitExceeded"
    assert condition(again.status, "Stalled")["reason"] == "WeightSyncStuck"


def test_a_learner_waiting_for_an_environment_says_so_and_its_clock_pauses_until_it_trains_again():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Fail"})
    status = running_status(spec)
    waiting = report(groupsConsumed=3, groupsTrained=3, environmentWait="waiting for environment guess: 0/2 ready")
    decision = step(spec, status, running_pods(), waiting, now=at(10))
    assert decision.status["phase"] == "Running"
    assert decision.status["message"] == "waiting for environment guess: 0/2 ready"
    assert condition(decision.status, "Progressing")["reason"] == "WaitingForEnvironment"
    assert "WaitingForEnvironment" in reasons(decision)
    # Well past progressDeadlineSeconds: the learner bounds this wait itself (unavailableSeconds), not the clock.
    later = step(spec, decision.status, running_pods(), waiting, now=at(100))
    assert later.status["phase"] == "Running" and condition(later.status, "Stalled")["status"] == "False"
    back = step(spec, later.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(110))
    assert condition(back.status, "Progressing")["reason"] == "Training" and back.status.get("message") is None
    # The clock counts again from where the wait paused it: 10 s before the wait, 25 s after it.
    assert condition(step(spec, back.status, running_pods(), report(groupsConsumed=3, groupsTrained=3),
                          now=at(125)).status, "Stalled")["status"] == "False"
    gone = step(spec, back.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(135))
    assert condition(gone.status, "Stalled")["reason"] == "ProgressDeadlineExceeded"
