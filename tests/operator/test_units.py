"""Unit tests of the operator's small I/O-edge helpers: pod reading, merge patches, the progress poll, metrics,
kopf settings."""

from __future__ import annotations

import asyncio

import aiohttp
import kopf
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grpo_operator import metric_names
from grpo_operator.handlers import FINALIZER, configure_settings
from grpo_operator.kube import merge_patch_between, object_url
from grpo_operator.operator_metrics import OperatorMetrics
from grpo_operator.pods import observe_pod, pod_facts
from grpo_operator.progress_poller import fetch_progress, pod_progress_url
from grpo_operator.status import PodObservation
from grpo_trainer.contract import ProgressReport
from grpo_trainer.exporter import ProgressServer


def pod(status: dict, role: str = "learner", **metadata) -> dict:
    return {"metadata": {"name": f"r-{role}-0", "uid": "u1", "labels": {"grpo.dev/role": role}, **metadata},
            "status": status}


def test_a_terminated_pod_reads_as_exit_code_reason_and_termination_message():
    observed = observe_pod(pod({"phase": "Failed", "podIP": "10.0.0.7", "containerStatuses": [
        {"name": "sidecar", "state": {"running": {}}},
        {"name": "learner", "restartCount": 0, "state": {"terminated": {"exitCode": 42, "reason": "Error",
                                                                          "message": "{\"phase\":\"Stalled\"}"}}}]}))
    assert observed == PodObservation(name="r-learner-0", role="learner", phase="Failed", ready=False, exit_code=42,
                                      reason="Error", message='{"phase":"Stalled"}', restarts=0)


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


def test_pod_facts_carry_identity_address_deletion_and_attempt():
    facts = pod_facts(pod({"podIP": "10.0.0.7"}, deletionTimestamp="2026-01-01T00:00:00Z",
                          annotations={"grpo.dev/attempt": "3"}))
    assert (facts.uid, facts.ip, facts.terminating, facts.attempt) == ("u1", "10.0.0.7", True, 3)


def test_merge_patch_between_nulls_removed_keys_and_replaces_lists():
    old = {"phase": "Running", "failure": {"pod": "a", "exitCode": 1}, "conditions": [{"type": "A"}], "keep": 1}
    new = {"phase": "Failed", "failure": {"pod": "a"}, "conditions": [{"type": "B"}], "keep": 1, "added": True}
    assert merge_patch_between(old, new) == {"phase": "Failed", "failure": {"exitCode": None},
                                             "conditions": [{"type": "B"}], "added": True}
    assert merge_patch_between(new, new) == {}


def test_object_urls():
    assert object_url("v1", "Pod", "ns", "p") == "/api/v1/namespaces/ns/pods/p"
    assert object_url("grpo.dev/v1alpha1", "GRPORun", "ns", "r", "status") == \
        "/apis/grpo.dev/v1alpha1/namespaces/ns/grporuns/r/status"
    assert pod_progress_url("ns", "p", "10.0.0.7") == "http://10.0.0.7:9400/progress"
    assert pod_progress_url("ns", "p", "fd00::7") == "http://[fd00::7]:9400/progress"


def test_fetch_progress_reads_a_real_progress_server_and_returns_none_when_it_cannot():
    server = ProgressServer(lambda: ProgressReport(groups_total=10, groups_trained=4), port=0, host="127.0.0.1")
    server.start()

    async def poll() -> tuple:
        async with aiohttp.ClientSession() as session:
            good = await fetch_progress(session, f"{server.url}/progress", timeout=2)
            missing = await fetch_progress(session, f"{server.url}/nothing", timeout=2)
            dead = await fetch_progress(session, "http://127.0.0.1:9/progress", timeout=2)
            return good, missing, dead
    try:
        good, missing, dead = asyncio.run(poll())
    finally:
        server.stop()
    assert good.groups_trained == 4 and missing is None and dead is None


def test_metrics_use_the_shared_names_and_forget_a_deleted_run():
    metrics = OperatorMetrics()
    metrics.observe_run("ns", "r", "m", 1800, {
        "phase": "Running", "restarts": 2, "lastProgressTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Stalled", "status": "True", "reason": "x", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "progress": {"groupsTotal": 40, "groupsConsumed": 10, "groupsTrained": 8, "dropped": {"no_signal": 2},
                     "estimatedRemainingSeconds": 90},
        "rollout": {"replicas": 2, "ready": 1}})
    metrics.reconcile_errors.labels("lifecycle").inc()
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    exported = {name.removesuffix("_total") for name in metric_names.OPERATOR_METRIC_NAMES}
    assert exported <= set(families)
    get = metrics.registry.get_sample_value
    labels = {"namespace": "ns", "run": "r"}
    assert get(metric_names.RUN_PROGRESS_RATIO, labels) == 0.25
    assert get(metric_names.RUN_STALLED, labels) == 1 and get(metric_names.RUN_RESTARTS, labels) == 2
    assert get(metric_names.RUN_PHASE, {**labels, "phase": "Running"}) == 1
    assert get(metric_names.RUN_LAST_PROGRESS, labels) == 1767225600.0
    assert get(metric_names.RECONCILE_ERRORS, {"handler": "lifecycle"}) == 1
    assert get(metric_names.RUN_ESTIMATED_REMAINING, labels) == 90
    metrics.observe_run("ns", "r", "m", 1800, {"phase": "Running", "progress": {"groupsTotal": 40}})
    assert get(metric_names.RUN_ESTIMATED_REMAINING, labels) is None, "no estimate, no series"
    metrics.forget_run("ns", "r")
    text = generate_latest(metrics.registry).decode()
    assert 'run="r"' not in text


def test_kopf_settings_use_our_prefixes_and_short_timeouts():
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    assert settings.persistence.finalizer == FINALIZER == "grpo.dev/finalizer"
    assert settings.networking.request_timeout == 30
    assert settings.watching.inactivity_timeout > settings.watching.server_timeout
    assert settings.posting.loggers is False
