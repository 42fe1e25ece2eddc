"""The GRPORun CRD and the chart before a real kube-apiserver: what the server accepts, refuses, defaults and prints
is what `grporun validate`, `grporun render` and the chart tests assume.

Every bad manifest of tests/test_manifest.py is sent to the server (fieldValidation=Strict, as kubectl sends it)
and the server must refuse it naming the field `grporun validate` names; every good one must be admitted.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from grpo_operator.manifest import load_crd, load_manifest, validate_manifest, with_defaults
from tests.crds.test_store_uri_rule import STORE_URIS, URI_FIELDS, with_uri
from tests.operator.test_manifest import (
    CEL_CASES,
    ENVIRONMENT_UPDATE_CASES,
    GOOD_FIXTURES,
    STRUCTURAL_CASES,
    UPDATE_CASES,
    good,
)
from tests.operator.test_manifest import _agentic as agentic
from tests.support.chart_render import VALUE_SETS, render_manifests
from tests.support.controlplane.control_plane import ADMIN_TOKEN
from tests.support.controlplane.control_plane_client import kubectl
from tests.support.emulator.kube_emulator import GRPORUNS, ApiError

pytestmark = pytest.mark.controlplane

STRICT = {"fieldValidation": "Strict"}


def as_kubectl_sends(value: Any) -> Any:
    """Whole floats as integers, as kubectl's YAML-to-JSON writes them (`top_p: 1.0` goes out as 1). Python's json
    writes 1.0; the server stores it as 1 and reads it back as an integer, so `self == oldSelf` on a
    preserve-unknown-fields map (training.extraArgs) compares 1 with 1.0, which CEL calls unequal, and an
    unchanged re-send is refused as a change to an immutable field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: as_kubectl_sends(child) for key, child in value.items()}
    if isinstance(value, list):
        return [as_kubectl_sends(child) for child in value]
    return value


def _create(admin, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    body = as_kubectl_sends(copy.deepcopy(manifest))
    body.setdefault("metadata", {})["namespace"] = namespace
    return admin.call("POST", admin.path(GRPORUNS, namespace)[len(admin.url):], json=body, params=STRICT)


def server_fields(error: ApiError) -> list[str]:
    """The fields the server's refusal names, written as `grporun validate` writes them."""
    body = json.loads(error.message)
    fields = re.findall(r'unknown field "([^"]+)"', body["message"])
    for cause in (body.get("details") or {}).get("causes", []):
        field = cause.get("field", "")
        if field == "<nil>":
            # A rule on the object's root is reported there: fieldPath cannot point into metadata, so the CRD's
            # message for the metadata.name rule starts with the field, and that is where the server names it.
            field = re.sub(r'^Invalid value: ("object": )?', "", cause["message"]).split(": ", 1)[0]
        fields.append(field.lstrip("."))
    return fields


def _field(line: str) -> str:
    return line.split(": ", 1)[0]


def test_the_crd_is_established_and_structural(admin):
    crd = admin.call("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/grporuns.grpo.dev")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert "NonStructuralSchema" not in conditions


@pytest.mark.parametrize("path", GOOD_FIXTURES, ids=lambda path: path.name)
def test_good_manifests_are_admitted_and_defaulted_as_the_operator_defaults(admin, namespace, path):
    manifest = load_manifest(path)
    stored = _create(admin, namespace, manifest)
    assert stored["spec"] == with_defaults(manifest)["spec"]


BAD = {**{f"structural-{k}": v for k, v in STRUCTURAL_CASES.items()}, **{f"cel-{k}": v for k, v in CEL_CASES.items()}}


@pytest.mark.parametrize("make, expected", BAD.values(), ids=BAD.keys())
def test_bad_manifests_are_refused_by_the_server_naming_the_field_grporun_validate_names(admin, namespace, make,
                                                                                         expected):
    manifest = make()
    ours = validate_manifest(manifest)
    assert ours, "grporun validate admits it"
    with pytest.raises(ApiError) as refused:
        _create(admin, namespace, manifest)
    assert refused.value.code in (400, 422), refused.value.message
    assert _field(ours[0]) in server_fields(refused.value), (ours, refused.value.message)


@pytest.mark.parametrize("make, expected", UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_updates_are_judged_by_the_server_as_grporun_validate_judges_them(admin, namespace, make, expected):
    _judge_update(admin, namespace, good(), make(), expected)


@pytest.mark.parametrize("make, base, expected", ENVIRONMENT_UPDATE_CASES.values(),
                         ids=ENVIRONMENT_UPDATE_CASES.keys())
def test_live_environment_changes_are_judged_by_the_server_as_grporun_validate_judges_them(admin, namespace, make,
                                                                                            base, expected):
    """The per-field rule on spec.environments (all but replicas) passes the server's CEL cost limits and lets a
    running run's environment servers scale, as `grporun validate` says."""
    _judge_update(admin, namespace, (base or agentic)(), make(), expected)


def _judge_update(admin, namespace: str, stored: dict, updated: dict, expected: list[str]) -> None:
    """Create `stored`, then PUT `updated` over it as kubectl sends it: accepted when nothing is `expected`, else
    refused with the fields and the first message `grporun validate` gives."""
    stored = _create(admin, namespace, stored)
    updated["metadata"].update(namespace=namespace, resourceVersion=stored["metadata"]["resourceVersion"])
    path = admin.path(GRPORUNS, namespace, updated["metadata"]["name"])[len(admin.url):]
    updated = as_kubectl_sends(updated)
    if not expected:
        admin.call("PUT", path, json=updated, params=STRICT)
        return
    with pytest.raises(ApiError) as refused:
        admin.call("PUT", path, json=updated, params=STRICT)
    assert refused.value.code == 422, refused.value.message
    assert [_field(line) for line in expected] == server_fields(refused.value)
    assert expected[0].split(": ", 1)[1] in refused.value.message


@pytest.mark.parametrize("field", URI_FIELDS)
def test_object_store_uris_are_judged_by_the_server_as_parse_uri_judges_them(admin, namespace, field):
    """Each bad URI of the table is refused naming the field `grporun validate` names; each good one is admitted."""
    for number, (uri, good_uri) in enumerate(STORE_URIS.items()):
        manifest = with_uri(field, uri)
        manifest["metadata"]["name"] = f"uri-{number}"
        if good_uri:
            _create(admin, namespace, manifest)
            continue
        ours = validate_manifest(manifest)
        with pytest.raises(ApiError) as refused:
            _create(admin, namespace, manifest)
        assert refused.value.code == 422, (uri, refused.value.message)
        assert server_fields(refused.value) == [_field(ours[0])], (uri, refused.value.message)


def test_server_side_apply_of_a_minimal_manifest_stores_the_operators_defaults(admin, namespace):
    manifest = load_manifest(GOOD_FIXTURES[0].parent / "minimal.yaml")
    manifest["metadata"]["namespace"] = namespace
    path = admin.path(GRPORUNS, namespace, manifest["metadata"]["name"])[len(admin.url):]
    stored = admin.call("PATCH", path, json=as_kubectl_sends(manifest), params={"fieldManager": "test", **STRICT},
                        headers={"Content-Type": "application/apply-patch+yaml"})
    assert stored["spec"] == with_defaults(manifest)["spec"]


# Objects of the Prometheus Operator: their CRDs are not installed on the test server.
PROMETHEUS_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_template_is_accepted_by_a_server_side_dry_run(control_plane, admin, values):
    for name in ("grpo-system", "team-a", "team-b", "monitoring"):
        admin.create_namespace(name)
    documents = [text for path, text in sorted(render_manifests(values).items()) if path.endswith(".yaml")
                 and "/crds/" not in path and not any(f"kind: {kind}" in text for kind in PROMETHEUS_KINDS)]
    skipped = [path for path, text in render_manifests(values).items()
               if any(f"kind: {kind}" in text for kind in PROMETHEUS_KINDS)]
    assert values.get("metrics") or not skipped
    # Objects without a namespace go to the release namespace, as `helm install -n grpo-system` puts them.
    config = control_plane.write_kubeconfig(control_plane.workdir / "helm.kubeconfig", ADMIN_TOKEN, "grpo-system")
    done = kubectl(control_plane, config, "apply", "--server-side", "--dry-run=server", "--field-manager=helm",
                   "-f", "-", stdin="\n---\n".join(documents))
    applied = [line for line in done.stdout.splitlines() if line.strip()]
    assert applied and all(line.endswith("serverside-applied (server dry run)") for line in applied), done.stdout


def test_kubectl_explain_shows_the_crds_descriptions(control_plane):
    done = kubectl(control_plane, control_plane.kubeconfig, "explain", "grporun.spec.progress")
    crd = load_crd().schema["properties"]["spec"]["properties"]["progress"]
    assert " ".join(crd["description"].split()) in " ".join(done.stdout.split())
    for field in crd["properties"]:
        assert re.search(rf"^\s+{field}\s+<", done.stdout, re.MULTILINE), field


def test_kubectl_get_shows_the_printer_columns(control_plane, admin, namespace):
    run = _create(admin, namespace, load_manifest(GOOD_FIXTURES[0].parent / "minimal.yaml"))
    name = run["metadata"]["name"]
    status = {"phase": "Running", "progress": {"percent": 42.5, "epoch": 5, "groupsTrained": 80,
                                               "dropped": {"no_signal": 2}, "groupsDropped": 2,
                                               "estimatedRemainingSeconds": 360},
              "rollout": {"replicas": 2, "ready": 1},
              "conditions": [{"type": "Stalled", "status": "False", "reason": "Training", "message": "",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    admin.patch(GRPORUNS, namespace, name, {"status": status}, subresource="status")
    done = kubectl(control_plane, control_plane.kubeconfig, "get", "grporuns", "-n", namespace)
    header, row = done.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "PROGRESS", "EPOCH", "TRAINED", "DROPPED", "ETA", "SERVERS", "STALLED",
                              "AGE"]
    assert row.split()[:9] == [name, "Running", "42.5", "5", "80", "2", "360", "1", "False"]
