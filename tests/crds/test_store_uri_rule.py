"""The CRD's rule for object store URIs is the contract's (grpo_trainer.contract.store_uri.parse_uri), written in
CEL: every field that takes an s3:// URI admits exactly the URIs parse_uri reads, so `kubectl apply` refuses what
the operator would fail as InvalidSpec. tests/controlplane/test_api.py sends the same table to the real server."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_operator.manifest import evaluate_rule, is_transition_rule, load_crd, validate_manifest
from grpo_trainer.contract.store_uri import InvalidObjectStoreURI, parse_uri
from tests.operator.test_manifest import minimal

#: s3:// URIs and whether parse_uri reads them.
STORE_URIS: dict[str, bool] = {
    "s3://models": True,
    "s3://models/": True,
    "s3://models//": True,  # the whole bucket: trailing slashes are dropped
    "s3://my.models-1/runs/tiny": True,
    "s3://models/runs/tiny/": True,
    "s3://models/runs/tiny//": True,
    "s3://models/.hidden/x": True,
    "s3://models/.../x": True,  # three dots are a name, not a step up
    "s3://models/a b/é": True,
    "s3://models/a/../b": False,
    "s3://models/a/..": False,
    "s3://models//x": False,
    "s3://models/a//b": False,
    "s3://models/./x": False,
    "s3://models/x?v=1": False,
    "s3://models/x#frag": False,
    "s3://models/a\\b": False,
    "s3://models/a\x01b": False,
    "s3://Models/tiny": False,
    "s3://m/tiny": False,
    "s3://models..x/tiny": False,
    "s3:///tiny": False,
    "s3://-models/tiny": False,
}

#: Every field that takes an s3:// URI, and a manifest setting it.
URI_FIELDS = ("spec.model", "spec.dataset.path", "spec.output.uri", "spec.checkpoint.uri")


def with_uri(field: str, uri: str) -> dict[str, Any]:
    """The minimal manifest with `uri` in `field`."""
    manifest = minimal()
    spec = manifest["spec"]
    if field == "spec.model":
        spec["model"] = uri
    elif field == "spec.dataset.path":
        spec["dataset"] = {"path": uri}
    elif field == "spec.checkpoint.uri":
        spec["checkpoint"] = {"uri": uri}
    else:
        spec["output"] = {"uri": uri}
    return manifest


def _schema_of(field: str) -> dict[str, Any]:
    node = load_crd().schema
    for key in field.split("."):
        node = node["properties"][key]
    return node


def _crd_admits(field: str, uri: str) -> bool:
    node = _schema_of(field)
    rules = [rule for rule in node.get("x-kubernetes-validations", []) if not is_transition_rule(rule)]
    assert rules, f"{field}: the CRD has no rule for object store URIs"
    return all(evaluate_rule(rule, uri, node, field).passed for rule in rules)


def _parse_uri_reads(uri: str) -> bool:
    try:
        parse_uri(uri, "field")
    except InvalidObjectStoreURI:
        return False
    return True


@pytest.mark.parametrize("uri", STORE_URIS)
def test_the_table_is_parse_uris_verdict(uri):
    assert _parse_uri_reads(uri) is STORE_URIS[uri]


@pytest.mark.parametrize("field", URI_FIELDS)
@pytest.mark.parametrize("uri", STORE_URIS)
def test_the_crds_rule_admits_the_uris_parse_uri_reads(field, uri):
    assert _crd_admits(field, uri) is _parse_uri_reads(uri)


@pytest.mark.parametrize("field", URI_FIELDS)
@pytest.mark.parametrize("uri", [uri for uri, good in STORE_URIS.items() if not good])
def test_grporun_validate_refuses_a_bad_uri_in_one_line_naming_the_field(field, uri):
    errors = validate_manifest(with_uri(field, uri))
    assert len(errors) == 1 and errors[0].startswith(f"{field}: "), errors


def test_a_model_or_dataset_that_is_not_in_an_object_store_is_not_judged_as_a_uri():
    assert validate_manifest(with_uri("spec.model", "Qwen/Qwen3-0.6B")) == []
    assert validate_manifest(with_uri("spec.dataset.path", "/data/prompts.jsonl")) == []
    assert validate_manifest(with_uri("spec.output.uri", "gs://models/tiny"))[0].startswith("spec.output.uri: ")
