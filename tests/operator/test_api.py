"""grpo_operator.api mirrors the CRD field for field (names, types, defaults, enums, ranges), so the two cannot
drift; parse_spec turns a bad spec into one line naming the field."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from grpo_operator.api import GRPORunSpec, SpecError, parse_spec
from grpo_operator.manifest import load_crd, load_manifest, with_defaults
from grpo_operator.run_status import GRPORunStatus, parse_status
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES

SPEC_SCHEMA = load_crd().schema["properties"]["spec"]
STATUS_SCHEMA = load_crd().schema["properties"]["status"]

_SCALAR_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        assert len(rest) == 1, annotation
        return rest[0]
    return annotation


def _schema_type(annotation: Any) -> str:
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "string"
    if origin is list:
        return "array"
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "object"
    if isinstance(annotation, type) and issubclass(annotation, str):  # str enums (Phase)
        return "string"
    return _SCALAR_TYPES[annotation]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    annotation = _unwrap_optional(annotation)
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def field_pairs(model: type[BaseModel], schema: dict[str, Any], path: str) -> Iterator[tuple[str, FieldInfo, dict]]:
    """(wire path, model field, CRD schema node) for every field of the model, recursively; asserts the two declare
    the same field names at every level."""
    if schema.get("type") == "array":
        schema = schema["items"]
    by_alias = {field.alias: field for field in model.model_fields.values()}
    assert set(by_alias) == set(schema["properties"]), f"{path}: model and CRD declare different fields"
    for alias, field in by_alias.items():
        node = schema["properties"][alias]
        REQUIRED[f"{path}.{alias}"] = alias in schema.get("required", [])
        yield f"{path}.{alias}", field, node
        nested = _nested_model(field.annotation)
        if nested is not None:
            yield from field_pairs(nested, node, f"{path}.{alias}")


REQUIRED: dict[str, bool] = {}  # wire path -> required by its parent object in the CRD
SPEC_PAIRS = list(field_pairs(GRPORunSpec, SPEC_SCHEMA, "spec"))
STATUS_PAIRS = list(field_pairs(GRPORunStatus, STATUS_SCHEMA, "status"))


_BOUND_ATTRIBUTE = {annotated_types.Gt: "gt", annotated_types.Ge: "ge", annotated_types.Le: "le",
                    annotated_types.Lt: "lt", annotated_types.MinLen: "min_length"}


def _bound(field: FieldInfo, kind: type) -> Any:
    return next((getattr(item, _BOUND_ATTRIBUTE[kind]) for item in field.metadata if isinstance(item, kind)), None)


@pytest.mark.parametrize("path, field, node", SPEC_PAIRS + STATUS_PAIRS,
                         ids=[p for p, _, _ in SPEC_PAIRS + STATUS_PAIRS])
def test_spec_model_and_crd_agree_on_type_and_enum(path, field, node):
    assert _schema_type(field.annotation) == node["type"]
    literal = _unwrap_optional(field.annotation)
    if typing.get_origin(literal) is typing.Literal:
        assert list(typing.get_args(literal)) == node["enum"]
    else:
        assert "enum" not in node or [member.value for member in literal] == node["enum"]


@pytest.mark.parametrize("path, field, node", SPEC_PAIRS, ids=[p for p, _, _ in SPEC_PAIRS])
def test_spec_model_and_crd_agree_on_defaults_and_ranges(path, field, node):
    if "default" in node:
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            assert node["default"] == {}, "object defaults are {} and filled in from the leaves"
        else:
            assert default == node["default"] and type(default) is type(node["default"]) or (
                node["type"] == "number" and float(default) == float(node["default"])
            ), f"{path}: model default {default!r}, CRD default {node['default']!r}"
    elif REQUIRED[path]:
        assert field.is_required(), path
    else:
        assert not field.is_required() and field.get_default(call_default_factory=True) is None, path
    exclusive = node.get("exclusiveMinimum") is True
    assert _bound(field, annotated_types.Gt if exclusive else annotated_types.Ge) == node.get("minimum")
    exclusive_max = node.get("exclusiveMaximum") is True
    assert _bound(field, annotated_types.Lt if exclusive_max else annotated_types.Le) == node.get("maximum")
    # The CRD may be stricter than the model (minLength on names), never laxer.
    min_len = _bound(field, annotated_types.MinLen)
    assert min_len is None or min_len == node.get("minLength", node.get("minItems", node.get("minProperties"))), path


def test_spec_every_crd_default_is_mirrored():
    crd_defaults = sum(1 for _, node in _schema_nodes(SPEC_SCHEMA) if "default" in node)
    assert crd_defaults == sum(1 for _, _, node in SPEC_PAIRS if "default" in node)


def _schema_nodes(schema: dict[str, Any], path: str = "spec") -> Iterator[tuple[str, dict]]:
    for key, child in schema.get("properties", {}).items():
        yield f"{path}.{key}", child
        yield from _schema_nodes(child.get("items", child), f"{path}.{key}")


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(child) for key, child in value.items() if child is not None}
    if isinstance(value, list):
        return [_without_nulls(child) for child in value]
    return value


@pytest.mark.parametrize("fixture", ["minimal.yaml", "cpu-local.yaml", "full-gpu.yaml"])
def test_spec_model_defaults_equal_the_api_servers_defaulting(fixture):
    """The whole defaulted tree, not just the leaves: the API server's stored spec is what parse_spec yields."""
    manifest = load_manifest(FIXTURES / fixture)
    stored = with_defaults(manifest)["spec"]
    assert _without_nulls(parse_spec(manifest["spec"]).to_wire()) == stored


def _good_spec() -> dict[str, Any]:
    return load_manifest(FIXTURES / "minimal.yaml")["spec"]


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda spec: spec.update(trainning={}), "spec.trainning: unknown field"),
        (lambda spec: spec.pop("model"), "spec.model: required field is missing"),
        (lambda spec: spec.update(model=""), "spec.model: string should have at least 1 character"),
        (lambda spec: spec.update(rewards=[]), "spec.rewards: list should have at least 1 item"),
        (lambda spec: spec.update(training={"epochs": 0}), "spec.training.epochs: input should be greater than 0"),
        (lambda spec: spec.update(dataset={"name": "a", "path": "b"}),
         "spec.dataset: set exactly one of dataset.name or dataset.path"),
        (lambda spec: spec["rewards"].append({"function": "nocolon"}),
         "spec.rewards[1]: reward function 'nocolon' must look like 'module:function'"),
        (lambda spec: spec.update(rollout={"vllm": {"maxModelLen": "long"}}),
         "spec.rollout.vllm.maxModelLen: input should be a valid integer"),
        (lambda spec: spec.update(runPolicy={"cleanPodPolicy": "Some"}),
         "spec.runPolicy.cleanPodPolicy: input should be 'Running', 'All' or 'None'"),
        (lambda spec: spec.update(tracking={"wandb": {"project": "grpo"}}),
         "spec.tracking.wandb: online mode needs apiKeySecret (or mode offline)"),
        (lambda spec: spec.update(tracking={"mlflow": {"experiment": "grpo"}}),
         "spec.tracking.mlflow.trackingUri: required field is missing"),
        (lambda spec: spec.update(environments=[{"name": "guess", "image": "a"}, {"name": "guess", "image": "b"}]),
         "spec.environments: environment names must be unique: guess named more than once"),
        (lambda spec: spec.update(environments=[{"name": "Guess_1", "image": "a"}]),
         "spec.environments[0].name: 'Guess_1' must be a DNS-1035 label"),
        (lambda spec: spec.update(environments=[{"name": "guess", "image": "a", "port": 70000}]),
         "spec.environments[0].port: input should be less than or equal to 65535"),
        (lambda spec: spec.update(checkpoint={"uri": "s3://ckpts/run", "endpoint": "http://a:9000"},
                                  output={"uri": "s3://models/run", "endpoint": "http://b:9000"}),
         "spec: checkpoint.uri and output.uri: credentialsSecret, endpoint and region must be the same"),
        (lambda spec: spec.update(checkpoint={"uri": "s3://ckpts/run", "keep": 1}),
         "spec.checkpoint.keep: input should be greater than or equal to 2"),
    ],
    ids=["unknown", "missing", "empty", "no-rewards", "range", "one-of", "function", "type", "enum", "wandb-key",
         "mlflow-uri", "environment-duplicate", "environment-name", "environment-port",
         "checkpoint-store-unlike-output", "checkpoint-keep"],
)
def test_spec_parse_errors_name_the_field_in_one_line(change, expected):
    spec = _good_spec()
    change(spec)
    with pytest.raises(SpecError) as raised:
        parse_spec(spec)
    assert str(raised.value).startswith(expected)
    assert "\n" not in str(raised.value)
    assert raised.value.field_path == expected.split(":")[0]


def test_a_sharded_learner_of_several_pods_may_keep_its_checkpoints_in_the_object_store():
    # Each pod uploads its own ranks' shards (grpo_trainer.learner.checkpoint_store): no shared volume needed.
    spec = _good_spec()
    spec.update(checkpoint={"uri": "s3://ckpts/run"}, learner={"strategy": "fsdp2", "nodes": 2})
    parsed = parse_spec(spec)
    assert parsed.checkpoint.uri == "s3://ckpts/run" and parsed.learner_world_size == 2


def test_spec_parse_rejects_a_non_mapping():
    with pytest.raises(SpecError, match=r"^spec: must be a mapping, not list$"):
        parse_spec([])


def test_spec_parse_accepts_snake_case_and_camel_case_alike():
    spec = _good_spec()
    spec["runPolicy"] = {"backoffLimit": 0}
    spec["learner"] = {"processes_per_node": 4}
    parsed = parse_spec(spec)
    assert parsed.run_policy.backoff_limit == 0 and parsed.learner_world_size == 4


def test_spec_status_round_trips_and_ignores_fields_from_newer_operators():
    wire = {"phase": "Running", "restarts": 2, "futureField": 1,
            "conditions": [{"type": "Stalled", "status": "True", "reason": "NoProgress", "lastTransitionTime": "t"}],
            "progress": {"groupsTrained": 5, "dropped": {"no_signal": 3}}}
    status = parse_status(wire)
    assert status.phase == "Running" and status.conditions[0].reason == "NoProgress"
    assert status.to_wire()["progress"]["dropped"] == {"no_signal": 3}
    assert parse_status(None) == GRPORunStatus()


def test_spec_operator_modules_import_no_ml_stack():
    code = (
        "import sys, grpo_operator.api, grpo_operator.manifest, grpo_operator.resolve, grpo_operator.cli.validate\n"
        "heavy = sorted({'torch', 'transformers', 'trl', 'vllm', 'accelerate', 'datasets'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("training, message", [
    ({"environmentFactory": "mod:make"}, "environment 'openguess' has protocol openenv, which "
                                         "training.environmentFactory (every row's environment) leaves no row to"),
    ({"environmentFactories": {"openguess": "mod:make"}}, "environment 'openguess' has protocol openenv and is also "
                                                          "a key of training.environmentFactories"),
])
def test_an_openenv_environment_no_row_can_reach_is_refused_naming_its_protocol(training, message):
    spec = {"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "constant"}], "training": training,
            "environments": [{"name": "guess", "image": "i"},
                             {"name": "openguess", "image": "i", "protocol": "openenv"}]}
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert str(refused.value).startswith(f"spec.environments[1].protocol: {message}")
    spec["training"] = {"environmentFactories": {"guess": "mod:make"}}  # the rows name either
    assert parse_spec(spec).openenv_environments() == ["openguess"]

