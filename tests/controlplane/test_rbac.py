"""The chart's RBAC before the real RBAC authorizer: the operator's ServiceAccount may make exactly the requests of
tests/test_chart_rbac.py's request list, where it watches, and is refused (403) everything else.

Two ways of asking: SubjectAccessReview (the authorizer's verdict on a request, without making it) and real requests
made with the account's own token.
"""

from __future__ import annotations

import json

import pytest

from tests.chart.test_rbac import (
    CRD_DISCOVERY,
    LEASE_REQUESTS,
    NAMESPACE_DISCOVERY,
    NAMESPACED,
    NEVER,
    NODE_READS,
    OPERATOR_REQUESTS,
    WATCHED,
)
from tests.support.chart_render import RELEASE_NAMESPACE, render_objects
from tests.support.controlplane.control_plane_client import Client
from tests.support.emulator.kube_emulator import PODS, ApiError

pytestmark = pytest.mark.controlplane

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def test_the_operator_account_is_allowed_its_requests_everywhere_and_nothing_else(admin, operator_account):
    user = operator_account.user
    for namespace in ("team-a", "any-namespace", None):
        for verb, group, resource, subresource in OPERATOR_REQUESTS:
            assert admin.can(user, verb, group, resource, subresource, namespace), (verb, resource, namespace)
        for verb, group, resource, subresource in NEVER:
            assert not admin.can(user, verb, group, resource, subresource, namespace), (verb, resource, namespace)
    for verb, group, resource in CRD_DISCOVERY + NODE_READS:
        assert admin.can(user, verb, group, resource)
    for verb, group, resource in NAMESPACE_DISCOVERY:
        assert not admin.can(user, verb, group, resource)


def test_with_its_own_token_an_allowed_request_works_and_a_forbidden_one_is_403(control_plane, admin,
                                                                                operator_account, namespace):
    operator = Client(control_plane, operator_account.token)
    assert operator.list(PODS, namespace) == []
    with pytest.raises(ApiError) as refused:
        operator.call("GET", f"/api/v1/namespaces/{namespace}/secrets")
    assert refused.value.code == 403
    message = json.loads(refused.value.message)["message"]
    assert f'User "{operator_account.user}" cannot list resource "secrets"' in message
    with pytest.raises(ApiError) as refused:
        operator.call("POST", f"/apis/grpo.dev/v1alpha1/namespaces/{namespace}/grporuns",
                      json={"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": "x"}})
    assert refused.value.code == 403  # the operator never creates runs


def test_namespaced_mode_is_allowed_only_in_its_namespaces(admin):
    """The chart rendered with watch.namespaces=[team-a, team-b], released into its own namespace. Its cluster-scoped
    objects are renamed so they do not collide with the cluster-wide release's."""
    release_namespace, suffix = "grpo-namespaced", "-namespaced"
    for name in (release_namespace, *WATCHED):
        admin.create_namespace(name)
    for obj in render_objects(NAMESPACED, namespace=release_namespace):
        if obj["kind"] not in RBAC_KINDS:
            continue
        if obj["kind"].startswith("Cluster"):
            obj["metadata"]["name"] += suffix
        if obj["kind"] == "ClusterRoleBinding":
            obj["roleRef"]["name"] += suffix
        admin.create_object(obj, release_namespace)
    user = f"system:serviceaccount:{release_namespace}:grpo-grpo-operator"
    for verb, group, resource, subresource in OPERATOR_REQUESTS:
        for namespace in WATCHED:
            assert admin.can(user, verb, group, resource, subresource, namespace), (verb, resource, namespace)
        assert not admin.can(user, verb, group, resource, subresource, "team-c"), (verb, resource)
        assert not admin.can(user, verb, group, resource, subresource, None), (verb, resource)
    for verb, group, resource in CRD_DISCOVERY + NAMESPACE_DISCOVERY + NODE_READS:
        assert admin.can(user, verb, group, resource)
    for verb, group, resource, subresource in NEVER:
        assert not admin.can(user, verb, group, resource, subresource, "team-a"), (verb, resource)


def _lease_name() -> str:
    deployment = next(obj for obj in render_objects() if obj["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return next(a.removeprefix("--lease-name=") for a in args if a.startswith("--lease-name="))


def test_the_operator_account_may_hold_only_its_own_lease_in_the_release_namespace(admin, operator_account):
    user, lease = operator_account.user, _lease_name()
    for verb, group, resource, _ in LEASE_REQUESTS:
        name = None if verb == "create" else lease
        assert admin.can(user, verb, group, resource, None, RELEASE_NAMESPACE, name), verb
        assert not admin.can(user, verb, group, resource, None, "team-a", name), verb
    assert not admin.can(user, "update", "coordination.k8s.io", "leases", None, RELEASE_NAMESPACE, "kube-scheduler")


def test_leader_election_with_the_operators_own_token_on_the_real_api_server(control_plane, operator_account):
    """grpo_operator.cluster.leader against kube-apiserver: the Lease it writes validates (MicroTime, holder), a second
    candidate is refused while the first renews, and takes over after the first releases."""
    import asyncio
    import logging

    import kopf

    from grpo_operator.cluster.leader import LeaderElector, LeaseClient, LeaseTimings

    timings = LeaseTimings(lease_duration=3, renew_deadline=2, retry_period=0.3)
    logger = logging.getLogger("test.leader")

    def elector(identity: str) -> LeaderElector:
        info = kopf.ConnectionInfo(server=control_plane.url, ca_path=str(control_plane.ca), scheme="Bearer",
                                   token=operator_account.token)
        client = LeaseClient(RELEASE_NAMESPACE, _lease_name(), kopf.OperatorSettings(), logger, login=lambda: info)
        return LeaderElector(client, identity, timings, logger)

    async def scenario() -> dict:
        a, b = elector("a"), elector("b")
        try:
            await asyncio.wait_for(a.acquire(), 10)
            holding = asyncio.create_task(a.hold())
            await asyncio.sleep(2 * timings.lease_duration)
            assert not await b.try_acquire_or_renew(), "a renewing holder lost its Lease"
            holding.cancel()
            await a.release()
            await asyncio.wait_for(b.acquire(), 2 * timings.retry_period + 1)
            return await b.client.read()
        finally:
            await a.client.close()
            await b.client.close()

    lease = asyncio.run(scenario())
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
