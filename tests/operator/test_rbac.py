"""Every API call the real operator makes over a whole lifecycle is allowed by the Helm chart's RBAC rules.

The emulator records each request with the verb, API group, resource and subresource RBAC would check; the chart's
rules come from rendering it with the real Helm engine (tests/support/chart_rbac.py). A call the chart forgot to allow
would be a 403 in a real cluster and a failed assertion here.
"""

from __future__ import annotations

import pytest

from tests.support.chart_rbac import is_allowed, rendered_rules
from tests.support.specs import NAMESPACE, grporun, minimal_spec

pytestmark = pytest.mark.slow


def _lifecycle(cluster, learner, progress_urls, name: str) -> None:
    """Create, run, crash and restart, suspend, resume, succeed and expire: every kind of call the operator makes.
    A suspend and resume come twice, so their events come again and are counted on the Events posted first."""
    cluster.apply(grporun(name, minimal_spec(runPolicy={"backoffLimit": 1, "ttlSecondsAfterFinished": 0})))
    progress_urls[f"{name}-learner-0"] = learner.url()
    cluster.bring_up(name)
    learner.update(groups_consumed=2, groups_trained=2)
    cluster.wait_phase(name, "Running")
    cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
    cluster.wait_phase(name, "Suspended")
    cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods(name)) == 2, what="pods after resume")
    cluster.bring_up(name)
    cluster.wait_phase(name, "Running")
    cluster.kubelet.exit(f"{name}-learner-0", 1, "crash")
    cluster.wait_for(lambda: cluster.status(name).get("restarts") == 1, what="a restart")
    cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
    cluster.wait_phase(name, "Suspended")
    cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods(name)) == 2, what="pods after resume")
    cluster.bring_up(name)
    cluster.kubelet.exit(f"{name}-learner-0", 0, learner.report.termination_message())
    cluster.wait_for(lambda: cluster.run(name) is None, what="TTL deletion")


def _denied(cluster, values: dict) -> list[str]:
    calls = [r for r in cluster.emulator.request_log if r.user_agent.startswith("kopf") and r.verb]
    used = {(r.verb, r.group, r.rbac_resource) for r in calls}
    assert {("create", "", "pods"), ("delete", "", "pods"), ("patch", "grpo.dev", "grporuns/status"),
            ("delete", "grpo.dev", "grporuns"), ("create", "", "events"), ("patch", "", "events"),
            ("watch", "", "pods")} <= used
    rules = rendered_rules(values)
    return sorted({f"{r.verb} {r.group or 'core'}/{r.rbac_resource} in {r.namespace}" for r in calls
                   if not is_allowed(rules, r.verb, r.group, r.resource, r.subresource, r.namespace)})


def test_a_namespaced_operators_requests_are_allowed_by_the_namespaced_chart(cluster, learner, progress_urls):
    _lifecycle(cluster, learner, progress_urls, "scoped")
    assert _denied(cluster, {"watch": {"allNamespaces": False, "namespaces": [NAMESPACE]}}) == []


def test_a_cluster_wide_operators_requests_are_allowed_by_the_cluster_wide_chart(cluster, learner, progress_urls):
    cluster.stop_operator()
    cluster.emulator_thread.call(cluster.emulator.request_log.clear)
    cluster.start_operator(clusterwide=True)
    _lifecycle(cluster, learner, progress_urls, "wide")
    assert _denied(cluster, {"watch": {"allNamespaces": True}}) == []


def _kueue_lifecycle(cluster, learner, progress_urls, name: str) -> None:
    """Queued, resized while queued, admitted on a flavour, evicted, released, re-admitted, finished: every Kueue
    call the operator makes."""
    from grpo_operator.cluster import kueue
    from tests.operator.test_kueue import (
        FLAVOR,
        _kueue_writes,
        _queued,
        _scaled_queued_spec,
        _workload,
        admitted_status,
        evicted_status,
    )
    from tests.support.emulator.kube_emulator import RESOURCE_FLAVORS

    cluster.client.create(RESOURCE_FLAVORS, None, FLAVOR)
    _queued(cluster, name, _scaled_queued_spec())
    cluster.wait_for(lambda: _workload(cluster, name), what="the Workload")
    cluster.patch_spec(name, {"rollout": {"replicas": 2}})
    cluster.wait_for(lambda: kueue.pod_set_counts(_workload(cluster, name))["rollout"] == 2, what="the resize")
    _kueue_writes(cluster, name, admitted_status(rollout=2))
    progress_urls[f"{name}-learner-0"] = learner.url()
    cluster.bring_up(name, pods=3)
    _kueue_writes(cluster, name, evicted_status())
    cluster.wait_for(lambda: "admission" not in _workload(cluster, name)["status"], what="quota released")
    _kueue_writes(cluster, name, admitted_status(rollout=2))
    cluster.bring_up(name, pods=3)
    cluster.kubelet.exit(f"{name}-learner-0", 0, learner.report.termination_message())
    cluster.wait_for(lambda: any(c["type"] == "Finished" for c in _workload(cluster, name)["status"]["conditions"]),
                     what="Workload Finished")


@pytest.mark.parametrize("values", [{"watch": {"allNamespaces": False, "namespaces": [NAMESPACE]}},
                                    {"watch": {"allNamespaces": True}}], ids=["namespaced", "cluster-wide"])
def test_the_operators_kueue_requests_are_allowed_by_the_chart(cluster, learner, progress_urls, values):
    if values["watch"]["allNamespaces"]:
        cluster.stop_operator()
        cluster.emulator_thread.call(cluster.emulator.request_log.clear)
        cluster.start_operator(clusterwide=True)
    _kueue_lifecycle(cluster, learner, progress_urls, "queued")
    calls = [r for r in cluster.emulator.request_log if r.user_agent.startswith("kopf") and r.verb]
    used = {(r.verb, r.group, r.rbac_resource) for r in calls}
    assert {("create", "kueue.x-k8s.io", "workloads"), ("get", "kueue.x-k8s.io", "workloads"),
            ("patch", "kueue.x-k8s.io", "workloads"), ("patch", "kueue.x-k8s.io", "workloads/status"),
            ("get", "kueue.x-k8s.io", "resourceflavors")} <= used
    rules = rendered_rules(values)
    denied = sorted({f"{r.verb} {r.group or 'core'}/{r.rbac_resource} in {r.namespace}" for r in calls
                     if not is_allowed(rules, r.verb, r.group, r.resource, r.subresource, r.namespace)})
    assert denied == []
