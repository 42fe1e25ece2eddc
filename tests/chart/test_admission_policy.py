"""The chart's ValidatingAdmissionPolicy: it matches every create and update of a GRPORun, its CEL lists exactly the
trainer arguments the operator sets from the spec (grpo_trainer.contract.config.MANAGED_TRAINER_ARGS) with the spec
field to use for each, and `admissionPolicy.enabled: false` leaves it out. tests/controlplane/test_admission_policy.py
shows the real API server enforcing it."""

from __future__ import annotations

from typing import Any

import celpy
import pytest

from grpo_trainer.contract.config import MANAGED_TRAINER_ARGS
from tests.operator.test_manifest import good
from tests.support.chart_render import RELEASE, objects_of_kind, render_objects

KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def evaluate(expression: str, **activation: Any) -> Any:
    environment = celpy.Environment()
    program = environment.program(environment.compile(expression))
    return program.evaluate({name: celpy.json_to_cel(value) for name, value in activation.items()})


def managed_args_objects(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The managed-trainer-args policy's objects of `kind` (the chart has a tenancy policy beside it)."""
    return [obj for obj in objects_of_kind(objects, kind) if obj["metadata"]["name"].endswith("-managed-trainer-args")]


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    [found] = managed_args_objects(render_objects(), "ValidatingAdmissionPolicy")
    return found


def variables(policy: dict[str, Any]) -> dict[str, str]:
    return {variable["name"]: variable["expression"] for variable in policy["spec"]["variables"]}


def refused_keys(policy: dict[str, Any], run: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """The keys the policy refuses, its variables evaluated in order as the API server does."""
    values: dict[str, Any] = {}
    request = {"operation": "CREATE" if old is None else "UPDATE"}
    for name, expression in variables(policy).items():
        values[name] = evaluate(expression, object=run, oldObject=old, request=request, variables=values)
    return [str(pair[0]) for pair in values["refused"]]


def test_the_policy_lists_exactly_the_managed_trainer_args_with_the_field_to_use(policy):
    pairs = [[str(key), str(field)] for key, field in evaluate(variables(policy)["managed"])]
    assert pairs == [[key, field] for key, field in MANAGED_TRAINER_ARGS.items()]


@pytest.mark.parametrize(("extra_args", "refused"), [
    ({"num_train_epochs": 99}, ["num_train_epochs"]),
    ({"beta": 0.1}, []),
    ({}, []),
    ({"use_cpu": True, "beta": 0.1, "learning_rate": 1}, ["learning_rate", "use_cpu"]),
])
def test_the_policy_refuses_only_managed_keys(policy, extra_args, refused):
    run = good()
    run["spec"]["training"]["extraArgs"] = extra_args
    assert refused_keys(policy, run) == refused


def test_a_run_without_training_or_extra_args_is_not_refused(policy):
    run = good()
    del run["spec"]["training"]["extraArgs"]
    assert refused_keys(policy, run) == []
    del run["spec"]["training"]
    assert refused_keys(policy, run) == []


def test_an_update_keeps_the_keys_the_stored_run_has_and_refuses_new_ones(policy):
    stored = good()
    stored["spec"]["training"]["extraArgs"] = {"seed": 1}
    updated = good()
    updated["spec"]["training"]["extraArgs"] = {"seed": 1, "use_cpu": True}
    assert refused_keys(policy, stored, old=stored) == []
    assert refused_keys(policy, updated, old=stored) == ["use_cpu"]
    assert refused_keys(policy, updated, old=good()) == ["seed", "use_cpu"]


def test_the_policy_matches_every_create_and_update_of_a_grporun_and_denies(policy):
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["grpo.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
        "resources": ["grporuns"]}]
    assert [v["expression"] for v in policy["spec"]["validations"]] == ["size(variables.refused) == 0"]
    [binding] = managed_args_objects(render_objects(), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["metadata"]["name"].startswith(RELEASE)


def test_admission_policy_enabled_false_leaves_out_both_policies():
    objects = render_objects({"admissionPolicy": {"enabled": False}})
    assert [obj for kind in KINDS for obj in objects_of_kind(objects, kind)] == []
