"""Gang scheduling (spec.scheduling.gang): one PodGroup, owned by the run, for all of its pods; each pod joins it and
is scheduled by the gang scheduler."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from grpo_operator import builders, podgroup
from grpo_operator.api import parse_spec
from grpo_operator.run_ref import RunRef
from tests.operator.test_lifecycle import _owner, _running
from tests.support.chart_rbac import is_allowed, rendered_rules
from tests.support.emulator.kube_emulator import COSCHEDULING_POD_GROUPS, VOLCANO_POD_GROUPS
from tests.support.specs import NAMESPACE, grporun, minimal_spec

UID = "0b7c2c9e-1111-2222-3333-444455556666"


def children(scheduling: dict[str, Any] | None, learner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    spec = minimal_spec(rollout={"replicas": 2}, learner={"nodes": 3, **(learner or {})})
    if scheduling is not None:
        spec["scheduling"] = scheduling
    return builders.build_children(RunRef("run", "ml", UID), parse_spec(spec), trainer_image="img")


def test_no_pod_group_unless_asked():
    objects = children(None)
    assert [o for o in objects if o["kind"] == "PodGroup"] == []
    assert all("schedulerName" not in o["spec"] for o in objects if o["kind"] == "Pod")


def test_coscheduling_pod_group_holds_every_pod_of_the_run():
    objects = children({"gang": {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 600}})
    (group,) = [o for o in objects if o["kind"] == "PodGroup"]
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 5, "scheduleTimeoutSeconds": 600}
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID and group["metadata"]["namespace"] == "ml"
    kinds = [o["kind"] for o in objects]
    assert kinds.index("PodGroup") < kinds.index("Pod"), "the group exists before its first pod"
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == group["spec"]["minMember"]
    for pod in pods:
        assert pod["metadata"]["labels"][podgroup.COSCHEDULING_LABEL] == group["metadata"]["name"]
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        kubernetes_validate.validate(pod, "1.33", strict=True)


def test_volcano_pods_join_by_annotation_and_the_gang_scheduler_wins():
    objects = children({"gang": {"scheduler": "volcano", "queue": "research", "schedulerName": "volcano-gpu"}},
                       learner={"podTemplateOverride": {"spec": {"schedulerName": "other"}}})
    (group,) = [o for o in objects if o["kind"] == "PodGroup"]
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 5, "queue": "research"}
    for pod in (o for o in objects if o["kind"] == "Pod"):
        assert pod["metadata"]["annotations"][podgroup.VOLCANO_ANNOTATION] == "run"
        assert pod["spec"]["schedulerName"] == "volcano-gpu"


@pytest.mark.slow
@pytest.mark.parametrize("scheduler, resource", [("coscheduling", COSCHEDULING_POD_GROUPS),
                                                 ("volcano", VOLCANO_POD_GROUPS)])
def test_the_operator_creates_the_pod_group_owned_by_the_run(cluster, scheduler, resource):
    spec = minimal_spec()
    spec["scheduling"] = {"gang": {"scheduler": scheduler}}
    run = cluster.apply(grporun("gang", spec))
    group = cluster.wait_for(lambda: cluster.client.get(resource, NAMESPACE, "gang"), what="the PodGroup")
    assert group["metadata"]["ownerReferences"] == [_owner(run)] and group["spec"]["minMember"] == 2
    cluster.wait_for(lambda: len(cluster.pods("gang")) == 2, what="pods")
    assert {p["spec"]["schedulerName"] for p in cluster.pods("gang")} == {podgroup.DEFAULT_SCHEDULER_NAMES[scheduler]}
    rules = rendered_rules({"watch": {"allNamespaces": False, "namespaces": [NAMESPACE]}})
    calls = [r for r in cluster.emulator.request_log if r.user_agent.startswith("kopf") and r.verb]
    assert any(r.resource == "podgroups" for r in calls)
    assert [r for r in calls if not is_allowed(rules, r.verb, r.group, r.resource, r.subresource, r.namespace)] == []


@pytest.mark.slow
def test_a_live_scale_of_a_gang_is_refused_and_says_why(cluster, learner, progress_urls):
    """The gang's PodGroup counts every pod of the run (minMember): the run keeps its servers and says why."""
    spec = minimal_spec(rollout={"weightSync": {"mode": "filesystem",
                                                "volume": {"persistentVolumeClaim": {"claimName": "w"}}}})
    spec["scheduling"] = {"gang": {"scheduler": "coscheduling"}}
    _running(cluster, learner, progress_urls, "gs", spec)
    cluster.patch_spec("gs", {"rollout": {"replicas": 2}})
    refused = cluster.wait_for(lambda: cluster.status("gs")["rollout"].get("scaleRefused"), what="the refusal")
    assert "its pods are one gang (spec.scheduling.gang) whose PodGroup counts them" in refused
    cluster.wait_event("gs", "ScaleRefused")
    assert cluster.pod_names("gs", "rollout") == ["gs-rollout-0"]
    assert cluster.client.get(COSCHEDULING_POD_GROUPS, NAMESPACE, "gs")["spec"]["minMember"] == 2


@pytest.mark.slow
def test_a_gang_edited_while_suspended_resumes_with_a_pod_group_that_counts_its_new_pods(cluster, learner,
                                                                                          progress_urls):
    spec = minimal_spec()
    spec["scheduling"] = {"gang": {"scheduler": "coscheduling"}}
    _running(cluster, learner, progress_urls, "ge", spec)
    cluster.patch_spec("ge", {"runPolicy": {"suspend": True}})
    cluster.wait_phase("ge", "Suspended")
    cluster.wait_for(lambda: cluster.pods("ge") == [], what="the pods deleted")
    cluster.patch_spec("ge", {"rollout": {"replicas": 2, "weightSync": {
        "mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}})
    cluster.patch_spec("ge", {"runPolicy": {"suspend": False}})
    cluster.wait_for(lambda: len(cluster.pods("ge")) == 3, what="two rollout pods and the learner")
    # A group still asking for 2 would let the scheduler place part of the gang, or hold the third pod forever.
    cluster.wait_for(lambda: cluster.client.get(COSCHEDULING_POD_GROUPS, NAMESPACE, "ge")["spec"]["minMember"] == 3,
                     what="the PodGroup's minMember to count the three pods")
    rules = rendered_rules({"watch": {"allNamespaces": False, "namespaces": [NAMESPACE]}})
    calls = [r for r in cluster.emulator.request_log if r.user_agent.startswith("kopf") and r.verb]
    assert [r for r in calls if not is_allowed(rules, r.verb, r.group, r.resource, r.subresource, r.namespace)] == []


@pytest.mark.slow
def test_a_gang_moved_to_the_other_scheduler_or_removed_while_suspended_leaves_no_stale_pod_group(cluster, learner,
                                                                                                  progress_urls):
    """Every PodGroup of the run follows the spec: on resume, the other scheduler's group replaces the old one, and
    a run whose gang was removed keeps none."""
    spec = minimal_spec()
    spec["scheduling"] = {"gang": {"scheduler": "coscheduling"}}
    _running(cluster, learner, progress_urls, "gm", spec)

    def groups() -> list[str]:
        return [resource.group for resource in (COSCHEDULING_POD_GROUPS, VOLCANO_POD_GROUPS)
                if cluster.client.get(resource, NAMESPACE, "gm") is not None]

    def resume_with(scheduling: dict[str, Any] | None) -> None:
        cluster.patch_spec("gm", {"runPolicy": {"suspend": True}})
        cluster.wait_phase("gm", "Suspended")
        cluster.wait_for(lambda: cluster.pods("gm") == [], what="the pods deleted")
        cluster.patch_spec("gm", {"scheduling": scheduling, "runPolicy": {"suspend": False}})
        cluster.wait_for(lambda: len(cluster.pods("gm")) == 2, what="the pods of the resumed run")

    assert groups() == ["scheduling.x-k8s.io"]
    resume_with({"gang": {"scheduler": "volcano"}})
    cluster.wait_passes(lambda: groups() == ["scheduling.volcano.sh"], what="only Volcano's PodGroup")
    assert {p["spec"]["schedulerName"] for p in cluster.pods("gm")} == {"volcano"}
    resume_with(None)
    cluster.wait_passes(lambda: groups() == [], what="no PodGroup left")
    assert {p["spec"].get("schedulerName") for p in cluster.pods("gm")} == {None}
    rules = rendered_rules({"watch": {"allNamespaces": False, "namespaces": [NAMESPACE]}})
    calls = [r for r in cluster.emulator.request_log if r.user_agent.startswith("kopf") and r.verb]
    assert ("delete", "scheduling.x-k8s.io") in {(r.verb, r.group) for r in calls}
    assert [r for r in calls if not is_allowed(rules, r.verb, r.group, r.resource, r.subresource, r.namespace)] == []
