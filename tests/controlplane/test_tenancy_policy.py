"""The chart's tenancy policy before a real kube-apiserver with RBAC: a GRPORun's pods are created by the operator with
its own rights, so the API server refuses a run whose pods would read a Secret its creator may not `get`, or that
names a ServiceAccount while its creator may not `create` pods. Two users who may both create runs: alice may get the
Secret `private` and create pods, bob may only get `shared`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.controlplane.test_admission_policy import PLURALS, installed
from tests.support.chart_render import objects_of_kind, render_objects
from tests.support.controlplane.control_plane_client import Client
from tests.support.emulator.kube_emulator import GRPORUNS, ApiError
from tests.support.specs import grporun, minimal_spec

pytestmark = pytest.mark.controlplane

RBAC = "rbac.authorization.k8s.io/v1"


@pytest.fixture(scope="module")
def tenancy_policy(admin) -> Iterator[list[dict[str, Any]]]:
    """The chart's tenancy policy and its binding (default values) on the server, for this module."""
    yield from installed(admin, [obj for kind in PLURALS for obj in objects_of_kind(render_objects(), kind)
                                 if obj["metadata"]["name"].endswith("-tenancy")])


@dataclass
class Team:
    namespace: str
    alice: Client
    bob: Client

    def user(self, name: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{name}"


def _role(namespace: str, name: str, rules: list[dict[str, Any]], subjects: list[str]) -> list[dict[str, Any]]:
    return [{"apiVersion": RBAC, "kind": "Role", "metadata": {"name": name, "namespace": namespace}, "rules": rules},
            {"apiVersion": RBAC, "kind": "RoleBinding", "metadata": {"name": name, "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": s, "namespace": namespace} for s in subjects]}]


def _secret_reader(name: str) -> list[dict[str, Any]]:
    return [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": [name]}]


@pytest.fixture()
def team(control_plane, admin, namespace, tenancy_policy) -> Team:
    for secret in ("shared", "private"):
        admin.call("POST", f"/api/v1/namespaces/{namespace}/secrets", json={
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "stringData": {"token": secret}})
    for account in ("alice", "bob"):
        admin.create_object({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}}, namespace)
    runs = [{"apiGroups": ["grpo.dev"], "resources": ["grporuns"], "verbs": ["create", "get", "patch", "update"]}]
    objects = (_role(namespace, "run-author", runs + _secret_reader("shared"), ["alice", "bob"])
               + _role(namespace, "trainer", _secret_reader("private") + [
                   {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}], ["alice"]))
    for obj in objects:
        admin.create_object(obj, namespace)
    team = Team(namespace, *(Client(control_plane, admin.service_account_token(namespace, account))
                             for account in ("alice", "bob")))
    # The server loads a new policy and RBAC change asynchronously: wait until bob is refused and alice is not.
    deadline, probe = time.monotonic() + 60, _run("probe", private_everywhere())
    while (bob := _refusal(team.bob, namespace, probe)) is None or (
            alice := _refusal(team.alice, namespace, probe)) is not None:
        assert time.monotonic() < deadline, f"the tenancy policy was not enforced within 60 s: {bob=} {alice=}"
        time.sleep(0.5)
    return team


def private_everywhere(service_account: str | None = "trainer") -> dict[str, Any]:
    """A spec whose pods read the Secret `private` in every way a pod can, and `shared` as well."""
    learner_pod: dict[str, Any] = {
        "imagePullSecrets": [{"name": "private"}],
        "volumes": [{"name": "creds", "secret": {"secretName": "private"}}],
        "containers": [{"name": "learner", "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
                        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "private", "key": "token"}}}],
                        "envFrom": [{"secretRef": {"name": "shared"}}]}]}
    if service_account:
        learner_pod["serviceAccountName"] = service_account
    return minimal_spec(
        checkpoint={"volume": {"projected": {"sources": [{"secret": {"name": "private"}}]}}},
        rollout={"podTemplateOverride": {"spec": {"containers": [
            {"name": "rollout", "envFrom": [{"secretRef": {"name": "private"}}]}]}}},
        learner={"podTemplateOverride": {"spec": learner_pod}})


def shared_only(service_account: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [{"name": "learner", "envFrom": [{"secretRef": {"name": "shared"}}]}]}
    if service_account:
        pod["serviceAccountName"] = service_account
    return minimal_spec(learner={"podTemplateOverride": {"spec": pod}})


def _run(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return grporun(name, spec)


def _path(client: Client, namespace: str, name: str | None = None) -> str:
    return client.path(GRPORUNS, namespace, name)[len(client.url):]


def _refusal(client: Client, namespace: str, body: dict[str, Any], *, dry_run: bool = True) -> ApiError | None:
    body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
    try:
        client.call("POST", _path(client, namespace), json=body, params={"dryRun": "All"} if dry_run else {})
    except ApiError as error:
        return error
    return None


def _message(error: ApiError) -> str:
    return json.loads(error.message)["message"]


def test_a_user_who_may_get_every_secret_and_create_pods_creates_the_run(team):
    assert _refusal(team.alice, team.namespace, _run("alice-run", private_everywhere()), dry_run=False) is None
    assert team.alice.call("GET", _path(team.alice, team.namespace, "alice-run"))["metadata"]["name"] == "alice-run"


def test_a_user_who_may_not_get_a_secret_is_refused_with_each_reference_named(team):
    error = _refusal(team.bob, team.namespace, _run("bob-run", private_everywhere(service_account=None)),
                     dry_run=False)
    assert error is not None and error.code == 403, error
    wheres = ["spec.checkpoint.volume", "spec.rollout.podTemplateOverride.spec.containers.envFrom",
              "spec.learner.podTemplateOverride.spec.volumes",
              "spec.learner.podTemplateOverride.spec.imagePullSecrets",
              "spec.learner.podTemplateOverride.spec.containers.env"]
    assert _message(error).endswith(
        f"{team.user('bob')} may not get Secret private in namespace {team.namespace}, which the run's pods would "
        f"read ({', '.join(wheres)}): a GRPORun may use only the Secrets its creator may get"), _message(error)
    assert "Secret shared" not in _message(error)  # bob may get that one
    with pytest.raises(ApiError) as gone:
        team.alice.call("GET", _path(team.alice, team.namespace, "bob-run"))
    assert gone.value.code == 404


def test_a_user_is_admitted_with_the_secrets_they_may_get(team):
    assert _refusal(team.bob, team.namespace, _run("bob-shared", shared_only()), dry_run=False) is None


def test_naming_a_service_account_takes_the_right_to_create_pods(team):
    error = _refusal(team.bob, team.namespace, _run("bob-sa", shared_only(service_account="trainer")))
    assert error is not None and error.code == 403, error
    message = _message(error)
    assert message.endswith(
        f"{team.user('bob')} may not create pods in namespace {team.namespace}, so the run's pods may not run as "
        "ServiceAccount trainer (spec.learner.podTemplateOverride.spec.serviceAccountName): naming a "
        "ServiceAccount takes the right to create pods"), message
    assert _refusal(team.alice, team.namespace, _run("alice-sa", shared_only(service_account="trainer"))) is None


def test_the_operators_writes_and_run_policy_edits_are_not_checked_but_pod_changes_are(control_plane, team,
                                                                                        operator_account):
    """bob may edit alice's run: its runPolicy, and the operator's metadata writes (the operator may get no Secret),
    are admitted; a change to what the pods are built from is checked against whoever makes it."""
    assert _refusal(team.alice, team.namespace, _run("shared-run", private_everywhere()), dry_run=False) is None
    path = _path(team.bob, team.namespace, "shared-run")
    merge = {"headers": {"Content-Type": "application/merge-patch+json"}}
    operator = Client(control_plane, operator_account.token)
    operator.call("PATCH", path, json={"metadata": {"annotations": {"grpo.dev/example": "x"}}}, **merge)
    team.bob.call("PATCH", path, json={"spec": {"runPolicy": {"suspend": True}}}, **merge)
    # Several learner ranks sync weights through a volume (the CRD refuses NCCL from more than one rank).
    two_ranks = {"spec": {"learner": {"nodes": 2}, "rollout": {"weightSync": {"mode": "filesystem"}}}}
    with pytest.raises(ApiError) as refused:  # suspended, so the CRD lets the learner change
        team.bob.call("PATCH", path, json=two_ranks, **merge)
    assert refused.value.code == 403 and "Secret private" in _message(refused.value), refused.value.message
    team.alice.call("PATCH", path, json=two_ranks, **merge)


def _many_secrets(count: int) -> dict[str, Any]:
    volumes = [{"name": f"s{i}", "secret": {"secretName": f"s{i}"}} for i in range(count)]
    return minimal_spec(learner={"podTemplateOverride": {"spec": {"volumes": volumes}}})


def test_every_secret_of_a_run_is_checked_up_to_the_policy_limit(admin, team):
    """Each authorizer check costs a share of the request's CEL budget: sixteen distinct Secrets fit and are all
    checked; a run with more is refused with the limit named, never admitted unchecked."""
    for obj in _role(team.namespace, "all-secrets", [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}], ["alice"]):
        admin.create_object(obj, team.namespace)
    deadline = time.monotonic() + 30
    while _refusal(team.alice, team.namespace, _run("many", _many_secrets(16))) is not None:
        assert time.monotonic() < deadline, "alice's new Role was not in effect within 30 s"
        time.sleep(0.5)
    refused = _refusal(team.bob, team.namespace, _run("many", _many_secrets(16)))
    assert refused is not None and "may not get Secret s0 " in _message(refused), refused
    too_many = _refusal(team.alice, team.namespace, _run("many", _many_secrets(17)))
    assert too_many is not None and too_many.code == 403, too_many
    assert _message(too_many).endswith(
        "the run's pods would read 17 Secret references: the tenancy admission policy checks at most 64 references "
        "to at most 16 distinct Secrets per run"), _message(too_many)


def test_a_scale_through_the_scale_subresource_is_not_checked(admin, team):
    """The policy matches `grporuns`, not `grporuns/scale`: bob may scale alice's run (more copies of pods that read
    the Secrets alice may get), while the same change as a spec patch is checked against him."""
    spec = private_everywhere()
    spec["rollout"]["weightSync"] = {"mode": "filesystem"}  # several servers (NCCL serves one)
    assert _refusal(team.alice, team.namespace, _run("scaled-run", spec), dry_run=False) is None
    for obj in _role(team.namespace, "scaler", [{"apiGroups": ["grpo.dev"], "resources": ["grporuns/scale"],
                                                 "verbs": ["get", "patch", "update"]}], ["bob"]):
        admin.create_object(obj, team.namespace)
    path = _path(team.bob, team.namespace, "scaled-run")
    merge = {"headers": {"Content-Type": "application/merge-patch+json"}}
    deadline = time.monotonic() + 30
    while True:  # the RBAC change reaches the authorizer asynchronously
        try:
            scale = team.bob.call("PATCH", f"{path}/scale", json={"spec": {"replicas": 2}}, **merge)
            break
        except ApiError as error:
            assert error.code == 403 and time.monotonic() < deadline, error.message
            time.sleep(0.5)
    assert scale["spec"]["replicas"] == 2
    assert admin.call("GET", path)["spec"]["rollout"]["replicas"] == 2
    with pytest.raises(ApiError) as refused:
        team.bob.call("PATCH", path, json={"spec": {"rollout": {"replicas": 3}}}, **merge)
    assert refused.value.code == 403 and "Secret private" in _message(refused.value), refused.value.message
