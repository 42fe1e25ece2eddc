"""The real kopf operator against the API emulator under the faults of a real cluster: pods stuck Terminating,
evictions and preemptions, a run re-created while its old pods linger, transient API errors, an unreachable
progress endpoint, an unready rollout server, a replaced rollout server, a failed delete, and a spec from a newer CRD.

Where a case depends on it, the emulator is made as strict as the real API server (graceful pod deletion, an
asynchronous garbage collector, injected error answers); tests/support/emulator/kube_emulator.py describes each mode.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest

from grpo_operator.api import KIND
from grpo_operator.cluster.kube import Kube
from grpo_operator.cluster.reconcile import ClusterRun
from tests.support.specs import MULTI_RANK_ROLLOUT, grporun, minimal_spec

pytestmark = pytest.mark.slow


def _running(cluster, learner, progress_urls, name: str, spec: dict[str, Any]) -> None:
    cluster.apply(grporun(name, spec))
    progress_urls[f"{name}-learner-0"] = learner.url()
    cluster.bring_up(name, pods=spec["rollout"]["replicas"] + spec["learner"]["nodes"])
    learner.update(groups_consumed=4, groups_trained=3, global_step=2)
    cluster.wait_for(lambda: (cluster.status(name).get("progress") or {}).get("groupsTrained") == 3,
                     what=f"{name} to report 3 trained groups")
    cluster.wait_phase(name, "Running")


def _uid(cluster, pod: str) -> str | None:
    found = cluster.kubelet.pod(pod)
    return found["metadata"]["uid"] if found else None


@pytest.mark.parametrize("emulator_options", [{"graceful_pod_deletion": True}])
def test_a_pod_stuck_terminating_is_waited_for_and_the_wait_is_bounded(cluster, learner, progress_urls):
    # The default startup deadline (an hour) while the run comes up and while the test reads the wait: a short one
    # from the start would also bound how soon the operator first reads the learner, and the test the status.
    _running(cluster, learner, progress_urls, "term", minimal_spec(runPolicy={"backoffLimit": 2}))
    cluster.kubelet.exit("term-learner-0", 1, "RuntimeError: NCCL timeout")
    # The operator deletes the crashed pod; its node is gone, so it stays Terminating and keeps its name.
    cluster.wait_for(lambda: (p := cluster.kubelet.pod("term-learner-0")) and p["metadata"].get("deletionTimestamp"),
                     what="the learner pod marked for deletion")
    status = cluster.wait_for(lambda: (s := cluster.status("term")).get("message") and s, what="a waiting message")
    assert status["phase"] == "Pending" and "term-learner-0 is being deleted" in status["message"]
    # A deadline edit applies on the next pass, counted from when the run left Running: the wait ends here.
    cluster.patch_spec("term", {"progress": {"startupDeadlineSeconds": 1}})
    status = cluster.wait_phase("term", "Failed")
    assert cluster.condition("term", "Failed")["reason"] == "StartupDeadlineExceeded"
    assert "waited" in status["message"] and "term-learner-0 is being deleted" in status["message"]


@pytest.mark.parametrize("emulator_options", [{"graceful_pod_deletion": True}])
def test_a_terminating_pod_is_recreated_once_it_is_gone(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "gone", minimal_spec())
    old = _uid(cluster, "gone-learner-0")
    cluster.kubelet.exit("gone-learner-0", 1, "Killed")
    cluster.wait_for(lambda: cluster.kubelet.pod("gone-learner-0")["metadata"].get("deletionTimestamp"),
                     what="the learner pod marked for deletion")
    cluster.kubelet.confirm_deletion("gone-learner-0")
    cluster.wait_for(lambda: _uid(cluster, "gone-learner-0") not in (None, old), what="the learner pod recreated")
    cluster.kubelet.run("gone-learner-0")
    cluster.wait_phase("gone", "Running")
    assert cluster.status("gone")["restarts"] == 1


def test_an_oom_killed_learner_says_so_with_its_container_and_memory_limit(cluster, learner, progress_urls):
    spec = minimal_spec(learner={"resources": {"limits": {"memory": "3Gi"}}})
    _running(cluster, learner, progress_urls, "oom", spec)
    cluster.kubelet.exit("oom-learner-0", 137, reason="OOMKilled")
    cluster.wait_event("oom", "Restarting")
    event = next(e for e in cluster.events("oom") if e["reason"] == "Restarting")
    assert "OOMKilled" in event["message"] and "container learner" in event["message"], event["message"]
    assert "memory limit 3Gi" in event["message"]
    assert cluster.status("oom")["restarts"] == 1


def test_a_preempted_learner_restarts_the_gang_without_using_up_the_backoff_limit(cluster, learner, progress_urls):
    spec = minimal_spec(learner={"nodes": 2}, rollout=MULTI_RANK_ROLLOUT, runPolicy={"backoffLimit": 0})
    _running(cluster, learner, progress_urls, "pre", spec)
    rank0 = _uid(cluster, "pre-learner-0")
    cluster.kubelet.disrupt("pre-learner-1", "PreemptionByScheduler")
    cluster.wait_for(lambda: _uid(cluster, "pre-learner-0") not in (None, rank0), what="the whole gang recreated")
    status = cluster.status("pre")
    assert status["phase"] != "Failed" and status.get("restarts", 0) == 0 and status["disruptions"] == 1
    cluster.wait_event("pre", "Disrupted")


def test_a_learner_pod_evicted_from_a_running_gang_restarts_the_gang(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "evict", minimal_spec(learner={"nodes": 2}, rollout=MULTI_RANK_ROLLOUT))
    rank0 = _uid(cluster, "evict-learner-0")
    cluster.evict("evict-learner-1")
    cluster.wait_for(lambda: _uid(cluster, "evict-learner-0") not in (None, rank0),
                     what="rank 0 recreated with the new rank 1, not left waiting on an ended rendezvous")
    assert cluster.status("evict")["disruptions"] == 1 and cluster.status("evict").get("restarts", 0) == 0


@pytest.mark.parametrize("emulator_options", [{"deferred_gc": True}])
def test_a_run_recreated_under_the_same_name_does_not_adopt_the_old_runs_pods(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "again", minimal_spec())
    learner.update(phase="Succeeded", groups_consumed=40, groups_trained=40, epochs_done=1)
    cluster.kubelet.exit("again-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("again", "Succeeded")
    # A finished run's rollout server goes once the run is Succeeded (its deletion may still be under way then).
    cluster.wait_for(lambda: cluster.pod_names("again") == ["again-learner-0"], what="the rollout server removed")
    cluster.delete_run("again")
    cluster.wait_for(lambda: cluster.run("again") is None, what="the old run gone")
    assert cluster.pod_names("again") == ["again-learner-0"]  # the garbage collector has not caught up yet
    new = cluster.apply(grporun("again", minimal_spec()))
    status = cluster.wait_for(lambda: (s := cluster.status("again")).get("message") and s, what="a waiting message")
    assert status["phase"] == "Pending" and "earlier run" in status["message"]
    cluster.collect_garbage()
    cluster.wait_for(lambda: len(cluster.pods("again")) == 2, what="the new run's pods")
    owners = {p["metadata"]["ownerReferences"][0]["uid"] for p in cluster.pods("again")}
    owners |= {c["metadata"]["ownerReferences"][0]["uid"] for c in cluster.config_maps("again")}
    assert owners == {new["metadata"]["uid"]}
    assert cluster.status("again")["phase"] != "Succeeded"


def test_a_quota_error_on_create_is_retried_and_shown_not_fatal(cluster):
    cluster.limit_pods(0)
    cluster.apply(grporun("quota", minimal_spec()))
    cluster.wait_for(lambda: (cluster.condition("quota", "Progressing") or {}).get("reason") == "CreateFailed",
                     what="the create failure on a condition")
    assert "exceeded quota" in cluster.condition("quota", "Progressing")["message"]
    cluster.limit_pods(None)
    cluster.wait_for(lambda: len(cluster.pods("quota")) == 2, timeout=20, what="the pods, once the quota allows")
    assert cluster.status("quota")["phase"] == "Pending"
    cluster.wait_event("quota", "CreateFailed")


def _accelerated_clock(factor: float):
    """The operator's clock running `factor` times faster than the wall: minutes of its backoffs and retries in
    seconds of test."""
    start_wall, start = time.monotonic(), datetime.datetime.now(datetime.UTC)
    return lambda: start + datetime.timedelta(seconds=(time.monotonic() - start_wall) * factor)


def test_a_create_blocked_for_a_minute_makes_a_handful_of_events_at_most(cluster):
    clock = _accelerated_clock(20)
    cluster.operator.context.clock = clock
    cluster.limit_pods(0)
    cluster.apply(grporun("storm", minimal_spec()))
    cluster.wait_for(lambda: (cluster.condition("storm", "Progressing") or {}).get("reason") == "CreateFailed",
                     what="the create failure on a condition")
    blocked_since = clock()
    cluster.wait_for(lambda: clock() - blocked_since > datetime.timedelta(seconds=60),
                     what="a minute of the operator's time with the create blocked")
    assert cluster.condition("storm", "Progressing")["reason"] == "CreateFailed"
    failed = [e for e in cluster.events("storm") if e["reason"] == "CreateFailed"]
    assert len(failed) == 1, [e["message"] for e in failed]
    assert failed[0]["count"] == 1
    # the start's own (Created, and WorkNotKept for a spec without volumes) aside
    assert len([e for e in cluster.events("storm") if e["reason"] != "WorkNotKept"]) <= 3, \
        cluster.event_reasons("storm")


def test_an_event_that_comes_again_is_counted_on_one_object(cluster, learner, progress_urls):
    """The Kubernetes event recorder's aggregation: the same object, type, reason and message again moves the
    Event's count and lastTimestamp instead of adding an Event."""
    cluster.apply(grporun("flap", minimal_spec(progress={"stallPolicy": "Report"})))
    cluster.bring_up("flap")
    for _ in range(2):  # /progress refuses connections, then answers, twice over
        progress_urls.pop("flap-learner-0", None)
        cluster.wait_for(lambda: cluster.condition("flap", "Stalled")["status"] == "Unknown", what="an outage")
        progress_urls["flap-learner-0"] = learner.url()
        cluster.wait_for(lambda: cluster.condition("flap", "Stalled")["status"] == "False", what="reports again")
    cluster.wait_for(lambda: [e["count"] for e in cluster.events("flap") if e["reason"] == "ProgressResumed"] == [2],
                     what="the second ProgressResumed counted on the first one's Event")
    unknown = [e for e in cluster.events("flap") if e["reason"] == "ProgressUnknown"]
    assert [e["count"] for e in unknown] == [2] and unknown[0]["type"] == "Warning"
    assert unknown[0]["lastTimestamp"] >= unknown[0]["firstTimestamp"]


def test_an_invalid_child_fails_the_run_and_removes_the_pods_already_created(cluster):
    # The learner pod alone is refused, after the rollout pod was created: 422 is permanent.
    cluster.refuse_pod("bad-learner-0", 'Pod "bad-learner-0" is invalid: spec.tolerations[0].effect: Unsupported')
    cluster.apply(grporun("bad", minimal_spec()))
    cluster.wait_phase("bad", "Failed")
    assert cluster.condition("bad", "Failed")["reason"] == "InvalidSpec"
    assert cluster.pods_ever_created("bad") == ["bad-rollout-0"]
    cluster.wait_for(lambda: cluster.pods("bad") == [], what="the rollout pod removed with the failed run")


def _status_writes_by_pass(monkeypatch, runs: set[str]) -> dict[str, list[list[str | None]]]:
    """Run -> for each of its passes, the phase of each status write the operator made in it (None: a write that
    leaves the phase as it was). A pass begins with its observe (ClusterRun.observe, once per pass); a write belongs
    to the pass in flight (one run's passes never overlap)."""
    passes: dict[str, list[list[str | None]]] = {run: [] for run in runs}
    observe, patch_status = ClusterRun.observe, Kube.patch_status

    async def observing(port: ClusterRun):
        if port.run.name in passes:
            passes[port.run.name].append([])
        return await observe(port)

    async def patching(kube: Kube, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]):
        if kind == KIND and name in passes:
            passes[name][-1].append(patch.get("phase"))
        return await patch_status(kube, api_version, kind, namespace, name, patch)

    monkeypatch.setattr(ClusterRun, "observe", observing)
    monkeypatch.setattr(Kube, "patch_status", patching)
    return passes


def test_a_run_that_fails_as_invalid_spec_writes_its_status_once_per_pass(cluster, monkeypatch):
    """InvalidSpec is decided by the state machine like any other end: a pass writes the status once, then acts. A
    child the API server refuses (an action that fails) ends the run on the next pass, with the pods the refused
    pass had created deleted; a spec the operator cannot run ends it on the pass that reads it."""
    writes = _status_writes_by_pass(monkeypatch, {"refused", "unrunnable"})
    cluster.refuse_pod("refused-learner-0", 'Pod "refused-learner-0" is invalid: spec.tolerations[0].effect: bad')
    cluster.apply(grporun("refused", minimal_spec()))
    cluster.apply(grporun("unrunnable", minimal_spec(rewards=[{"name": "nope"}])))
    for run in ("refused", "unrunnable"):
        cluster.wait_phase(run, "Failed")
        assert cluster.condition(run, "Failed")["reason"] == "InvalidSpec"
    cluster.wait_for(lambda: cluster.pods("refused") == [], what="the refused run's rollout pod deleted")
    cluster.wait_idle("refused")
    cluster.wait_idle("unrunnable")
    for run, passes in writes.items():
        assert [pass_ for pass_ in passes if len(pass_) > 1] == [], (run, passes)
        assert [phase for pass_ in passes for phase in pass_ if phase is not None][-1] == "Failed", (run, passes)
    assert [phase for pass_ in writes["refused"] for phase in pass_ if phase] == ["Pending", "Failed"]


def test_a_pod_security_refusal_fails_the_run_at_once_with_the_policys_message(cluster):
    # RDMA's IPC_LOCK, which podTemplateOverride allows, is a capability the `restricted` profile forbids.
    violation = 'unrestricted capabilities (container "learner" must not include "IPC_LOCK" in ' \
                'securityContext.capabilities.add)'
    cluster.enforce_restricted_pod_security("psa-learner-0", violation)
    learner = {"podTemplateOverride": {"spec": {"containers": [
        {"name": "learner", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}}}
    cluster.apply(grporun("psa", minimal_spec(learner=learner)))
    cluster.wait_phase("psa", "Failed")
    failed = cluster.condition("psa", "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert 'violates PodSecurity "restricted' in failed["message"] and "IPC_LOCK" in failed["message"], failed
    assert cluster.pods_ever_created("psa") == ["psa-rollout-0"]  # no retries of the refused pod, no new pods
    cluster.wait_for(lambda: cluster.pods("psa") == [], what="the rollout pod removed with the failed run")
    assert "CreateFailed" not in cluster.event_reasons("psa")


def test_unreadable_progress_is_reported_as_unknown_never_as_a_stall(cluster):
    spec = minimal_spec(progress={"progressDeadlineSeconds": 1, "stallPolicy": "Fail"})
    cluster.apply(grporun("blind", spec))  # no progress URL registered: the learner's port refuses connections
    cluster.bring_up("blind")
    cluster.wait_for(lambda: (cluster.condition("blind", "Stalled") or {}).get("reason") == "ProgressUnknown",
                     what="Stalled=Unknown with ProgressUnknown")
    assert cluster.condition("blind", "Stalled")["status"] == "Unknown"
    cluster.wait_event("blind", "ProgressUnknown")
    # Well past progressDeadlineSeconds, the run still runs: missing data alone never fails it.
    time.sleep(3)  # three times progressDeadlineSeconds: the old operator failed the run as Stalled by now
    assert cluster.status("blind")["phase"] == "Running"


def test_a_report_status_cannot_hold_is_shown_as_unknown_and_the_next_good_one_is_written(
        cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "odd", minimal_spec())
    good = 3
    for bad, field in (('{"phase": "Running", "groupsTotal": 40, "rewardMean": NaN}', "rewardMean"),
                       ('{"phase": "Running", "groupsTotal": 40, "globalStep": 99999999999999999999}', "globalStep"),
                       ('{"phase": "Running", "groupsTotal": 40, "globalStep": 1e400, "rewardMean": NaN}',
                        "globalStep")):
        learner.answer(bad)
        progressing = cluster.wait_for(
            lambda: (c := cluster.condition("odd", "Progressing"))["status"] == "Unknown" and c,
            what=f"Progressing=Unknown for a report with a bad {field}")
        assert progressing["reason"] == "ProgressUnknown" and f"invalid report: {field}: " in progressing["message"]
        assert cluster.status("odd")["phase"] == "Running"
        good += 1
        learner.update(groups_consumed=good + 1, groups_trained=good, global_step=good, reward_mean=0.5)
        cluster.wait_for(lambda good=good: (cluster.status("odd").get("progress") or {}).get("groupsTrained") == good,
                         what="the next good report written")
        assert cluster.condition("odd", "Progressing")["status"] == "True"
        assert cluster.condition("odd", "Stalled")["status"] == "False"


def test_a_final_report_status_cannot_hold_does_not_keep_the_run_from_finishing(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "last", minimal_spec())
    cluster.kubelet.exit("last-learner-0", 0, '{"phase": "Succeeded", "groupsTotal": 40, "groupsConsumed": 40, '
                         '"groupsTrained": 40, "rewardMean": NaN, "globalStep": 99999999999999999999}')
    cluster.wait_phase("last", "Succeeded")
    assert cluster.status("last")["progress"]["groupsTrained"] == 3  # the last report that could be read


def test_stalled_clears_once_the_progress_endpoint_answers_again(cluster, learner, progress_urls):
    spec = minimal_spec(progress={"progressDeadlineSeconds": 60, "stallPolicy": "Report"})
    cluster.apply(grporun("outage", spec))  # no progress URL yet: the learner's port refuses connections
    cluster.bring_up("outage")
    cluster.wait_for(lambda: (cluster.condition("outage", "Stalled") or {}).get("status") == "Unknown",
                     what="Stalled=Unknown while /progress cannot be read")
    progress_urls["outage-learner-0"] = learner.url()  # the outage ends
    learner.update(groups_consumed=2, groups_trained=2)
    cluster.wait_for(lambda: cluster.condition("outage", "Stalled")["status"] == "False",
                     what="Stalled=False once reports come again")
    assert cluster.condition("outage", "Stalled")["reason"] == "ProgressResumed"
    assert cluster.condition("outage", "Progressing")["status"] == "True"


def test_an_unready_rollout_server_keeps_the_run_running_and_its_clock_counting(cluster, learner, progress_urls):
    spec = minimal_spec(progress={"progressDeadlineSeconds": 2, "stallPolicy": "Report"})
    _running(cluster, learner, progress_urls, "hung", spec)
    cluster.kubelet.run("hung-rollout-0", ready=False)  # a hung vLLM server fails its readiness probe
    cluster.wait_for(lambda: cluster.condition("hung", "RolloutReady")["status"] == "False", what="RolloutReady=False")
    cluster.wait_for(lambda: cluster.condition("hung", "Stalled")["status"] == "True", timeout=15,
                     what="the progress deadline to trip while the server is unready")
    assert cluster.status("hung")["phase"] == "Running"
    assert "Starting" not in cluster.event_reasons("hung")


def test_with_its_only_rollout_server_replaced_the_run_waits_running_and_its_clock_counts(
        cluster, learner, progress_urls):
    spec = minimal_spec(progress={"progressDeadlineSeconds": 2, "stallPolicy": "Report"})
    _running(cluster, learner, progress_urls, "solo", spec)
    old = _uid(cluster, "solo-rollout-0")
    cluster.kubelet.exit("solo-rollout-0", 0, "grpo rollout: vLLM exited with code 0: RuntimeError: engine died")
    cluster.wait_for(lambda: _uid(cluster, "solo-rollout-0") not in (None, old), what="the server replaced")
    cluster.wait_for(lambda: cluster.condition("solo", "Stalled")["status"] == "True", timeout=15,
                     what="the progress deadline to trip while the learner waits for its only server")
    status = cluster.status("solo")
    assert status["phase"] == "Running" and "Pending" not in cluster.event_reasons("solo")
    ready = cluster.condition("solo", "RolloutReady")
    assert ready["reason"] == "RolloutRestarting" and "RuntimeError: engine died" in ready["message"]
    cluster.kubelet.run("solo-rollout-0")
    cluster.wait_for(lambda: cluster.condition("solo", "RolloutReady")["status"] == "True", what="RolloutReady")


def test_a_failed_delete_does_not_count_one_crash_twice(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "twice", minimal_spec(runPolicy={"backoffLimit": 3}))
    old = _uid(cluster, "twice-learner-0")
    cluster.emulator_thread.call(lambda: cluster.emulator.inject_fault(
        "DELETE", "pods", 409, "Conflict", "Precondition failed: UID in precondition", name="twice-learner-0"))
    cluster.kubelet.exit("twice-learner-0", 1, "Killed")
    cluster.wait_for(lambda: _uid(cluster, "twice-learner-0") not in (None, old), what="the learner pod recreated")
    assert cluster.status("twice")["restarts"] == 1


def test_spec_fields_from_a_newer_crd_are_ignored_not_fatal(cluster):
    spec = minimal_spec()
    spec["runPolicy"]["priorityClassName"] = "high"  # a field a newer CRD defaults, unknown to this operator
    cluster.apply(grporun("newer", spec))
    cluster.wait_for(lambda: len(cluster.pods("newer")) == 2, what="the run's pods")
    assert cluster.status("newer")["phase"] == "Pending"


def test_a_spec_edited_while_suspended_is_applied_whole_on_resume(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "edit", minimal_spec())
    cluster.patch_spec("edit", {"runPolicy": {"suspend": True}})
    cluster.wait_phase("edit", "Suspended")
    cluster.wait_for(lambda: cluster.pods("edit") == [], what="the pods deleted")
    # Two servers need filesystem weight sync (NCCL serves one; the real API server refuses the pair).
    cluster.patch_spec("edit", {"rollout": {"replicas": 2, "weightSync": {
        "mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}})
    run = cluster.patch_spec("edit", {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods("edit")) == 3, what="two rollout pods and the learner")
    config_map = cluster.wait_for(
        lambda: next((c for c in cluster.config_maps("edit")
                      if c["metadata"]["annotations"]["grpo.dev/generation"] == str(run["metadata"]["generation"])),
                     None), what="the config rendered again")
    assert len(json.loads(config_map["data"]["run.json"])["rollout"]["urls"]) == 2
    assert cluster.status("edit")["observedGeneration"] == run["metadata"]["generation"]


def _status_writes(cluster, run: str) -> int:
    log = cluster.emulator_thread.call(lambda: list(cluster.emulator.request_log))
    return sum(1 for r in log if r.method == "PATCH" and r.resource == "grporuns" and r.subresource == "status"
               and r.name == run)


def test_progress_alone_is_written_at_most_every_status_interval(cluster, learner, progress_urls):
    cluster.apply(grporun("calm", minimal_spec(progress={"statusIntervalSeconds": 3600})))
    progress_urls["calm-learner-0"] = learner.url()
    learner.update(groups_consumed=3, groups_trained=3)
    cluster.bring_up("calm")
    cluster.wait_for(lambda: (cluster.status("calm").get("progress") or {}).get("groupsTrained") == 3,
                     what="the first progress, written with the move to Running")
    writes = _status_writes(cluster, "calm")
    learner.update(groups_consumed=5, groups_trained=5)
    cluster.wait_for(lambda: cluster.metric("grpo_operator_run_groups_trained", "calm") == 5,
                     what="the new progress in the operator's metrics")
    learner.update(groups_consumed=6, groups_trained=6)
    cluster.wait_for(lambda: cluster.metric("grpo_operator_run_groups_trained", "calm") == 6,
                     what="more progress in the operator's metrics")
    assert _status_writes(cluster, "calm") == writes
    assert cluster.status("calm")["progress"]["groupsTrained"] == 3
    cluster.kubelet.run("calm-rollout-0", ready=False)  # a condition change is written at once, progress with it
    cluster.wait_for(lambda: cluster.condition("calm", "RolloutReady")["status"] == "False", what="RolloutReady")
    assert cluster.status("calm")["progress"]["groupsTrained"] == 6


def test_a_model_past_its_named_gpus_memory_fails_the_run_before_any_pod_starts(cluster, tmp_path):
    # The operator reads config.json where its own filesystem has the model (here: a Qwen2.5-7B shape); a DDP
    # learner needs ~122 GiB on one 80 GB H100.
    (tmp_path / "qwen7b").mkdir()
    (tmp_path / "qwen7b" / "config.json").write_text(json.dumps({
        "hidden_size": 3584, "num_hidden_layers": 28, "vocab_size": 152064, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}))
    learner = {"resources": {"limits": {"nvidia.com/gpu": 1}},
               "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    cluster.apply(grporun("big", minimal_spec(model=str(tmp_path / "qwen7b"), learner=learner)))
    cluster.wait_phase("big", "Failed")
    failed = cluster.condition("big", "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert failed["message"].startswith("spec.learner: the learner needs ~"), failed
    assert "GiB per GPU under ddp" in failed["message"]
    assert "ways out, each estimated the same way: learner.strategy fsdp2 over 2 GPUs" in failed["message"]
    assert cluster.pods_ever_created("big") == []
