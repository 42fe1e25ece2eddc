"""grpo_operator.cluster.pods: a Pod object read into what the operator decides on and acts on."""

from __future__ import annotations

from grpo_operator.cluster.pods import observe_pod, pod_facts
from grpo_operator.status import PodObservation


def pod(status: dict, role: str = "learner", **metadata) -> dict:
    return {"metadata": {"name": f"r-{role}-0", "uid": "u1", "labels": {"grpo.dev/role": role}, **metadata},
            "status": status}



def test_a_terminated_pod_reads_as_exit_code_reason_and_termination_message():
    observed = observe_pod(pod({"phase": "Failed", "podIP": "10.0.0.7", "containerStatuses": [
        {"name": "sidecar", "state": {"running": {}}},
        {"name": "learner", "restartCount": 0, "state": {"terminated": {"exitCode": 42, "reason": "Error",
                                                                          "message": "{\"phase\":\"Stalled\"}"}}}]}))
    assert observed == PodObservation(name="r-learner-0", role="learner", phase="Failed", ready=False, exit_code=42,
                                      reason="Error", message='{"phase":"Stalled"}', container="learner")


def test_an_oom_killed_container_reads_with_its_memory_limit():
    killed = {"phase": "Failed", "containerStatuses": [{"name": "learner", "state": {"terminated": {
        "exitCode": 137, "reason": "OOMKilled"}}}]}
    body = {**pod(killed), "spec": {"containers": [
        {"name": "sidecar", "resources": {"limits": {"memory": "64Mi"}}},
        {"name": "learner", "resources": {"limits": {"memory": "16Gi", "cpu": "4"}}}]}}
    observed = observe_pod(body)
    assert (observed.reason, observed.container, observed.memory_limit) == ("OOMKilled", "learner", "16Gi")
    assert observe_pod({**body, "spec": {"containers": [{"name": "learner"}]}}).memory_limit is None



def test_a_waiting_or_unschedulable_pod_reads_with_its_reason():
    waiting = observe_pod(pod({"phase": "Pending", "containerStatuses": [
        {"name": "rollout", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]},
        role="rollout"))
    assert (waiting.role, waiting.waiting_reason, waiting.message) == ("rollout", "ImagePullBackOff", "no such image")
    unschedulable = observe_pod(pod({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}]}))
    assert (unschedulable.reason, unschedulable.message) == ("Unschedulable", "0/3 nodes")
    ready = observe_pod(pod({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}))
    assert ready.ready and ready.phase == "Running"
    assert observe_pod({"metadata": {"name": "x"}}).phase == "Pending"



def test_pod_facts_carry_identity_address_and_the_controlling_run():
    owners = [{"apiVersion": "v1", "kind": "Other", "name": "o", "uid": "other"},
              {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": "r", "uid": "run-uid", "controller": True}]
    facts = pod_facts(pod({"podIP": "10.0.0.7"}, ownerReferences=owners))
    assert (facts.uid, facts.ip, facts.owner_uid) == ("u1", "10.0.0.7", "run-uid")
    assert pod_facts(pod({})).owner_uid is None


def test_a_pod_being_deleted_disrupted_or_restarted_says_so():
    observed = observe_pod(pod({"phase": "Failed", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]},
        deletionTimestamp="2026-01-01T00:00:00Z", annotations={"grpo.dev/attempt": "3"}))
    assert (observed.terminating, observed.disruption, observed.attempt) == (True, "PreemptionByScheduler", 3)
    assert observed.conditions == frozenset({"DisruptionTarget"})
    plain = observe_pod(pod({"phase": "Running", "conditions": [{"type": "DisruptionTarget", "status": "False"}]}))
    assert (plain.terminating, plain.disruption, plain.attempt) == (False, None, None)
    assert plain.rollout_restarts is None
    assert observe_pod(pod({}, annotations={"grpo.dev/rollout-restarts": "2"})).rollout_restarts == 2


def test_an_environment_server_reads_as_its_own_role_not_a_rollout_server():
    observed = observe_pod(pod({"phase": "Running", "containerStatuses": [
        {"name": "environment", "ready": True, "state": {"running": {}}}],
        "conditions": [{"type": "Ready", "status": "True"}]}, role="environment"))
    assert (observed.role, observed.ready, observed.container) == ("environment", True, "environment")


def test_a_container_restarted_in_place_reads_with_its_restart_count():
    observed = observe_pod(pod({"phase": "Running", "containerStatuses": [
        {"name": "environment", "restartCount": 4, "state": {"running": {}}}]}, role="environment"))
    assert observed.container_restarts == 4


def test_an_unready_pod_reads_with_its_ready_conditions_reason_and_message():
    observed = observe_pod(pod({"phase": "Running", "containerStatuses": [
        {"name": "environment", "ready": False, "started": True, "state": {"running": {}}}],
        "conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady",
                        "message": "containers with unready status: [environment]"}]}, role="environment"))
    assert not observed.ready
    assert observed.not_ready == "ContainersNotReady: containers with unready status: [environment]"
    ready = observe_pod(pod({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}))
    assert ready.not_ready is None


def test_a_started_container_reads_with_its_image_digest():
    started = observe_pod(pod({"phase": "Running", "containerStatuses": [
        {"name": "learner", "image": "localhost/grpo-trainer:x", "imageID": "localhost/grpo-trainer@sha256:ab",
         "state": {"running": {}}}]}))
    assert started.image_id == "localhost/grpo-trainer@sha256:ab"
    assert observe_pod(pod({"phase": "Pending", "containerStatuses": [
        {"name": "learner", "imageID": "", "state": {"waiting": {"reason": "ContainerCreating"}}}]})).image_id is None

