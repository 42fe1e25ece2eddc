"""The chart's RBAC grants the operator exactly the requests it makes, in the namespaces it watches, and nothing more.

The request list: what grpo_operator does to runs and their children (and their core/v1 events: created, then
patched to count a repeat; listed for a pod that is not ready, for the kubelet's probe failures), plus what kopf
1.45.2 does on its own, read from its source: customresourcedefinitions list+watch to notice CRD changes, and
namespaces list+watch only when it watches named namespaces
(kopf/_core/reactor/observation.py).
`grporun operator` runs kopf standalone, so it never touches kopf.dev peering objects; it elects a leader on one
coordination.k8s.io Lease in the release namespace (grpo_operator.cluster.leader).
"""

from __future__ import annotations

import pytest

from tests.support.chart_rbac import is_allowed, rendered_rules
from tests.support.chart_render import RELEASE_NAMESPACE, objects_of_kind, render_objects

WATCHED = ("team-a", "team-b")
NAMESPACED = {"watch": {"allNamespaces": False, "namespaces": list(WATCHED)}}

# (verb, api group, resource, subresource) the operator needs inside every namespace it watches.
OPERATOR_REQUESTS = [
    *[(verb, "grpo.dev", "grporuns", None) for verb in ("get", "list", "watch", "patch", "update", "delete")],
    ("patch", "grpo.dev", "grporuns", "status"),
    *[
        (verb, "", resource, None)
        for resource in ("pods", "services", "configmaps")
        for verb in ("get", "list", "watch", "create", "delete", "patch")
    ],
    *[(verb, "", "events", None) for verb in ("create", "patch", "list")],
    *[(verb, "kueue.x-k8s.io", "workloads", None) for verb in ("get", "create", "patch")],
    ("patch", "kueue.x-k8s.io", "workloads", "status"),
    *[(verb, group, "podgroups", None) for group in ("scheduling.x-k8s.io", "scheduling.volcano.sh")
      for verb in ("get", "create", "patch", "delete")],
]
CRD_DISCOVERY = [*((verb, "apiextensions.k8s.io", "customresourcedefinitions") for verb in ("list", "watch")),
                 ("get", "kueue.x-k8s.io", "resourceflavors")]
NAMESPACE_DISCOVERY = [("list", "", "namespaces"), ("watch", "", "namespaces")]
# The fit check's read of the GPU nodes' labels (fitCheck.readNodes, on by default): cluster-scoped in either mode.
NODE_READS = [("list", "", "nodes")]
# Leader election, in the release namespace only (get and update limited to the release's Lease by name).
LEASE_REQUESTS = [(verb, "coordination.k8s.io", "leases", None) for verb in ("get", "create", "update")]

# Requests the operator never makes: granting any of them would not be least privilege.
NEVER = [
    ("get", "", "secrets", None),
    ("list", "", "secrets", None),
    ("create", "", "pods", "exec"),
    ("get", "", "pods", "log"),
    ("create", "grpo.dev", "grporuns", None),
    ("update", "grpo.dev", "grporuns", "status"),
    ("create", "apps", "deployments", None),
    ("create", "rbac.authorization.k8s.io", "roles", None),
    ("delete", "coordination.k8s.io", "leases", None),
    ("list", "coordination.k8s.io", "leases", None),
    ("list", "kopf.dev", "clusterkopfpeerings", None),
    ("patch", "kopf.dev", "kopfpeerings", None),
    ("delete", "kueue.x-k8s.io", "workloads", None),
    ("update", "kueue.x-k8s.io", "workloads", "status"),
    ("list", "kueue.x-k8s.io", "clusterqueues", None),
    ("get", "", "nodes", None),
    ("watch", "", "nodes", None),
    ("patch", "", "nodes", None),
]


def _granted(rules):
    return {
        (rule["namespace"], group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_wide_mode_allows_every_operator_request_everywhere():
    rules = rendered_rules({})
    for namespace in (None, "team-a", "any-namespace"):
        for verb, group, resource, subresource in OPERATOR_REQUESTS:
            assert is_allowed(rules, verb, group, resource, subresource, namespace=namespace), (
                verb, group, resource, subresource, namespace)
    for verb, group, resource in CRD_DISCOVERY + NODE_READS:
        assert is_allowed(rules, verb, group, resource)
    # kopf lists namespaces only when it watches named ones (observation.py: `not clusterwide`).
    for verb, group, resource in NAMESPACE_DISCOVERY:
        assert not is_allowed(rules, verb, group, resource)


def test_namespaced_mode_allows_the_operator_only_in_its_namespaces():
    rules = rendered_rules(NAMESPACED)
    for namespace in WATCHED:
        for verb, group, resource, subresource in OPERATOR_REQUESTS:
            assert is_allowed(rules, verb, group, resource, subresource, namespace=namespace), (
                verb, group, resource, subresource, namespace)
    for verb, group, resource, subresource in OPERATOR_REQUESTS:
        assert not is_allowed(rules, verb, group, resource, subresource, namespace="team-c")
        assert not is_allowed(rules, verb, group, resource, subresource, namespace=None)
    for verb, group, resource in CRD_DISCOVERY + NAMESPACE_DISCOVERY + NODE_READS:
        assert is_allowed(rules, verb, group, resource)


def test_cluster_discovery_can_be_turned_off():
    # kopf then logs a warning and scans once at start (observation.py catches the 403).
    rules = rendered_rules({**NAMESPACED, "rbac": {"clusterDiscovery": False}})
    for verb, group, resource in CRD_DISCOVERY + NAMESPACE_DISCOVERY:
        assert not is_allowed(rules, verb, group, resource)
    for verb, group, resource in NODE_READS:  # a value of its own
        assert is_allowed(rules, verb, group, resource)
    rules = rendered_rules({"rbac": {"clusterDiscovery": False}})
    for verb, group, resource in CRD_DISCOVERY:
        assert not is_allowed(rules, verb, group, resource)
    # Where no ClusterRole may be created, both off: nothing cluster-scoped is left.
    rules = rendered_rules({**NAMESPACED, "rbac": {"clusterDiscovery": False}, "fitCheck": {"readNodes": False}})
    assert all(rule["namespace"] in (*WATCHED, RELEASE_NAMESPACE) for rule in rules)
    assert not any(obj["kind"].startswith("Cluster") for obj in render_objects(
        {**NAMESPACED, "rbac": {"clusterDiscovery": False}, "fitCheck": {"readNodes": False}}))


def _operator_args(values):
    return objects_of_kind(render_objects(values), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_reading_the_gpu_nodes_is_granted_and_passed_to_the_operator_together(values):
    assert "--read-gpu-nodes" in _operator_args(values)
    for verb, group, resource in NODE_READS:
        assert is_allowed(rendered_rules(values), verb, group, resource)
    off = {**values, "fitCheck": {"readNodes": False}}
    assert "--read-gpu-nodes" not in _operator_args(off)
    for verb, group, resource in NODE_READS:
        assert not is_allowed(rendered_rules(off), verb, group, resource)


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_the_lease_is_granted_in_the_release_namespace_only_and_by_name(values):
    rules = rendered_rules(values)
    for verb, group, resource, subresource in LEASE_REQUESTS:
        assert is_allowed(rules, verb, group, resource, subresource, namespace=RELEASE_NAMESPACE)
        for namespace in (None, "team-c"):
            assert not is_allowed(rules, verb, group, resource, subresource, namespace=namespace)
    # ...and get/update only the Lease the operator is told to use.
    args = _operator_args(values)
    (lease,) = [a.removeprefix("--lease-name=") for a in args if a.startswith("--lease-name=")]
    named = [r for r in rules if "leases" in r["resources"] and set(r["verbs"]) & {"get", "update"}]
    assert named and all(r.get("resourceNames") == [lease] for r in named), (named, lease)


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_nothing_beyond_the_request_list_is_granted(values):
    rules = rendered_rules(values)
    for verb, group, resource, subresource in NEVER:
        for namespace in (None, *WATCHED, RELEASE_NAMESPACE):
            assert not is_allowed(rules, verb, group, resource, subresource, namespace=namespace), (verb, resource)
    assert not any("*" in rule[key] for rule in rules for key in ("apiGroups", "resources", "verbs"))
    expected_namespaces = [None] if not values else list(WATCHED)
    expected = {
        (namespace, group, f"{resource}/{subresource}" if subresource else resource, verb)
        for namespace in expected_namespaces
        for verb, group, resource, subresource in OPERATOR_REQUESTS
    }
    expected |= {(None, group, resource, verb) for verb, group, resource in CRD_DISCOVERY + NODE_READS}
    if values:
        expected |= {(None, group, resource, verb) for verb, group, resource in NAMESPACE_DISCOVERY}
    expected |= {(RELEASE_NAMESPACE, group, resource, verb) for verb, group, resource, _ in LEASE_REQUESTS}
    assert _granted(rules) == expected


def test_is_allowed_follows_kubernetes_rbac_semantics():
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "namespace": "a"},
        {"apiGroups": ["x.io"], "resources": ["*"], "verbs": ["list"], "namespace": None},
    ]
    assert is_allowed(rules, "get", "", "pods", namespace="a")
    assert not is_allowed(rules, "get", "", "pods", namespace="b")
    assert not is_allowed(rules, "get", "", "pods")  # a Role never answers a cluster-scoped request
    assert not is_allowed(rules, "get", "", "pods", "log", namespace="a")  # subresources are granted by name
    assert is_allowed(rules, "list", "x.io", "things", namespace="b")  # a ClusterRole binding covers every namespace
    assert not is_allowed(rules, "list", "", "things", namespace="b")


def test_no_rbac_objects_when_rbac_create_is_false():
    assert rendered_rules({"rbac": {"create": False}}) == []
