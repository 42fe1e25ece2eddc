"""The chart's tenancy policy, evaluated by the reference CEL runtime (cel-cpp) with a stand-in authorizer: every way
a run's pods can read a Secret is checked against the requesting user's `get`, each distinct Secret once, a named
ServiceAccount against `create` on pods; the operator's own writes and runPolicy edits are not checked again; the
values switch leaves the policy out. tests/controlplane/test_tenancy_policy.py shows kube-apiserver enforcing it with
real RBAC."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.chart_render import objects_of_kind, render_objects
from tests.support.specs import minimal_spec

cel = pytest.importorskip("cel_expr_python.cel", reason="cel-expr-python is in the test extras; pip install it")
ext_strings = pytest.importorskip("cel_expr_python.ext.ext_strings")

USER, NAMESPACE = "bob", "team-a"
KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def tenancy_objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [obj for kind in KINDS for obj in objects_of_kind(render_objects(values), kind)
            if obj["metadata"]["name"].endswith("-tenancy")]


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    return tenancy_objects()[0]


@dataclass
class Authorizer:
    """What the API server's authorizer answers for the requesting user: the (verb, resource, name) it allows, name
    "*" for any; every check asked is recorded."""

    allowed: set[tuple[str, str, str]] = field(default_factory=set)
    asked: list[tuple[str, str, str]] = field(default_factory=list)

    def functions(self) -> list[Any]:
        builder, text = cel.Type.Map(cel.Type.STRING, cel.Type.DYN), cel.Type.STRING

        def member(name: str, result: Any, impl: Any, *parameters: Any) -> Any:
            return cel.FunctionDecl(name, [cel.Overload(f"authorizer_{name}", result, [builder, *parameters],
                                                        is_member=True, impl=impl)])
        return [*(member(step, builder, lambda built, value, step=step: {**built, step: value}, text)
                  for step in ("group", "resource", "namespace", "name")),
                member("check", builder, lambda built, verb: {**built, "verb": verb}, text),
                member("allowed", cel.Type.BOOL, self._allowed)]

    def _allowed(self, check: dict[str, Any]) -> bool:
        assert check["namespace"] == NAMESPACE and check["group"] == ""
        asked = (check["verb"], check["resource"], check.get("name", ""))
        self.asked.append(asked)
        return asked in self.allowed or (asked[0], asked[1], "*") in self.allowed


def refusals(policy: dict[str, Any], run_spec: dict[str, Any], authorizer: Authorizer,
             old_spec: dict[str, Any] | None = None) -> list[str]:
    """The messages of the validations the request fails, its variables evaluated in order as the API server does."""
    environment = cel.NewEnv(
        variables={name: cel.Type.DYN for name in ("object", "oldObject", "request", "variables")}
        | {"authorizer": cel.Type.Map(cel.Type.STRING, cel.Type.DYN)},
        extensions=[ext_strings.ExtStrings()], functions=authorizer.functions())
    data: dict[str, Any] = {
        "object": {"metadata": {"name": "r", "namespace": NAMESPACE}, "spec": run_spec},
        "oldObject": None if old_spec is None else {"metadata": {"name": "r"}, "spec": old_spec},
        "request": {"operation": "CREATE" if old_spec is None else "UPDATE", "namespace": NAMESPACE,
                    "userInfo": {"username": USER}},
        "authorizer": {}, "variables": {}}

    def evaluate(expression: str) -> Any:
        value = environment.compile(expression).eval(data=data)
        assert value.type() != cel.Type.ERROR, (expression, value.plain_value())
        return value.plain_value()
    for variable in policy["spec"]["variables"]:
        data["variables"] = {**data["variables"], variable["name"]: evaluate(variable["expression"])}
    return [evaluate(check["messageExpression"]) for check in policy["spec"]["validations"]
            if not evaluate(check["expression"])]


def with_pod(role: str, pod: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return minimal_spec(**{role: {"podTemplateOverride": {"spec": pod}}}, **spec)


def secret_refusal(name: str, *wheres: str) -> str:
    return (f"{USER} may not get Secret {name} in namespace {NAMESPACE}, which the run's pods would read "
            f"({', '.join(wheres)}): a GRPORun may use only the Secrets its creator may get")


LEARNER = "spec.learner.podTemplateOverride.spec"
ROLLOUT = "spec.rollout.podTemplateOverride.spec"
ENVIRONMENT = "spec.environments.podTemplateOverride.spec"
REFERENCES = {
    "secret volume": (with_pod("learner", {"volumes": [{"name": "v", "secret": {"secretName": "s"}}]}),
                      f"{LEARNER}.volumes"),
    "projected volume": (with_pod("rollout", {"volumes": [{"name": "v", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"secret": {"name": "s"}}]}}]}), f"{ROLLOUT}.volumes"),
    "csi driver secret": (with_pod("learner", {"volumes": [{"name": "v", "csi": {
        "driver": "d", "nodePublishSecretRef": {"name": "s"}}}]}), f"{LEARNER}.volumes"),
    "cephfs secretRef": (with_pod("learner", {"volumes": [{"name": "v", "cephfs": {
        "monitors": ["m"], "secretRef": {"name": "s"}}}]}), f"{LEARNER}.volumes"),
    "checkpoint volume": (minimal_spec(checkpoint={"volume": {"secret": {"secretName": "s"}}}),
                          "spec.checkpoint.volume"),
    "output volume": (minimal_spec(output={"volume": {"csi": {"driver": "d", "nodePublishSecretRef": {"name": "s"}}}}),
                      "spec.output.volume"),
    "object store credentials": (minimal_spec(output={"uri": "s3://models/runs", "credentialsSecret": "s"}),
                                 "spec.output.credentialsSecret"),
    "inputs volume": (minimal_spec(inputs={"volume": {"secret": {"secretName": "s"}}}), "spec.inputs.volume"),
    "inputs credentials": (minimal_spec(model="s3://models/qwen", inputs={"credentialsSecret": "s"}),
                           "spec.inputs.credentialsSecret"),
    "hub token": (minimal_spec(inputs={"hubTokenSecret": "s"}), "spec.inputs.hubTokenSecret"),
    "model cache volume": (minimal_spec(modelCache={"volume": {"csi": {"driver": "d", "nodePublishSecretRef": {
        "name": "s"}}}}), "spec.modelCache.volume"),
    "weight sync volume": (minimal_spec(rollout={"weightSync": {"mode": "filesystem", "volume": {
        "projected": {"sources": [{"secret": {"name": "s"}}]}}}}), "spec.rollout.weightSync.volume"),
    "env secretKeyRef": (with_pod("rollout", {"containers": [{"name": "rollout", "env": [
        {"name": "A", "value": "x"}, {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]}),
        f"{ROLLOUT}.containers.env"),
    "envFrom secretRef": (with_pod("learner", {"containers": [{"name": "learner", "envFrom": [
        {"configMapRef": {"name": "c"}}, {"secretRef": {"name": "s"}}]}]}), f"{LEARNER}.containers.envFrom"),
    "imagePullSecrets": (with_pod("learner", {"imagePullSecrets": [{"name": "s"}]}),
                         f"{LEARNER}.imagePullSecrets"),
    "environment env secretKeyRef": (minimal_spec(environments=[
        {"name": "a", "image": "a:1"},
        {"name": "b", "image": "b:1", "env": [
            {"name": "A", "value": "x"}, {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]),
        "spec.environments.env"),
    "environment override volume": (minimal_spec(environments=[{"name": "a", "image": "a:1", "podTemplateOverride": {
        "spec": {"volumes": [{"name": "v", "secret": {"secretName": "s"}}]}}}]), f"{ENVIRONMENT}.volumes"),
    "environment override envFrom": (minimal_spec(environments=[{"name": "a", "image": "a:1", "podTemplateOverride": {
        "spec": {"containers": [{"name": "environment", "envFrom": [{"secretRef": {"name": "s"}}]}]}}}]),
        f"{ENVIRONMENT}.containers.envFrom"),
    "environment override imagePullSecrets": (minimal_spec(environments=[
        {"name": "a", "image": "a:1", "podTemplateOverride": {"spec": {"imagePullSecrets": [{"name": "s"}]}}}]),
        f"{ENVIRONMENT}.imagePullSecrets"),
    "mlflow credentials": (minimal_spec(tracking={"mlflow": {"trackingUri": "http://m", "credentialsSecret": "s"}}),
                           "spec.tracking.mlflow.credentialsSecret"),
    "wandb api key": (minimal_spec(tracking={"wandb": {"project": "p", "apiKeySecret": {"name": "s", "key": "k"}}}),
                      "spec.tracking.wandb.apiKeySecret"),
}


@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_each_way_a_pod_reads_a_secret_needs_get_on_it(policy, case):
    spec, where = REFERENCES[case]
    assert refusals(policy, spec, Authorizer()) == [secret_refusal("s", where)]
    allowed = Authorizer({("get", "secrets", "s")})
    assert refusals(policy, spec, allowed) == []
    assert allowed.asked == [("get", "secrets", "s")]


def test_a_run_reading_no_secret_asks_nothing(policy):
    authorizer = Authorizer()
    assert refusals(policy, minimal_spec(), authorizer) == []
    assert authorizer.asked == []


def test_a_secret_read_in_several_places_is_checked_once_and_named_with_each_place(policy):
    spec = with_pod("learner", {"imagePullSecrets": [{"name": "s"}], "volumes": [
        {"name": "a", "secret": {"secretName": "s"}}, {"name": "b", "secret": {"secretName": "other"}}]},
        checkpoint={"volume": {"secret": {"secretName": "s"}}})
    authorizer = Authorizer({("get", "secrets", "other")})
    assert refusals(policy, spec, authorizer) == [
        secret_refusal("s", "spec.checkpoint.volume", f"{LEARNER}.volumes", f"{LEARNER}.imagePullSecrets")]
    assert sorted(authorizer.asked) == [("get", "secrets", "other"), ("get", "secrets", "s")]


def test_naming_a_service_account_needs_create_on_pods(policy):
    spec = with_pod("learner", {"serviceAccountName": "trainer"})
    assert refusals(policy, spec, Authorizer()) == [
        f"{USER} may not create pods in namespace {NAMESPACE}, so the run's pods may not run as ServiceAccount "
        f"trainer ({LEARNER}.serviceAccountName): naming a ServiceAccount takes the right to create pods"]
    assert refusals(policy, spec, Authorizer({("create", "pods", "")})) == []


def test_an_environment_naming_a_service_account_needs_create_on_pods(policy):
    spec = minimal_spec(environments=[{"name": "a", "image": "a:1", "podTemplateOverride": {
        "spec": {"serviceAccountName": "sandbox"}}}])
    assert refusals(policy, spec, Authorizer()) == [
        f"{USER} may not create pods in namespace {NAMESPACE}, so the run's pods may not run as ServiceAccount "
        f"sandbox ({ENVIRONMENT}.serviceAccountName): naming a ServiceAccount takes the right to create pods"]
    assert refusals(policy, spec, Authorizer({("create", "pods", "")})) == []


def test_an_update_that_changes_the_environments_is_checked(policy):
    stored = minimal_spec(environments=[{"name": "a", "image": "a:1"}], runPolicy={"suspend": True})
    changed = copy.deepcopy(stored)
    changed["environments"][0]["env"] = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert refusals(policy, changed, Authorizer(), old_spec=stored) == [
        secret_refusal("s", "spec.environments.env")]


def test_more_distinct_secrets_than_the_policy_checks_are_refused_not_admitted_unchecked(policy):
    def run(count: int) -> dict[str, Any]:
        return with_pod("learner", {"volumes": [{"name": f"v{i}", "secret": {"secretName": f"s{i}"}}
                                                for i in range(count)]})
    anything = Authorizer({("get", "secrets", "*")})
    assert refusals(policy, run(16), anything) == []
    assert len(anything.asked) == 16
    assert refusals(policy, run(17), Authorizer({("get", "secrets", "*")})) == [
        "the run's pods would read 17 Secret references: the tenancy admission policy checks at most 64 references "
        "to at most 16 distinct Secrets per run"]


def test_updates_are_checked_only_when_they_change_what_the_pods_are_built_from(policy):
    stored = with_pod("learner", {"serviceAccountName": "trainer", "volumes": [
        {"name": "v", "secret": {"secretName": "s"}}]})
    nobody = Authorizer()
    # The operator's metadata writes (the spec as it was) and a runPolicy edit, by users who may get nothing.
    assert refusals(policy, stored, nobody, old_spec=stored) == []
    suspended = copy.deepcopy(stored)
    suspended["runPolicy"]["suspend"] = True
    assert refusals(policy, suspended, nobody, old_spec=stored) == []
    assert nobody.asked == []
    grown = copy.deepcopy(suspended)
    grown["learner"]["nodes"] = 2
    assert len(refusals(policy, grown, nobody, old_spec=suspended)) == 2  # the Secret and the ServiceAccount


def test_the_policy_matches_every_create_and_update_of_a_grporun_and_denies():
    policy, binding = tenancy_objects()
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["grpo.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
        "resources": ["grporuns"]}]
    assert {check["reason"] for check in policy["spec"]["validations"]} == {"Forbidden"}
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_tenancy_enabled_false_leaves_it_out_and_keeps_the_other_policy():
    values = {"admissionPolicy": {"tenancy": {"enabled": False}}}
    assert tenancy_objects(values) == []
    assert len(objects_of_kind(render_objects(values), "ValidatingAdmissionPolicy")) == 1
