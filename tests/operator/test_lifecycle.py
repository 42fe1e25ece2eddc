"""The real kopf operator against the API emulator: whole lifecycles, pods driven the way a kubelet would.

Each test applies a GRPORun, plays kubelet (PATCH pod /status: Running+ready, terminated with an exit code and a
termination message) and learner (a real ProgressServer on 127.0.0.1), and reads back what the operator wrote.
Every status the operator writes is checked against the CRD's status schema by the emulator (422 otherwise).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
import yaml

from grpo_operator.api import CONTROLLER_NAME, FINALIZER, KOPF_ANNOTATION_PREFIX
from grpo_operator.cluster import probe_events
from grpo_trainer.contract.codes import EXIT_STALLED
from tests.support.emulator.kube_emulator import GRPORUNS, SERVICES
from tests.support.emulator.operator_fixtures import TEST_IMAGE_ID
from tests.support.paths import REPO
from tests.support.specs import MULTI_RANK_ROLLOUT, NAMESPACE, grporun, minimal_spec

pytestmark = pytest.mark.slow


def _owner(run: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": run["metadata"]["name"],
            "uid": run["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _running(cluster, learner, progress_urls, name: str, spec: dict[str, Any] | None = None) -> None:
    """Apply a run, bring its pods up and have the learner report some trained groups."""
    spec = spec or minimal_spec()
    cluster.apply(grporun(name, spec))
    progress_urls[f"{name}-learner-0"] = learner.url()
    cluster.bring_up(name, pods=spec["rollout"]["replicas"] + spec["learner"]["nodes"])
    learner.update(groups_consumed=4, groups_trained=3, dropped={"no_signal": 1}, global_step=2)
    cluster.wait_trained(name, learner, 3)
    cluster.wait_phase(name, "Running")


def printer_columns(obj: dict[str, Any]) -> dict[str, Any]:
    """Evaluate the CRD's printer-column JSONPaths on `obj` (the forms the CRD uses: dotted paths, one filter)."""
    crd = yaml.safe_load((REPO / "crds" / "grporun.yaml").read_text())
    columns = {}
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        value: Any = obj
        for part in re.findall(r'\.(\w+)(?:\[\?\(@\.(\w+)=="(\w+)"\)\])?', column["jsonPath"]):
            key, filter_key, filter_value = part
            value = (value or {}).get(key)
            if filter_key:
                value = next((item for item in value or [] if item.get(filter_key) == filter_value), None)
        columns[column["name"]] = value
    return columns


def test_apply_creates_config_map_services_and_pods_owned_by_the_run(cluster):
    # Two servers need filesystem weight sync (NCCL serves one; the real API server refuses the pair).
    two_servers = {"replicas": 2, "weightSync": {"mode": "filesystem",
                                                 "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}
    run = cluster.apply(grporun("alpha", minimal_spec(rollout=two_servers)))
    cluster.wait_for(lambda: len(cluster.pods("alpha")) == 3, what="3 pods")
    assert cluster.pod_names("alpha") == ["alpha-learner-0", "alpha-rollout-0", "alpha-rollout-1"]
    assert sorted(s["metadata"]["name"] for s in cluster.services("alpha")) == ["alpha-learner", "alpha-rollout"]
    assert [c["metadata"]["name"] for c in cluster.config_maps("alpha")] == ["alpha-config"]
    for child in cluster.pods("alpha") + cluster.services("alpha") + cluster.config_maps("alpha"):
        assert child["metadata"]["ownerReferences"] == [_owner(run)]
    status = cluster.wait_phase("alpha", "Pending")
    assert status["observedGeneration"] == 1
    assert not cluster.run("alpha")["metadata"].get("finalizers")  # deletion never waits for the operator
    cluster.wait_event("alpha", "Created")


def test_a_run_another_controller_manages_gets_no_children_and_no_status(cluster):
    """spec.managedBy names Kueue's MultiKueue (which runs it on a worker cluster): as the Job controller does, the
    operator creates nothing for it and writes nothing onto it. A run of its own applied after it is reconciled,
    so the operator has seen both."""
    cluster.apply(grporun("elsewhere", minimal_spec(managedBy="kueue.x-k8s.io/multikueue")))
    cluster.apply(grporun("ours"))
    cluster.wait_for(lambda: len(cluster.pods("ours")) == 2, what="the operator's own run's pods")
    cluster.wait_phase("ours", "Pending")
    run = cluster.run("elsewhere")
    assert run["spec"]["managedBy"] == "kueue.x-k8s.io/multikueue"
    assert cluster.pods("elsewhere") == [] and cluster.services("elsewhere") == []
    assert cluster.config_maps("elsewhere") == [] and cluster.events("elsewhere") == []
    assert not run.get("status") and not run["metadata"].get("finalizers")
    assert not [key for key in run["metadata"].get("annotations") or {} if key.startswith(KOPF_ANNOTATION_PREFIX)]
    assert cluster.run("ours")["spec"]["managedBy"] == CONTROLLER_NAME  # the default: this operator


def test_deleting_a_run_completes_with_no_operator_running_and_its_children_go(cluster):
    cluster.apply(grporun("delta"))
    cluster.wait_for(lambda: len(cluster.pods("delta")) == 2, what="2 pods")
    cluster.stop_operator()
    cluster.client.delete(GRPORUNS, NAMESPACE, "delta")  # `kubectl delete grporun delta`
    assert cluster.run("delta") is None
    assert not cluster.pods("delta") and not cluster.services("delta") and not cluster.config_maps("delta")


def test_a_run_still_carrying_the_old_finalizer_loses_it_and_can_be_deleted(cluster):
    run = grporun("epsilon")
    run["metadata"]["finalizers"] = [FINALIZER]  # left by an operator that used one
    cluster.apply(run)
    cluster.wait_for(lambda: not cluster.run("epsilon")["metadata"].get("finalizers"), what="the finalizer removed")
    cluster.wait_for(lambda: len(cluster.pods("epsilon")) == 2, what="2 pods")  # and the run is reconciled
    cluster.stop_operator()
    cluster.client.delete(GRPORUNS, NAMESPACE, "epsilon")
    assert cluster.run("epsilon") is None


def test_learner_progress_lands_in_status_and_printer_columns(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "beta")
    learner.update(groups_consumed=10, groups_trained=8, dropped={"no_signal": 2}, epochs_done=0, global_step=4)
    cluster.wait_trained("beta", learner, 8)
    run = cluster.run("beta")
    progress = run["status"]["progress"]
    assert progress["groupsConsumed"] == 10 and progress["groupsTotal"] == 40 and progress["globalStep"] == 4
    assert progress["dropped"]["no_signal"] == 2
    assert run["status"]["lastProgressTime"]
    assert printer_columns(run) == {"Phase": "Running", "Progress": 25.0, "Epoch": 0, "Trained": 8, "Dropped": 2,
                                    "ETA": progress.get("estimatedRemainingSeconds"), "Servers": 1,
                                    "Stalled": "False", "Output": None,
                                    "Age": run["metadata"]["creationTimestamp"]}
    assert cluster.condition("beta", "RolloutReady")["status"] == "True"
    assert cluster.condition("beta", "Progressing")["reason"] == "Training"
    # Kubeflow Trainer's status.trainerStatus (KEP-2779), as the API server stored it.
    trainer = run["status"]["trainerStatus"]
    assert trainer["progressPercentage"] == 25 and trainer["lastUpdatedTime"] == progress["lastUpdatedTime"]
    assert {m["name"]: m["value"] for m in trainer["metrics"]} == {
        "currentEpoch": "0", "totalEpochs": "1", "globalStep": "4", "groupsConsumed": "10", "groupsTotal": "40",
        "groupsTrained": "8", "groupsDropped": "2"}
    assert cluster.metric("grpo_operator_run_groups_trained", "beta") == 8
    assert cluster.metric("grpo_operator_run_progress_ratio", "beta") == 0.25
    assert cluster.metric("grpo_operator_run_phase", "beta", phase="Running") == 1
    assert cluster.metric("grpo_operator_run_stalled", "beta") == 0


def test_learner_exit_zero_succeeds_and_removes_rollout_pods(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "gamma")
    learner.update(phase="Succeeded", groups_consumed=40, groups_trained=36, dropped={"no_signal": 4}, epochs_done=1)
    cluster.kubelet.exit("gamma-learner-0", 0, learner.report.termination_message())
    status = cluster.wait_phase("gamma", "Succeeded")
    assert status["completionTime"] and status["progress"]["percent"] == 100.0
    assert cluster.condition("gamma", "Succeeded")["status"] == "True"
    assert cluster.condition("gamma", "Succeeded")["reason"] == "EpochBoundReached"
    cluster.wait_for(lambda: cluster.pod_names("gamma") == ["gamma-learner-0"], what="rollout pods deleted")
    cluster.wait_event("gamma", "Succeeded")
    # The finished run claims no server (the scale subresource and `kubectl get` read status.rollout).
    cluster.wait_for(lambda: (cluster.status("gamma")["rollout"]["replicas"], cluster.status("gamma")["rollout"][
        "ready"]) == (0, 0), what="status.rollout counting no server")
    assert cluster.condition("gamma", "RolloutReady")["status"] == "False"
    assert cluster.condition("gamma", "RolloutReady")["reason"] == "Finished"


def test_stall_exit_fails_with_reason_stalled_and_no_retry(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "delta")
    learner.update(phase="Stalled", stall_streak=40, stall_limit=40, message="a full pass trained nothing")
    cluster.kubelet.exit("delta-learner-0", EXIT_STALLED, learner.report.termination_message())
    status = cluster.wait_phase("delta", "Failed")
    assert cluster.condition("delta", "Failed")["reason"] == "Stalled"
    assert cluster.condition("delta", "Stalled")["status"] == "True"
    assert status["failure"]["exitCode"] == EXIT_STALLED and status["failure"]["reason"] == "Stalled"
    assert status["failure"]["message"] == "a full pass trained nothing"
    assert status.get("restarts", 0) == 0
    assert cluster.pods_ever_created("delta") == ["delta-learner-0", "delta-rollout-0"]  # nothing recreated


def test_a_stuck_weight_sync_fails_the_run_as_stalled_weight_sync_stuck(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "sync")
    message = "weight sync stuck: still running after 900s (rollout.weightSync.deadlineSeconds 900)"
    learner.update(phase="Stalled", stall_cause="weight_sync", weight_sync_running_seconds=900.0, message=message)
    cluster.kubelet.exit("sync-learner-0", EXIT_STALLED, learner.report.termination_message())
    status = cluster.wait_phase("sync", "Failed")
    stalled = cluster.condition("sync", "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "WeightSyncStuck" and stalled["message"] == message
    assert cluster.condition("sync", "Failed")["reason"] == "WeightSyncStuck"
    assert status["failure"]["exitCode"] == EXIT_STALLED and status["failure"]["reason"] == "WeightSyncStuck"
    assert cluster.pods_ever_created("sync") == ["sync-learner-0", "sync-rollout-0"]  # nothing recreated


def test_crash_restarts_then_fails_after_backoff_limit(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "eps", minimal_spec(runPolicy={"backoffLimit": 1}))
    first_uid = cluster.kubelet.pod("eps-learner-0")["metadata"]["uid"]
    cluster.kubelet.exit("eps-learner-0", 1, "Traceback ...\nRuntimeError: CUDA error: an illegal memory access")
    cluster.wait_for(lambda: (p := cluster.kubelet.pod("eps-learner-0")) and p["metadata"]["uid"] != first_uid,
                     what="the learner pod recreated")
    assert cluster.status("eps")["restarts"] == 1
    assert cluster.kubelet.pod("eps-learner-0")["metadata"]["annotations"]["grpo.dev/attempt"] == "1"
    cluster.wait_event("eps", "Restarting")
    cluster.kubelet.run("eps-learner-0")
    cluster.wait_phase("eps", "Running")
    cluster.kubelet.exit("eps-learner-0", 137, "OOMKilled")
    status = cluster.wait_phase("eps", "Failed")
    assert cluster.condition("eps", "Failed")["reason"] == "BackoffLimitExceeded"
    assert status["failure"] == {"role": "learner", "pod": "eps-learner-0", "exitCode": 137, "reason": "Error",
                                 "message": "OOMKilled"}
    cluster.wait_for(lambda: cluster.pod_names("eps", "rollout") == [], what="rollout pods cleaned")


def test_no_progress_for_the_deadline_sets_stalled_and_clears_when_progress_resumes(cluster, learner, progress_urls):
    spec = minimal_spec(progress={"progressDeadlineSeconds": 1, "stallPolicy": "Report"})
    _running(cluster, learner, progress_urls, "zeta", spec)
    stalled = cluster.wait_for(lambda: (c := cluster.condition("zeta", "Stalled")) and c["status"] == "True" and c,
                               timeout=10, what="Stalled=True")
    assert stalled["reason"] == "ProgressDeadlineExceeded"
    cluster.wait_for(lambda: cluster.metric("grpo_operator_run_stalled", "zeta") == 1, what="stalled metric")
    assert cluster.status("zeta")["phase"] == "Running"  # stallPolicy Report: reported, not failed
    cluster.wait_event("zeta", "Stalled")
    learner.update(groups_consumed=6, groups_trained=5)
    cleared = cluster.wait_for(lambda: (c := cluster.condition("zeta", "Stalled")) and c["status"] == "False" and c,
                               what="Stalled cleared")
    assert cleared["reason"] == "ProgressResumed"
    cluster.wait_event("zeta", "ProgressResumed")


def test_suspend_deletes_pods_and_resume_recreates_them(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "eta")
    cluster.patch_spec("eta", {"runPolicy": {"suspend": True}})
    cluster.wait_phase("eta", "Suspended")
    cluster.wait_for(lambda: cluster.pods("eta") == [], what="pods deleted while suspended")
    assert cluster.condition("eta", "Suspended")["status"] == "True"
    assert cluster.run("eta") is not None and len(cluster.config_maps("eta")) == 1
    clock = cluster.status("eta")["progressClock"]
    assert clock["pausedSince"]  # the stall clock does not run while suspended
    cluster.patch_spec("eta", {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods("eta")) == 2, what="pods recreated on resume")
    assert cluster.condition("eta", "Suspended")["reason"] == "Resumed"
    cluster.wait_event("eta", "Suspended", "Resumed")
    assert cluster.status("eta")["phase"] == "Pending"


def test_the_pods_image_digests_are_recorded_in_the_run_config_and_outlive_its_rendering_again(
        cluster, learner, progress_urls):
    """The digests the kubelet reports for the run's containers go to the run config's `images`, by role, for the
    export's manifest; a config rendered again on resume (a spec edited while suspended) keeps them, and a pod that
    ran from another digest adds its own."""
    _running(cluster, learner, progress_urls, "iota")

    def images() -> dict[str, Any]:
        (config_map,) = cluster.config_maps("iota")
        return json.loads(config_map["data"]["run.json"]).get("images", {})

    first = {"learner": [TEST_IMAGE_ID], "rollout": [TEST_IMAGE_ID]}
    cluster.wait_passes(lambda: images() == first, what="the pods' images in the run config")
    cluster.patch_spec("iota", {"runPolicy": {"suspend": True}})
    cluster.wait_for(lambda: cluster.pods("iota") == [], what="pods deleted while suspended")
    cluster.patch_spec("iota", {"checkpoint": {"saveSteps": 7}})
    cluster.patch_spec("iota", {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods("iota")) == 2, what="pods recreated on resume")
    (config_map,) = cluster.config_maps("iota")
    assert json.loads(config_map["data"]["run.json"])["checkpoint"]["saveSteps"] == 7  # rendered again
    newer = "docker.io/library/grpo-trainer@sha256:" + "8" * 64
    cluster.kubelet.run("iota-learner-0", image_id=newer)
    cluster.kubelet.run("iota-rollout-0")
    cluster.wait_passes(lambda: images() == {"learner": sorted([TEST_IMAGE_ID, newer]), "rollout": [TEST_IMAGE_ID]},
                        what="the new digest beside the old one")


def test_operator_restart_mid_run_creates_no_duplicates_and_status_continues(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "theta")
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("theta")}
    anchor = cluster.status("theta")["progressClock"]["anchorTime"]
    cluster.stop_operator()
    learner.update(groups_consumed=20, groups_trained=18)
    cluster.start_operator()
    cluster.wait_trained("theta", learner, 18)  # progress after the restart
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("theta")} == uids
    assert cluster.status("theta")["phase"] == "Running"
    assert cluster.status("theta")["progressClock"]["anchorTime"] >= anchor
    assert cluster.pods_ever_created("theta") == ["theta-learner-0", "theta-rollout-0"]
    assert cluster.event_reasons("theta").count("Created") == 1


def test_ttl_after_finished_deletes_the_run_and_its_children(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "iota", minimal_spec(runPolicy={"ttlSecondsAfterFinished": 1}))
    cluster.kubelet.exit("iota-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("iota", "Succeeded")
    cluster.wait_for(lambda: cluster.run("iota") is None, timeout=10, what="the run deleted after its TTL")
    cluster.wait_for(lambda: not cluster.pods("iota") and not cluster.services("iota")
                     and not cluster.config_maps("iota"), what="children garbage-collected")
    cluster.wait_for(lambda: cluster.metric("grpo_operator_run_info", "iota", model="/models/tiny") is None,
                     what="the run's metric series removed")


def test_a_ttl_set_after_the_run_finished_deletes_it(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "pi")
    cluster.kubelet.exit("pi-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("pi", "Succeeded")
    cluster.wait_idle("pi")  # finished and cleaned: nothing left to do until the spec changes
    cluster.patch_spec("pi", {"runPolicy": {"ttlSecondsAfterFinished": 0}})  # as for a Job, a TTL set later counts
    cluster.wait_for(lambda: cluster.run("pi") is None, what="the run deleted under the TTL set after it finished")


def test_a_clean_pod_policy_changed_after_the_run_finished_is_applied(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "sigma", minimal_spec(runPolicy={"cleanPodPolicy": "None"}))
    cluster.kubelet.exit("sigma-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("sigma", "Succeeded")
    cluster.wait_idle("sigma")
    assert cluster.pod_names("sigma") == ["sigma-learner-0", "sigma-rollout-0"]  # kept, as the policy said
    cluster.patch_spec("sigma", {"runPolicy": {"cleanPodPolicy": "All"}})
    cluster.wait_for(lambda: cluster.pods("sigma") == [], what="the pods cleaned under the new cleanPodPolicy")
    assert cluster.run("sigma")["status"]["observedGeneration"] == 2


def test_bad_spec_fails_with_a_field_naming_reason_and_creates_nothing(cluster):
    spec = minimal_spec()
    spec["training"]["epochs"] = 0  # the CRD would refuse this; an operator must still not retry it forever
    cluster.apply(grporun("kappa", spec))
    status = cluster.wait_phase("kappa", "Failed")
    failed = cluster.condition("kappa", "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.training.epochs:")
    assert status["failure"]["reason"] == "InvalidSpec"
    assert cluster.pods("kappa") == [] and cluster.config_maps("kappa") == []
    cluster.wait_event("kappa", "InvalidSpec")


def test_an_unknown_built_in_reward_fails_at_once_and_creates_nothing(cluster):
    """The CRD cannot know the reward names, so the API server admits `nope`; the operator refuses it with the line
    `grporun validate` and `grporun local` print, instead of a learner exiting 78 minutes later."""
    cluster.apply(grporun("nu", minimal_spec(rewards=[{"name": "nope"}])))
    cluster.wait_phase("nu", "Failed")
    assert cluster.condition("nu", "Failed")["message"] == (
        "spec.rewards[0].name: unknown reward 'nope'; built-in rewards: accuracy, constant, letter_a_fraction")
    assert cluster.pods("nu") == [] and cluster.config_maps("nu") == []


def test_image_pull_backoff_surfaces_a_reason(cluster):
    cluster.apply(grporun("lam"))
    cluster.wait_for(lambda: len(cluster.pods("lam")) == 2, what="pods")
    cluster.kubelet.wait("lam-rollout-0", "ImagePullBackOff", 'Back-off pulling image "grpo-trainer:test"')
    progressing = cluster.wait_for(
        lambda: (c := cluster.condition("lam", "Progressing")) and c["reason"] == "ImagePullBackOff" and c,
        what="Progressing reason ImagePullBackOff")
    assert "lam-rollout-0" in progressing["message"]
    assert "ImagePullBackOff" in cluster.status("lam")["message"]
    cluster.wait_event("lam", "ImagePullBackOff")


def test_a_child_the_api_server_rejects_fails_the_run_naming_it(cluster):
    spec = minimal_spec(checkpoint={"volume": {"persistentVolumeClaim": {"claimNmae": "typo"}}})
    cluster.apply(grporun("mu", spec))
    status = cluster.wait_phase("mu", "Failed")
    message = cluster.condition("mu", "Failed")["message"]
    assert message.startswith("Pod mu-rollout-0 was rejected by the API server")
    assert "claimName" in message and "(" not in message[:60]
    assert status["failure"]["reason"] == "InvalidSpec"


@pytest.mark.parametrize("emulator_options", [{"max_watch_seconds": 0.3}])
def test_a_lifecycle_survives_watch_streams_that_keep_ending(cluster, learner, progress_urls):
    """The API server ends every watch after 0.3 s: kopf must resume each from its last resourceVersion and lose
    no event on the way (a lost pod event would leave the run Running forever)."""
    _running(cluster, learner, progress_urls, "nu")
    cluster.kubelet.exit("nu-learner-0", 0, learner.report.termination_message())
    cluster.wait_phase("nu", "Succeeded")
    resumed = [r for r in cluster.emulator.request_log if r.verb == "watch" and r.query.get("resourceVersion")]
    assert len({r.resource for r in resumed}) >= 2 and len(resumed) >= 4


def test_one_failed_learner_node_restarts_the_whole_learner_gang(cluster, learner, progress_urls):
    _running(cluster, learner, progress_urls, "xi", minimal_spec(learner={"nodes": 2}, rollout=MULTI_RANK_ROLLOUT))
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("xi")}
    cluster.kubelet.exit("xi-learner-1", 1, "RuntimeError: NCCL watchdog timeout")
    cluster.wait_for(lambda: cluster.pods_ever_created("xi").count("xi-learner-0") == 2
                     and cluster.pods_ever_created("xi").count("xi-learner-1") == 2, what="both learners recreated")
    after = cluster.wait_for(lambda: len(pods := cluster.pods("xi")) == 3 and pods, what="3 pods again")
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in after}
    assert uids["xi-rollout-0"] == before["xi-rollout-0"]  # the rollout servers keep running
    assert uids["xi-learner-0"] != before["xi-learner-0"] and uids["xi-learner-1"] != before["xi-learner-1"]
    assert cluster.status("xi")["restarts"] == 1


def test_a_rollout_server_that_exits_is_replaced_alone_until_its_restart_limit(cluster, learner, progress_urls):
    engine_error = "RuntimeError: CPU Generator does not use offset"
    two_servers = {"replicas": 2, "weightSync": {"mode": "filesystem",
                                                 "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}
    spec = minimal_spec(rollout=two_servers, runPolicy={"backoffLimit": 0, "rolloutRestartLimit": 1},
                        progress={"statusIntervalSeconds": 0})
    learner.update(rollout=[{"replica": i, "url": f"http://rho-rollout-{i}.rho-rollout:8000", "ready": True,
                             "weightVersion": "v2", "samples": 40 + i} for i in range(2)])
    _running(cluster, learner, progress_urls, "rho", spec)
    servers = cluster.wait_for(lambda: (s := cluster.status("rho")["rollout"]["servers"])[1].get("samples") and s,
                               what="each server's samples in status.rollout")
    assert [(s["pod"], s["ready"], s["serving"], s["weightVersion"], s["samples"]) for s in servers] == [
        ("rho-rollout-0", True, True, "v2", 40), ("rho-rollout-1", True, True, "v2", 41)]
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("rho")}
    # vLLM exits 0 after its engine died; the rollout entrypoint's termination message names the root error.
    cluster.kubelet.exit("rho-rollout-1", 0, f"grpo rollout: vLLM exited with code 0: {engine_error}")
    replaced = cluster.wait_for(lambda: (p := cluster.kubelet.pod("rho-rollout-1")) and
                                p["metadata"]["uid"] != before["rho-rollout-1"] and p, what="the server replaced")
    assert replaced["metadata"]["annotations"]["grpo.dev/rollout-restarts"] == "1"
    cluster.wait_event("rho", "RolloutRestarted")
    status = cluster.status("rho")
    assert status["phase"] == "Running" and status.get("restarts", 0) == 0 and status["rollout"]["restarts"] == 1
    ready = cluster.condition("rho", "RolloutReady")
    assert ready["reason"] == "RolloutRestarting" and engine_error in ready["message"]
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("rho")}
    assert uids["rho-learner-0"] == before["rho-learner-0"] and uids["rho-rollout-0"] == before["rho-rollout-0"]
    cluster.kubelet.run("rho-rollout-1")
    cluster.wait_for(lambda: cluster.condition("rho", "RolloutReady")["status"] == "True", what="RolloutReady")
    cluster.kubelet.exit("rho-rollout-1", 0, f"grpo rollout: vLLM exited with code 0: {engine_error}")
    status = cluster.wait_phase("rho", "Failed")
    assert cluster.condition("rho", "Failed")["reason"] == "RolloutRestartLimitExceeded"
    assert status["failure"] == {"role": "rollout", "pod": "rho-rollout-1", "exitCode": 0,
                                 "reason": "RolloutRestartLimitExceeded", "message": engine_error}
    assert status["message"].endswith(f"after 1 restarts (runPolicy.rolloutRestartLimit 1): {engine_error}")


def test_a_newer_learners_report_keeps_the_runs_status_moving(cluster, learner, progress_urls):
    """A learner image upgraded before the operator reports a field, a drop reason and a phase this operator does not
    know: the report is read (not refused), so Progressing and Stalled stay known and the counts land in status."""
    _running(cluster, learner, progress_urls, "newer")
    report = learner.report.model_dump(mode="json", by_alias=True)
    report.update(phase="Balancing", groupsConsumed=9, groupsTrained=6, tokensPerSecond=9.5,
                  dropped={**report["dropped"], "no_signal": 1, "reward_timeout": 2})
    report["rollout"] = [{**server, "kvCacheUsage": 0.5} for server in report["rollout"]]
    learner.answer(json.dumps(report))
    cluster.wait_trained("newer", learner, 6)  # the newer report's counts in status
    progress = cluster.status("newer")["progress"]
    assert progress["groupsDropped"] == 3  # every reason counts, the one status cannot name too
    assert progress["dropped"]["no_signal"] == 1
    assert cluster.condition("newer", "Progressing")["status"] == "True"
    assert cluster.condition("newer", "Stalled")["status"] == "False"
    assert "ProgressUnknown" not in cluster.event_reasons("newer")


def test_a_running_runs_environment_servers_scale_live_up_and_down(cluster, learner, progress_urls):
    """spec.environments[].replicas on a running run: 1 -> 3 creates two servers, 3 -> 1 deletes them, each with
    a Scaled event; the run stays Running and keeps its other pods, and status.environments follows."""
    spec = minimal_spec(environments=[{"name": "guess", "image": "game:1", "replicas": 1}])
    cluster.apply(grporun("envs", spec))
    progress_urls["envs-learner-0"] = learner.url()
    cluster.bring_up("envs", pods=3)
    learner.update(groups_consumed=4, groups_trained=3, global_step=2)
    cluster.wait_phase("envs", "Running")
    others = cluster.pod_names("envs", "rollout") + cluster.pod_names("envs", "learner")

    def environments() -> list[dict[str, Any]]:
        return cluster.status("envs").get("environments") or []

    cluster.patch_spec("envs", {"environments": [{"name": "guess", "image": "game:1", "replicas": 3}]})
    cluster.wait_for(lambda: len(cluster.pods("envs", "environment")) == 3, what="two more environment servers")
    for pod in cluster.pod_names("envs", "environment"):
        cluster.kubelet.run(pod)
    cluster.wait_for(lambda: environments() == [{"name": "guess", "wanted": 3, "replicas": 3, "ready": 3,
                                                 "restarts": 0}], what="status.environments at 3 servers")
    cluster.patch_spec("envs", {"environments": [{"name": "guess", "image": "game:1", "replicas": 1}]})
    cluster.wait_for(lambda: cluster.pod_names("envs", "environment") == ["envs-env-guess-0"],
                     what="the servers past the new count deleted")
    cluster.wait_for(lambda: environments() == [{"name": "guess", "wanted": 1, "replicas": 1, "ready": 1,
                                                 "restarts": 0}], what="status.environments back at 1 server")
    cluster.wait_event("envs", "Scaled")
    messages = [e["message"] for e in cluster.events("envs") if e["reason"] == "Scaled"]
    assert sorted(messages) == [
        "environment guess scaled from 1 to 3 servers: creating 2 server pod(s)",
        "environment guess scaled from 3 to 1 servers: deleting envs-env-guess-1, envs-env-guess-2; the episodes "
        "they hold fail and count as environment failures"]
    assert cluster.status("envs")["phase"] == "Running"
    assert cluster.pod_names("envs", "rollout") + cluster.pod_names("envs", "learner") == others


def test_environment_services_follow_a_spec_edited_while_suspended(cluster, learner, progress_urls):
    """An environment's port edited while suspended is what its Service forwards on resume; the Service of an
    environment removed or renamed meanwhile is deleted, and the new name gets its own. An environment's Service with
    a cluster IP (as operators made it before they were headless, so that each episode stays on one server) is
    replaced by a headless one: a Service's clusterIP cannot be changed."""
    environments = [{"name": "guess", "image": "game:1", "port": 8765}, {"name": "code", "image": "code:1"}]
    cluster.apply(grporun("svc", minimal_spec(environments=environments)))
    cluster.wait_for(lambda: len(cluster.services("svc")) == 4, what="the rollout, learner and 2 environment Services")
    cluster.patch_spec("svc", {"runPolicy": {"suspend": True}})
    cluster.wait_phase("svc", "Suspended")
    (headless,) = [s for s in cluster.services("svc") if s["metadata"]["name"] == "svc-env-guess"]
    assert headless["spec"]["clusterIP"] == "None"
    namespace = headless["metadata"]["namespace"]
    cluster.client.delete(SERVICES, namespace, "svc-env-guess")
    metadata = {key: headless["metadata"][key] for key in ("name", "namespace", "labels", "ownerReferences")}
    spec = {key: headless["spec"][key] for key in ("selector", "ports")}
    cluster.client.create(SERVICES, namespace, {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
                                                "spec": spec})  # a cluster IP: the real server assigns one
    cluster.patch_spec("svc", {"environments": [{"name": "guess", "image": "game:1", "port": 9000},
                                                {"name": "maze", "image": "code:1"}]})
    cluster.patch_spec("svc", {"runPolicy": {"suspend": False}})

    def services() -> dict[str, Any]:
        return {s["metadata"]["name"]: s["spec"]["ports"] for s in cluster.services("svc")}

    cluster.wait_for(lambda: "svc-env-code" not in services() and "svc-env-maze" in services(),
                     what="the removed environment's Service deleted and the new one's created")
    cluster.wait_for(lambda: [s["spec"].get("clusterIP") for s in cluster.services("svc")
                              if s["metadata"]["name"] == "svc-env-guess"] == ["None"],
                     what="the environment's Service with a cluster IP replaced by a headless one")
    (port,) = services()["svc-env-guess"]
    assert (port["port"], port["targetPort"]) == (9000, 9000)
    assert sorted(services()) == ["svc-env-guess", "svc-env-maze", "svc-learner", "svc-rollout"]


#: What the kubelet posts on a pod whose readiness probe finds nothing listening.
PROBE_REFUSED = ('Readiness probe failed: Get "http://10.0.0.5:8765/health": dial tcp 10.0.0.5:8765: connect: '
                 "connection refused")


def _running_unready_servers(cluster, name: str, replicas: int) -> None:
    """A run with `replicas` servers of environment `guess`, every pod running, the environment servers not ready."""
    environments = [{"name": "guess", "image": "game:1", "port": 8765, "replicas": replicas}]
    cluster.apply(grporun(name, minimal_spec(environments=environments)))
    cluster.wait_for(lambda: len(cluster.pods(name)) == 2 + replicas, what=f"the run's {2 + replicas} pods")


def test_a_server_that_runs_but_is_never_ready_is_explained_by_the_kubelets_probe_failures(cluster):
    """The kubelet's Unhealthy Events on a server's pod say why it is not ready (its Ready condition says only that
    it is not): EnvironmentsReady, Progressing and RolloutReady say it."""
    _running_unready_servers(cluster, "probe", 1)
    cluster.kubelet.probe_failed("probe-env-guess-0", PROBE_REFUSED, count=5, seconds=40)
    cluster.kubelet.probe_failed("probe-rollout-0", "Readiness probe failed: HTTP probe failed with statuscode: 503",
                                 count=2, seconds=10)
    cluster.kubelet.run("probe-learner-0")
    cluster.kubelet.run("probe-rollout-0", ready=False)
    cluster.kubelet.run("probe-env-guess-0", ready=False)
    unready = ("0/1 environment servers ready; probe-env-guess-0 is not ready: its readiness probe (TCP connect to "
               "port 8765) does not pass: readiness probe failed: connection refused (5 times in 40 s)")
    cluster.wait_passes(lambda: (cluster.condition("probe", "EnvironmentsReady") or {}).get("message") == unready,
                        what="EnvironmentsReady with the kubelet's probe failure")
    assert cluster.condition("probe", "RolloutReady")["message"] == (
        "0/1 rollout servers ready; probe-rollout-0 is not ready, readiness probe failed: HTTP probe failed with "
        "statuscode: 503 (2 times in 10 s)")
    assert cluster.status("probe")["phase"] == "Starting"
    assert unready in cluster.condition("probe", "Progressing")["message"]


def test_events_are_read_only_for_pods_that_are_not_ready_and_without_the_permission_the_run_goes_on(cluster, caplog):
    """The Events of a pod are listed when it runs but is not ready, not on every pass; a 403 (RBAC without the
    list) leaves the condition as the pod's status says it, is logged once, and stops the reads for a while: kopf
    logs each refused request as an error."""
    cluster.emulator_thread.call(lambda: cluster.emulator.inject_fault(
        "GET", "events", 403, "Forbidden", 'events is forbidden: User "grpo" cannot list resource "events"',
        times=1_000_000))
    _running_unready_servers(cluster, "noevents", 2)
    started = time.monotonic()
    for pod in cluster.pod_names("noevents"):
        cluster.kubelet.run(pod, ready="-env-" not in pod)
    unready = ("0/2 environment servers ready; noevents-env-guess-0 is not ready: its readiness probe (TCP connect "
               "to port 8765) does not pass; noevents-env-guess-1 is not ready: its readiness probe (TCP connect to "
               "port 8765) does not pass")
    cluster.wait_passes(lambda: (cluster.condition("noevents", "EnvironmentsReady") or {}).get("message") == unready,
                        what="EnvironmentsReady as the pods say it")
    first = cluster.passes()
    cluster.wait_passes(lambda: cluster.passes() >= first + 10, what="ten more passes")
    servers = {pod["metadata"]["uid"] for pod in cluster.pods("noevents", "environment")}
    reads = [r.query.get("fieldSelector") for r in cluster.emulator.request_log
             if r.user_agent.startswith("kopf") and r.resource == "events" and r.verb == "list"]
    # One read, refused; none after it within the retry interval (a loaded machine may take that long).
    assert len(reads) == 1 + len(servers) * int((time.monotonic() - started) // probe_events.REFUSED_RETRY_SECONDS)
    assert set(reads) <= {f"involvedObject.uid={uid},reason=Unhealthy" for uid in servers}
    refusals = [r for r in caplog.records if "cannot list Events" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelname == "WARNING"
    refused_requests = [r for r in caplog.records if r.levelname == "ERROR" and "/events?" in r.getMessage()]
    assert len(refused_requests) == 1
    assert cluster.status("noevents")["phase"] == "Starting"
