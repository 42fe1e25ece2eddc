"""The chart's ValidatingAdmissionPolicy before a real kube-apiserver: a GRPORun whose training.extraArgs sets an
argument the operator derives from the spec is refused at admission, naming the spec field to use, as `grporun
validate` names it; other extraArgs are admitted. The CRD cannot hold this rule (its CEL cannot type the free-form
map), so only the policy keeps such a run out of the cluster."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from grpo_operator.api import FINALIZER, SpecError, parse_spec
from grpo_operator.manifest import validate_manifest, with_defaults
from grpo_trainer.contract.config import managed_args_message
from tests.chart.test_admission_policy import managed_args_objects
from tests.controlplane.test_api import _create
from tests.operator.test_manifest import good
from tests.support.chart_render import render_objects
from tests.support.controlplane.control_plane_fixtures import delete_runs
from tests.support.emulator.kube_emulator import GRPORUNS, ApiError

pytestmark = pytest.mark.controlplane

API = "/apis/admissionregistration.k8s.io/v1"
LEGACY_NAMESPACE = "admission-policy-legacy"
PLURALS = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
           "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}


def with_extra_args(extra_args: dict[str, Any]) -> dict[str, Any]:
    manifest = copy.deepcopy(good())
    manifest["spec"]["training"]["extraArgs"] = extra_args
    return manifest


def grporun_validate(manifest: dict[str, Any]) -> list[str]:
    """What `grporun validate` says about a manifest: the CRD's verdict, then the spec model's."""
    problems = validate_manifest(manifest)
    try:
        parse_spec(with_defaults(manifest)["spec"])
    except SpecError as error:
        problems.append(str(error))
    return problems


def _refused(admin, namespace: str, manifest: dict[str, Any]) -> ApiError | None:
    """Whether a server-side dry run of the create is refused (and how); nothing is stored."""
    body = {**copy.deepcopy(manifest), "metadata": {**manifest["metadata"], "namespace": namespace}}
    try:
        admin.call("POST", admin.path(GRPORUNS, namespace)[len(admin.url):], json=body, params={"dryRun": "All"})
    except ApiError as error:
        return error
    return None


@pytest.fixture(scope="module")
def stored_before(admin) -> Iterator[tuple[str, str]]:
    """A run with a managed key, stored before the policy existed: (namespace, name). Deleted after the module, as
    the `namespace` fixture's runs are."""
    admin.create_namespace(LEGACY_NAMESPACE)
    stored = _create(admin, LEGACY_NAMESPACE, with_extra_args({"num_train_epochs": 99}))
    yield LEGACY_NAMESPACE, stored["metadata"]["name"]
    delete_runs(admin, LEGACY_NAMESPACE)


@pytest.fixture(scope="module")
def policy(admin, stored_before) -> Iterator[list[dict[str, Any]]]:
    """The chart's policy and binding (default values) on the server; removed again after the module."""
    yield from installed(admin, [obj for kind in PLURALS for obj in managed_args_objects(render_objects(), kind)])


def installed(admin, objects: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """A fixture's body: a policy and its binding created on the server, deleted again when the fixture ends."""
    assert [obj["kind"] for obj in objects] == list(PLURALS)
    for obj in objects:
        admin.call("POST", f"{API}/{PLURALS[obj['kind']]}", json=obj)
    yield objects
    for obj in reversed(objects):
        admin.call("DELETE", f"{API}/{PLURALS[obj['kind']]}/{obj['metadata']['name']}")


@pytest.fixture()
def enforced(policy, admin, namespace) -> str:
    """The server loads a new policy asynchronously: wait until a dry run of a refused run is refused."""
    probe, deadline = with_extra_args({"seed": 1}), time.monotonic() + 60
    while _refused(admin, namespace, probe) is None:
        assert time.monotonic() < deadline, "the admission policy was not enforced within 60 s"
        time.sleep(0.5)
    return namespace


def test_a_run_setting_a_managed_trainer_arg_is_refused_naming_the_spec_field(admin, enforced):
    manifest = with_extra_args({"num_train_epochs": 99})
    expected = f"spec.training.extraArgs: {managed_args_message(['num_train_epochs'])}"
    assert grporun_validate(manifest) == [expected]
    with pytest.raises(ApiError) as refused:
        _create(admin, enforced, manifest)
    body = json.loads(refused.value.message)
    assert refused.value.code == 422 and body["reason"] == "Invalid", body
    assert body["message"].endswith(f"denied request: {expected}"), body["message"]
    assert "training.epochs" in body["message"]


def test_every_managed_key_a_run_sets_is_named_in_one_refusal(admin, enforced):
    manifest = with_extra_args({"learning_rate": 1, "beta": 0.1, "use_cpu": 1})
    expected = f"spec.training.extraArgs: {managed_args_message(['learning_rate', 'use_cpu'])}"
    assert grporun_validate(manifest) == [expected]
    error = _refused(admin, enforced, manifest)
    assert error is not None
    assert json.loads(error.message)["message"].endswith(f"denied request: {expected}")


def test_a_run_with_other_extra_args_is_admitted(admin, enforced):
    manifest = with_extra_args({"beta": 0.1})
    assert grporun_validate(manifest) == []
    stored = _create(admin, enforced, manifest)
    assert stored["spec"]["training"]["extraArgs"] == {"beta": 0.1}


def test_a_run_stored_before_the_policy_still_takes_the_operators_writes_and_can_be_deleted(admin, enforced,
                                                                                          stored_before):
    namespace, name = stored_before
    path = admin.path(GRPORUNS, namespace, name)[len(admin.url):]
    merge = {"headers": {"Content-Type": "application/merge-patch+json"}}
    # kopf adds its finalizer and annotations to the run itself (UPDATE, not the status subresource) and removes the
    # finalizer on deletion: refusing those would leave the run undeletable.
    admin.call("PATCH", path, json={"metadata": {"finalizers": [FINALIZER], "annotations": {"a": "b"}}}, **merge)
    admin.call("DELETE", path)
    assert admin.call("GET", path)["metadata"]["deletionTimestamp"]
    admin.call("PATCH", path, json={"metadata": {"finalizers": None}}, **merge)
    with pytest.raises(ApiError) as gone:
        admin.call("GET", path)
    assert gone.value.code == 404
