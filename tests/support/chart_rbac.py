"""What the chart's RBAC allows, evaluated the way the Kubernetes RBAC authorizer does.

`rendered_rules(values)` returns the rules bound to the operator's ServiceAccount, each with the namespace it
applies in (None: cluster-wide, from a ClusterRole bound by a ClusterRoleBinding). `is_allowed` answers one
request. tests/operator/test_rbac.py replays the operator emulator's recorded requests through these two functions.
"""

from __future__ import annotations

from typing import Any

from tests.support.chart_render import RELEASE_NAMESPACE, objects_of_kind, render_objects


def rendered_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Policy rules granted to the operator's ServiceAccount: dicts with apiGroups, resources, verbs and
    `namespace` (None for cluster-wide grants)."""
    objects = render_objects(values)
    deployment = objects_of_kind(objects, "Deployment")[0]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    account_namespace = RELEASE_NAMESPACE
    roles = {
        (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]): obj
        for obj in objects
        if obj["kind"] in ("Role", "ClusterRole")
    }
    rules: list[dict[str, Any]] = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace") == account_namespace
            for s in binding.get("subjects", [])
        ):
            continue
        binding_namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role_namespace = binding_namespace if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], role_namespace, ref["name"]))
        assert role is not None, f"{binding['kind']} {binding['metadata']['name']} refers to a missing {ref}"
        for rule in role.get("rules", []):
            rules.append({**rule, "namespace": binding_namespace})
    return rules


def _matches(allowed: list[str], value: str) -> bool:
    return "*" in allowed or value in allowed


def is_allowed(
    rules: list[dict[str, Any]],
    verb: str,
    api_group: str,
    resource: str,
    subresource: str | None = None,
    namespace: str | None = None,
) -> bool:
    """Whether any rule allows `verb` on `api_group`/`resource`[/`subresource`].

    `namespace` None asks for a cluster-scoped request (cluster-scoped resources, or a list/watch across all
    namespaces): only cluster-wide grants answer it. A namespaced request is allowed by a grant in that namespace or
    a cluster-wide one. Subresources must be granted by name (`pods/log`), as in Kubernetes.
    """
    full_resource = f"{resource}/{subresource}" if subresource else resource
    for rule in rules:
        if rule.get("namespace") is not None and rule["namespace"] != namespace:
            continue
        if (
            _matches(rule.get("verbs", []), verb)
            and _matches(rule.get("apiGroups", []), api_group)
            and _matches(rule.get("resources", []), full_resource)
        ):
            return True
    return False
