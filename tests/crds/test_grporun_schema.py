"""The GRPORun CRD is one the API server accepts: a valid apiextensions/v1 object, structural, self-describing, with
printer columns that point at real fields and a status schema that keeps everything the operator writes."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest

from grpo_operator.api import MAX_ROLLOUT_REPLICAS
from grpo_operator.eta import ProgressRate, RateSample, TrainerMetric, TrainerStatus
from grpo_operator.manifest import CRD_PATH, load_crd
from grpo_operator.run_status import (
    CheckpointStatus,
    Condition,
    ConditionType,
    EnvironmentStatus,
    EpisodeStatus,
    FailureStatus,
    GRPORunStatus,
    LearnerStatus,
    OutputStatus,
    Phase,
    PinnedRevision,
    ProgressClock,
    ProgressStatus,
    RemovedServerStatus,
    RolloutServerStatus,
    RolloutStatus,
    TrackedRunStatus,
)
from grpo_trainer.contract.codes import DROP_REASONS, ReplicaState
from grpo_trainer.contract.report import EpisodeReport
from grpo_trainer.contract.wire import MAX_REPORTED_REASONS
from tests.support.specs import status_errors

CRD = load_crd()


def schema_nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, child in schema.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from schema_nodes(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        yield from schema_nodes(schema["items"], f"{path}[]")


def test_crd_is_a_valid_apiextensions_v1_object():
    version = kubernetes_validate.utils.latest_version()
    kubernetes_validate.validate(CRD.document, version, strict=True)  # raises ValidationError naming the field


def test_crd_validator_rejects_a_broken_crd():
    """The check above can fail: a misspelt schema keyword is caught by the bundled apiextensions schema."""
    broken = copy.deepcopy(CRD.document)
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["descriptoin"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError, match="descriptoin"):
        kubernetes_validate.validate(broken, kubernetes_validate.utils.latest_version(), strict=True)


def test_crd_names_and_version():
    spec = CRD.document["spec"]
    assert CRD.document["metadata"]["name"] == "grporuns.grpo.dev"
    assert (spec["group"], spec["scope"]) == ("grpo.dev", "Namespaced")
    assert spec["names"]["kind"] == "GRPORun" and spec["names"]["plural"] == "grporuns"
    assert spec["names"]["singular"] == "grporun" and "grpo" in spec["names"]["shortNames"]
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.rollout.replicas", "statusReplicasPath": ".status.rollout.replicas",
        "labelSelectorPath": ".status.rollout.selector"}}
    assert CRD.api_version == "grpo.dev/v1alpha1" and CRD.kind == "GRPORun"


def test_crd_file_stays_small_enough_for_client_side_apply():
    # kubectl's client-side apply keeps the whole object in a 256 KiB annotation.
    assert CRD_PATH.stat().st_size < 256 * 1024
    assert len(json.dumps(CRD.document)) < 256 * 1024


@pytest.mark.parametrize("path, node", list(schema_nodes(CRD.schema)), ids=lambda value: str(value)[:60])
def test_crd_schema_is_structural(path, node):
    if node.get("x-kubernetes-int-or-string"):
        assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
    elif node == {"x-kubernetes-preserve-unknown-fields": True}:
        pass  # any JSON value (extraArgs' values): the one other node a structural schema may leave untyped
    else:
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert "anyOf" not in node and "oneOf" not in node and "allOf" not in node, path
    assert not ("properties" in node and "additionalProperties" in node), path
    if node.get("type") == "array":
        assert isinstance(node.get("items"), dict), f"{path}: an array needs an items schema"
    if node.get("x-kubernetes-list-type") == "map":
        assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"].get("required", [])), path
    if path == ".metadata":
        assert node == {"type": "object"}, "metadata may only be typed at the root"


def test_crd_every_field_is_described_for_kubectl_explain():
    undescribed = [path for path, node in schema_nodes(CRD.schema)
                   if path and path != ".metadata" and not path.endswith(("[]", ".*")) and not node.get("description")]
    assert undescribed == []


def test_crd_defaults_validate_against_their_own_schema():
    defaults = [(path, node) for path, node in schema_nodes(CRD.schema) if "default" in node]
    assert len(defaults) > 30
    for _path, node in defaults:
        jsonschema.Draft4Validator(node).validate(node["default"])


def test_crd_cel_rules_compile_and_carry_a_message():
    rules = [rule for _, node in schema_nodes(CRD.schema) for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 6
    environment = celpy.Environment()
    for rule in rules:
        environment.compile(rule["rule"])
        assert rule["message"] and "\n" not in rule["message"]


def _schema_at(json_path: str) -> dict[str, Any] | None:
    """The schema node a printer column's JSONPath reads; filters like [?(@.type=="Stalled")] select array items."""
    node = CRD.schema
    for step in re.findall(r"\.([A-Za-z_]+)(\[[^\]]*\])?", json_path):
        key, selector = step
        if node.get("type") == "array":
            node = node["items"]
        if "properties" not in node or key not in node["properties"]:
            return None
        node = node["properties"][key]
        if selector:
            assert node["type"] == "array", json_path
            node = node["items"]
    return node


_COLUMN_TYPES = {"string": {"string"}, "integer": {"integer"}, "number": {"number", "integer"}}


def test_crd_printer_columns_point_at_declared_fields():
    columns = CRD.document["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [column["name"] for column in columns] == [
        "Phase", "Progress", "Epoch", "Trained", "Dropped", "ETA", "Servers", "Stalled", "Output", "Age"]
    # `kubectl get -o wide` alone shows where the model went: a URI is too long for the default view.
    assert {column["name"] for column in columns if column.get("priority", 0) > 0} == {"Output"}
    for column in columns:
        if column["jsonPath"] == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        node = _schema_at(column["jsonPath"])
        assert node is not None, f"{column['name']}: {column['jsonPath']} is not declared"
        assert node["type"] in _COLUMN_TYPES[column["type"]], column["name"]


def test_crd_printer_column_path_check_can_fail():
    assert _schema_at(".status.progress.percentage") is None
    assert _schema_at(".status.conditions[?(@.type==\"Stalled\")].statuz") is None


def _full_status() -> GRPORunStatus:
    """A status with every field the operator can write set, so that any undeclared one shows up."""
    return GRPORunStatus(
        phase=Phase.RUNNING,
        observed_generation=3,
        start_time="2026-01-01T00:00:00Z",
        completion_time="2026-01-01T01:00:00Z",
        last_progress_time="2026-01-01T00:30:00Z",
        progress_clock=ProgressClock(anchor_time="2026-01-01T00:30:00Z", paused_seconds=12.5,
                                     paused_since="2026-01-01T00:40:00Z"),
        restarts=1,
        conditions=[Condition(type=kind.value, status="False", reason="Why", message="m",
                              last_transition_time="2026-01-01T00:00:00Z", observed_generation=3)
                    for kind in ConditionType],
        progress=ProgressStatus(epoch=1, epochs=2.0, groups_consumed=10, groups_total=20, groups_trained=7,
                                groups_dropped=3, dropped=dict.fromkeys(DROP_REASONS, 1), stall_streak=2,
                                stall_limit=20, stalled=True, stall_cause="nothing_trained", global_step=5,
                                percent=50.0, reward_mean=0.25, masked_fraction=0.125,
                                episodes=EpisodeStatus(episodes=16, rows=18, turns=30, tool_calls=14, tool_failures=2,
                                                       forked=2, environment_failures={"arithmetic": 3}),
                                progress_percentage=50, estimated_remaining_seconds=600,
                                last_updated_time="2026-01-01T00:30:00Z"),
        progress_rate=ProgressRate(samples=[RateSample(time="2026-01-01T00:30:00Z", groups_consumed=10,
                                                       groups_trained=7)]),
        trainer_status=TrainerStatus(progress_percentage=50, estimated_remaining_seconds=600,
                                     metrics=[TrainerMetric(name="groupsTrained", value="7")],
                                     last_updated_time="2026-01-01T00:30:00Z"),
        rollout=RolloutStatus(replicas=2, ready=1, selector="grpo.dev/run=run,grpo.dev/role=rollout",
                              scale_refused="spec.rollout.replicas: 3 is not applied",
                              servers=[RolloutServerStatus(replica=1, pod="run-rollout-1", ready=True, serving=False,
                                                           weight_version="v2", samples=3, restarts=1,
                                                           last_error="e", state=ReplicaState.DRAINING,
                                                           drain_start_time="2026-01-01T00:40:00Z")],
                              removed_servers=[RemovedServerStatus(replica=2, restarts=1, last_error="e")]),
        learner=LearnerStatus(nodes=1, ready=1, restarts=0),
        environments=[EnvironmentStatus(name="guess", wanted=2, replicas=2, ready=1, restarts=3,
                                        scale_refused="spec.environments[0].replicas: 3 is not applied")],
        failure=FailureStatus(role="learner", pod="run-learner-0", exit_code=42, reason="Stalled", message="m"),
        output=OutputStatus(uri="pvc://models/run", step=5, bytes=1024, sha256="ab" * 32, time="2026-01-01T01:00:00Z"),
        checkpoint=CheckpointStatus(step=4, uri="s3://ckpt/run/checkpoint-4", time="2026-01-01T00:50:00Z"),
        tracking=[TrackedRunStatus(tracker="mlflow", run_id="0f1e", uri="http://mlflow:5000/#/experiments/1/runs/0f1e")],
        model=PinnedRevision(name="Qwen/Qwen3-0.6B", requested="main", revision="c0" * 20),
        dataset=PinnedRevision(name="openai/gsm8k", requested="v1", revision="d1" * 20),
        message="running",
    )


def test_crd_declares_every_status_field_the_operator_writes():
    status = _full_status().to_wire()
    unset = [name for name, value in status.items() if value in (None, [], {})]
    assert unset == [], "the sample must set every field"
    assert status_errors(status) == []


def test_crd_status_check_reports_pruned_and_mistyped_fields():
    status = _full_status().to_wire()
    status["progress"]["groupsSkipped"] = 1
    status["phase"] = "Done"
    status["conditions"][0]["status"] = "maybe"
    assert status_errors(status) == [
        "status.progress.groupsSkipped: unknown field (did you mean groupsDropped?)",
        "status.conditions[0].status: must be one of True, False, Unknown, not 'maybe'",
        "status.phase: must be one of Pending, Starting, Running, Suspended, Succeeded, Failed, not 'Done'",
    ]


def test_crd_status_enums_match_the_status_models():
    status = CRD.schema["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [phase.value for phase in Phase]
    assert list(status["progress"]["properties"]["dropped"]["properties"]) == list(DROP_REASONS)
    assert all(kind.value in status["conditions"]["description"] for kind in ConditionType)


def test_crd_server_states_are_the_contracts():
    servers = CRD.schema["properties"]["status"]["properties"]["rollout"]["properties"]["servers"]
    assert servers["items"]["properties"]["state"]["enum"] == [state.value for state in ReplicaState]


def test_crd_rollout_replicas_bound_is_the_operators():
    replicas = CRD.schema["properties"]["spec"]["properties"]["rollout"]["properties"]["replicas"]
    servers = CRD.schema["properties"]["status"]["properties"]["rollout"]["properties"]["servers"]
    assert replicas["maximum"] == servers["maxItems"] == MAX_ROLLOUT_REPLICAS


def test_crd_episode_counts_are_the_learners():
    """status.progress.episodes holds every count a learner's report can carry, and every environment it can name."""
    episodes = CRD.schema["properties"]["status"]["properties"]["progress"]["properties"]["episodes"]
    assert list(episodes["properties"]) == [field.alias for field in EpisodeReport.model_fields.values()]
    assert episodes["properties"]["environmentFailures"]["maxProperties"] == MAX_REPORTED_REASONS


def test_the_async_grpo_config_arguments_extra_args_names_are_ones_trl_takes():
    """training.extraArgs' description names arguments as examples and as the ones the spec sets: each is a field of
    TRL's AsyncGRPOConfig (the learner exits 78 on any other, so a user copying one would fail the run)."""
    async_grpo = pytest.importorskip("trl.experimental.async_grpo", reason="TRL is installed with the learner")
    description = CRD.schema["properties"]["spec"]["properties"]["training"]["properties"]["extraArgs"]["description"]
    named = {name for group in re.findall(r"\(([^)]*)\)", description) for name in re.split(r",\s*", group)
             if re.fullmatch(r"[a-z]+(_[a-z]+)*", name)}
    assert len(named) > 10, description
    fields = {field.name for field in dataclasses.fields(async_grpo.AsyncGRPOConfig)}
    assert sorted(named - fields) == []
