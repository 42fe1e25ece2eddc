"""The rollout servers in the pure status derivation: `status.rollout` per server (the pod's readiness and the
learner's view of it), and rollout restarts with their own counter and limit, apart from `runPolicy.backoffLimit`.
"""

from __future__ import annotations

import sys

from grpo_operator.status import CreateChildren, ProbeFailure, RecreatePods
from grpo_operator.status.rollout_exits import rollout_error_line
from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG
from grpo_trainer.server import main as rollout
from tests.operator.test_status import at, condition, pod, reasons, report, running_pods, running_status, spec_of, step

ENGINE_ERROR = "RuntimeError: CPU Generator does not use offset"
#: What the rollout entrypoint writes as its termination message when vLLM exits after its engine died.
SUMMARY = f"{rollout.EXIT_LINE_PREFIX}vLLM exited with code 0: {ENGINE_ERROR}"
#: What the kubelet falls back to (FallbackToLogsOnError) when the entrypoint itself was killed: the log's tail.
LOG_TAIL = "\n".join([
    "(EngineCore pid=812) ERROR 11-30 17:15:11 [core.py:866] " + ENGINE_ERROR,
    "(APIServer pid=700) ERROR 11-30 17:15:11 [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "nanobind: leaked 12 instances!",
])


def running_with(spec, replicas: int) -> dict:
    first = step(spec, {}, [])
    return step(spec, first.status, running_pods(replicas=replicas), report(groupsConsumed=3, groupsTrained=3)).status


def crashed(name: str, code: int = 0, message: str = SUMMARY, restarts: int = 0):
    return pod(name, "Succeeded" if code == 0 else "Failed", False, exit_code=code, message=message,
               reason="Completed" if code == 0 else "Error", rollout_restarts=restarts)


def test_a_rollout_server_that_exits_zero_is_restarted_alone_without_using_the_backoff_limit():
    spec = spec_of(rollout={"replicas": 2}, runPolicy={"backoffLimit": 0})
    status = running_with(spec, 2)
    assert status["phase"] == "Running"
    pods = [pod("r-rollout-0"), crashed("r-rollout-1"), pod("r-learner-0")]
    decision = step(spec, status, pods, now=at(5))
    assert decision.actions == [RecreatePods(("r-rollout-1",))]
    new = decision.status
    assert new["phase"] == "Running" and new.get("restarts", 0) == 0 and new.get("disruptions", 0) == 0
    assert new["rollout"]["restarts"] == 1
    server = new["rollout"]["servers"][1]
    assert server["pod"] == "r-rollout-1" and server["restarts"] == 1 and server["lastError"] == ENGINE_ERROR
    assert new["rollout"]["servers"][0]["restarts"] == 0
    assert "RolloutRestarted" in reasons(decision)
    event = next(e for e in decision.events if e.reason == "RolloutRestarted")
    assert "restart 1/3" in event.message and ENGINE_ERROR in event.message


def test_a_crash_whose_delete_did_not_happen_is_not_counted_twice():
    spec = spec_of()
    status = running_status(spec)
    pods = [crashed("r-rollout-0"), pod("r-learner-0")]
    first = step(spec, status, pods, now=at(5))
    replay = step(spec, first.status, pods, now=at(10))  # the same pod: created at restart 0, counted already
    assert replay.actions == [RecreatePods(("r-rollout-0",))]
    assert replay.status["rollout"]["restarts"] == 1 and "RolloutRestarted" not in reasons(replay)


def test_the_run_fails_with_the_engine_error_once_a_server_has_used_up_its_restarts():
    spec = spec_of(runPolicy={"rolloutRestartLimit": 1})
    status = step(spec, running_status(spec), [crashed("r-rollout-0"), pod("r-learner-0")], now=at(5)).status
    again = [crashed("r-rollout-0", code=1, message=LOG_TAIL, restarts=1), pod("r-learner-0")]
    decision = step(spec, status, again, now=at(60))
    new = decision.status
    assert new["phase"] == "Failed"
    assert condition(new, "Failed")["reason"] == "RolloutRestartLimitExceeded"
    assert new["message"] == ("rollout pod r-rollout-0 exited with code 1 after 1 restarts "
                              f"(runPolicy.rolloutRestartLimit 1): {ENGINE_ERROR}")
    assert new["failure"] == {"role": "rollout", "pod": "r-rollout-0", "exitCode": 1,
                              "reason": "RolloutRestartLimitExceeded", "message": ENGINE_ERROR}
    assert "nanobind" not in str(new)


def test_a_limit_of_zero_fails_the_run_at_the_first_exit():
    spec = spec_of(runPolicy={"rolloutRestartLimit": 0, "backoffLimit": 5})
    decision = step(spec, running_status(spec), [crashed("r-rollout-0"), pod("r-learner-0")], now=at(5))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "RolloutRestartLimitExceeded"


def test_with_its_only_server_down_a_run_waits_running_with_its_clock_counting():
    spec = spec_of(progress={"progressDeadlineSeconds": 30, "stallPolicy": "Report"})
    status = step(spec, running_status(spec), [crashed("r-rollout-0"), pod("r-learner-0")], now=at(5)).status
    gone = step(spec, status, [pod("r-learner-0")], now=at(6))  # deleted: its slot is free, created again
    assert gone.actions == [CreateChildren()]
    assert gone.status["phase"] == "Running"
    ready = condition(gone.status, "RolloutReady")
    assert ready["status"] == "False" and ready["reason"] == "RolloutRestarting"
    assert "r-rollout-0" in ready["message"] and ENGINE_ERROR in ready["message"]
    pending = [pod("r-rollout-0", "Pending", False, rollout_restarts=1), pod("r-learner-0")]
    waiting = step(spec, gone.status, pending, now=at(20))
    assert waiting.status["phase"] == "Running" and "Pending" not in reasons(waiting)
    stalled = step(spec, waiting.status, pending, now=at(40))  # the wait is bounded by the progress deadline
    assert condition(stalled.status, "Stalled")["reason"] == "ProgressDeadlineExceeded"
    back = step(spec, stalled.status, [pod("r-rollout-0", rollout_restarts=1), pod("r-learner-0")], now=at(41))
    assert condition(back.status, "RolloutReady")["reason"] == "AllReplicasReady"
    assert back.status["rollout"]["servers"][0]["restarts"] == 1  # the count stays: it is the limit's


def test_status_rollout_shows_each_server_as_the_pods_and_the_learner_see_it():
    spec = spec_of(rollout={"replicas": 2})
    status = running_with(spec, 2)
    servers = [
        {"replica": 0, "url": "http://r-rollout-0.r-rollout:8000", "ready": True, "weightVersion": "v3",
         "samples": 96},
        {"replica": 1, "url": "http://r-rollout-1.r-rollout:8000", "ready": False, "weightVersion": "v2",
         "samples": 80, "failures": 2, "lastError": "connection refused"},
    ]
    pods = [pod("r-rollout-0"), pod("r-rollout-1", ready=False), pod("r-learner-0")]
    decision = step(spec, status, pods, report(groupsConsumed=5, groupsTrained=5, rollout=servers), now=at(5))
    assert decision.status["rollout"] == {
        "replicas": 2, "ready": 1, "restarts": 0, "selector": "grpo.dev/run=r,grpo.dev/role=rollout", "servers": [
            {"replica": 0, "pod": "r-rollout-0", "ready": True, "serving": True, "weightVersion": "v3",
             "samples": 96, "restarts": 0, "state": "serving"},
            {"replica": 1, "pod": "r-rollout-1", "ready": False, "serving": False, "weightVersion": "v2",
             "samples": 80, "restarts": 0, "state": "serving"},
        ]}
    # The learner's view is kept while it cannot be read (a learner restart, a poll that timed out).
    unread = step(spec, decision.status, running_pods(replicas=2), None, now=at(10))
    assert unread.status["rollout"]["servers"][1] == {"replica": 1, "pod": "r-rollout-1", "ready": True,
                                                      "serving": False, "weightVersion": "v2", "samples": 80,
                                                      "restarts": 0, "state": "serving"}


def test_the_engine_error_line_comes_from_the_summary_or_the_log_tail():
    assert rollout_error_line(SUMMARY) == ENGINE_ERROR
    assert rollout_error_line(LOG_TAIL) == ENGINE_ERROR
    assert rollout_error_line(f"{rollout.EXIT_LINE_PREFIX}vLLM exited with code 137") is None
    assert rollout_error_line("OOMKilled") is None


def test_the_rollout_entrypoint_writes_the_line_the_operator_reads(tmp_path, capsys):
    """The real entrypoint's termination message, from a server that prints an engine error and exits 0."""
    script = f"import sys; print('{ENGINE_ERROR}'); print('nanobind: leaked 3 instances!'); sys.exit(0)"
    log = tmp_path / "termination-log"
    log.write_text("")
    assert rollout.serve([sys.executable, "-c", script], {}, termination_log=str(log)) == 0
    assert rollout_error_line(log.read_text()) == ENGINE_ERROR


def test_a_disrupted_rollout_server_is_recreated_while_the_run_goes_on():
    spec = spec_of(rollout={"replicas": 2}, runPolicy={"backoffLimit": 0})
    status = running_with(spec, 2)
    evicted = pod("r-rollout-1", "Failed", False, exit_code=137, disruption="EvictionByEvictionAPI")
    decision = step(spec, status, [pod("r-rollout-0"), evicted, pod("r-learner-0")], now=at(5))
    assert decision.actions == [RecreatePods(("r-rollout-1",))]
    assert decision.status["phase"] == "Running" and decision.status["disruptions"] == 1
    assert decision.status["rollout"]["restarts"] == 0  # a disruption is not the server's failure
    assert "Pending" not in reasons(decision)


def test_a_replaced_server_that_cannot_be_scheduled_says_so_on_rollout_ready():
    spec = spec_of()
    status = step(spec, running_status(spec), [crashed("r-rollout-0"), pod("r-learner-0")], now=at(5)).status
    unschedulable = pod("r-rollout-0", "Pending", False, reason="Unschedulable", rollout_restarts=1,
                        message="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    decision = step(spec, status, [unschedulable, pod("r-learner-0")], now=at(10))
    assert decision.status["phase"] == "Running"
    ready = condition(decision.status, "RolloutReady")
    assert ready["reason"] == "RolloutRestarting"
    assert ready["message"] == (
        f"0/1 rollout servers ready; r-rollout-0 is not ready, restarted 1/3 times, last exit: {ENGINE_ERROR}, "
        "Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")


def test_a_server_whose_probe_fails_says_the_kubelets_words_on_rollout_ready():
    spec = spec_of()
    first = step(spec, {}, [])
    failing = ProbeFailure("startup", "command timed out", count=2, seconds=300)
    starting = [pod("r-rollout-0", ready=False, probe_failure=failing), pod("r-learner-0")]
    ready = condition(step(spec, first.status, starting, now=at(5)).status, "RolloutReady")
    assert (ready["reason"], ready["message"]) == ("ReplicasNotReady", "0/1 rollout servers ready; r-rollout-0 is not "
                                                   "ready, startup probe failed: command timed out (2 times in 300 s)")


def test_a_server_refusing_its_config_fails_the_run_at_once():
    """The rollout entrypoint exits 78 on a config it cannot read: a new pod would read the same one."""
    spec = spec_of()
    refused = crashed("r-rollout-0", code=EXIT_INVALID_CONFIG, message="grpo rollout: run.json: unreadable")
    decision = step(spec, running_status(spec), [refused, pod("r-learner-0")], now=at(5))
    assert decision.status["phase"] == "Failed"
    assert condition(decision.status, "Failed")["reason"] == "InvalidConfig"
