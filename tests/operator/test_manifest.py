"""Manifests are checked the way the API server would check them — structural schema, defaults, every CEL rule —
and every problem comes back as one line that names the field. `grporun validate` is tested in
tests/operator/cli/test_validate.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from grpo_operator.api import SpecError, parse_spec
from grpo_operator.manifest import (
    ManifestError,
    ManifestInvalid,
    cel_field_name,
    cel_results,
    evaluate_rule,
    is_transition_rule,
    load_crd,
    load_manifest,
    old_value,
    read_grporun,
    rule_sites,
    validate_manifest,
    with_defaults,
)
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES
from tests.support.paths import REPO

GOOD_FIXTURES = sorted(FIXTURES.glob("*.yaml"))
SCHEMA = load_crd().schema


def _rules(schema: dict[str, Any]) -> set[str]:
    rules = {rule["rule"] for rule in schema.get("x-kubernetes-validations", [])}
    items = [schema["items"]] if isinstance(schema.get("items"), dict) else []
    for child in [*schema.get("properties", {}).values(), *items]:
        rules |= _rules(child)
    return rules


ALL_RULES = _rules(SCHEMA)


def minimal() -> dict[str, Any]:
    return load_manifest(FIXTURES / "minimal.yaml")


def good() -> dict[str, Any]:
    return load_manifest(FIXTURES / "full-gpu.yaml")


def _agentic() -> dict[str, Any]:
    return load_manifest(FIXTURES / "agentic.yaml")


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "cannot read {path}: No such file or directory"),
        ("spec: [1, 2\n", "{path} is not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"),
        ("", "{path} holds 0 YAML documents; expected exactly one GRPORun"),
        ("a: 1\n---\nb: 2\n", "{path} holds 2 YAML documents; expected exactly one GRPORun"),
        ("- a\n- b\n", "{path} must hold a mapping (a GRPORun), not a list"),
        ("apiVersion: v1\nkind: GRPORun\nmetadata: {name: x}\n",
         "{path}: apiVersion: must be grpo.dev/v1alpha1, not 'v1'"),
        ("apiVersion: grpo.dev/v1alpha1\nkind: GrpoRun\nmetadata: {name: x}\n",
         "{path}: kind: must be GRPORun, not 'GrpoRun'"),
        ("apiVersion: grpo.dev/v1alpha1\nkind: GRPORun\nmetadata: {namespace: x}\n",
         "{path}: metadata.name: required field is missing"),
        ("apiVersion: grpo.dev/v1alpha1\nkind: GRPORun\nmetadata: {name: 7}\n",
         "{path}: metadata.name: must be a non-empty string, not 7"),
    ],
    ids=["missing-file", "not-yaml", "empty", "two-documents", "not-a-mapping", "api-version", "kind", "no-name",
         "name-type"],
)
def test_manifest_load_errors_are_one_line_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "run.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ManifestError) as raised:
        load_manifest(path)
    assert str(raised.value) == expected.format(path=path)


def test_manifest_load_error_for_a_directory(tmp_path):
    with pytest.raises(ManifestError, match=r"^cannot read .*: Is a directory$"):
        load_manifest(tmp_path)


def test_manifest_reads_exponent_floats_like_kubectl(tmp_path):
    path = tmp_path / "run.yaml"
    text = (FIXTURES / "minimal.yaml").read_text() + "  training: {learningRate: 1e-6, temperature: 2E+0}\n"
    path.write_text(text)
    training = load_manifest(path)["spec"]["training"]
    assert training == {"learningRate": 1e-6, "temperature": 2.0}
    assert validate_manifest(load_manifest(path)) == []


# --------------------------------------------------------------------------------------------------------------------
# Good manifests
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", GOOD_FIXTURES, ids=lambda path: path.name)
def test_manifest_good_fixtures_pass(path):
    assert validate_manifest(load_manifest(path)) == []


def test_manifest_shipped_examples_pass():
    examples = [path for path in sorted((REPO / "examples").glob("*.yaml"))
                if any(isinstance(doc, dict) and doc.get("kind") == "GRPORun"
                       for doc in yaml.safe_load_all(path.read_text()))]
    if not examples:
        pytest.skip("no GRPORun under examples/ yet (another helper writes examples/tiny.yaml); fixtures cover this")
    for path in examples:
        assert validate_manifest(load_manifest(path)) == [], path.name


def test_manifest_good_fixtures_exercise_every_rule_without_firing():
    """Each CEL rule has a case where it holds: evaluated on a good manifest (as an update to itself, so that the
    transition rules run too) and passed."""
    evaluated = set()
    for path in GOOD_FIXTURES:
        defaulted = with_defaults(load_manifest(path))
        for result in cel_results(defaulted, SCHEMA, defaulted):
            assert result.passed, result.line
            evaluated.add(result.rule)
    assert evaluated == ALL_RULES


def test_manifest_defaults_fill_a_minimal_manifest_without_touching_the_input():
    manifest = load_manifest(FIXTURES / "minimal.yaml")
    before = copy.deepcopy(manifest)
    spec = with_defaults(manifest)["spec"]
    assert manifest == before
    assert spec["training"]["numGenerations"] == 8 and spec["rollout"]["vllm"]["maxModelLen"] == 4096
    assert spec["rollout"]["weightSync"] == {"mode": "nccl", "deadlineSeconds": 900}
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert spec["rewards"] == [{"name": "accuracy", "weight": 1.0}]
    assert "activeDeadlineSeconds" not in spec["runPolicy"]


def test_manifest_nulls_are_pruned_except_inside_free_form_fields():
    manifest = good()
    manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] = None
    manifest["spec"]["training"]["epochs"] = None
    manifest["spec"]["training"]["extraArgs"] = {"max_grad_norm": None}
    assert validate_manifest(manifest) == []
    spec = with_defaults(manifest)["spec"]
    assert "activeDeadlineSeconds" not in spec["runPolicy"] and spec["training"]["epochs"] == 1
    assert spec["training"]["extraArgs"] == {"max_grad_norm": None}


# --------------------------------------------------------------------------------------------------------------------
# Bad manifests: structural schema
# --------------------------------------------------------------------------------------------------------------------
def _set(path: str, value: Any, base: Callable[[], dict] = good) -> Callable[[], dict]:
    def make() -> dict:
        manifest = base()
        *parents, last = path.split(".")
        node = manifest
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
        return manifest

    return make


_DELETE = object()

STRUCTURAL_CASES = {
    "typo-top": (_set("spec.trainning", {"epochs": 2}), "spec.trainning: unknown field (did you mean training?)"),
    "typo-nested": (_set("spec.rollout.vllm.maxModelLength", 8192),
                    "spec.rollout.vllm.maxModelLength: unknown field (did you mean maxModelLen?)"),
    "typo-root": (_set("specs", {}), "specs: unknown field (did you mean spec?)"),
    "no-guess": (_set("spec.learner.zzz", 1), "spec.learner.zzz: unknown field (known: nodes, processesPerNode, "
                 "image, imagePullPolicy, resources, device, strategy, fsdp, attention, topology, nodeSelector, "
                 "tolerations, podTemplateOverride)"),
    "environment-port": (_set("spec.environments", [{"name": "guess", "image": "x", "port": 0}], base=_agentic),
                         "spec.environments[0].port: must be >= 1, not 0"),
    "environment-replicas": (_set("spec.environments", [{"name": "guess", "image": "x", "replicas": -1}],
                                  base=_agentic), "spec.environments[0].replicas: must be >= 0, not -1"),
    "environment-image": (_set("spec.environments", [{"name": "guess"}], base=_agentic),
                          "spec.environments[0].image: required field is missing"),
    "missing-model": (_set("spec.model", _DELETE), "spec.model: required field is missing"),
    "missing-spec": (_set("spec", _DELETE), "spec: required field is missing"),
    "empty-model": (_set("spec.model", ""), "spec.model: must not be empty"),
    "output-bad-endpoint": (_set("spec.output", {"uri": "s3://models/run", "endpoint": "minio:9000"}),
                            "spec.output.endpoint: must match ^https?://[^/?#]+, not 'minio:9000'"),
    "output-empty-volume": (_set("spec.output", {"volume": {}}), "spec.output.volume: {} should be non-empty"),
    "wrong-type": (_set("spec.training.epochs", "two"), "spec.training.epochs: must be a number, not 'two'"),
    "wrong-type-object": (_set("spec.rollout", "big"), "spec.rollout: must be a mapping, not 'big'"),
    "integer-not-float": (_set("spec.rollout.replicas", 1.5), "spec.rollout.replicas: must be an integer, not 1.5"),
    "no-rewards": (_set("spec.rewards", []), "spec.rewards: must list at least 1 item"),
    "enum": (_set("spec.rollout.device", "gpu"), "spec.rollout.device: must be one of cuda, cpu, not 'gpu'"),
    "enum-policy": (_set("spec.progress.stallPolicy", "Ignore"),
                    "spec.progress.stallPolicy: must be one of Fail, Report, not 'Ignore'"),
    "minimum": (_set("spec.training.numGenerations", 1), "spec.training.numGenerations: must be >= 2, not 1"),
    "exclusive-minimum": (_set("spec.training.epochs", 0), "spec.training.epochs: must be > 0, not 0"),
    "negative": (_set("spec.runPolicy.backoffLimit", -1), "spec.runPolicy.backoffLimit: must be >= 0, not -1"),
    "maximum": (_set("spec.rollout.vllm.gpuMemoryUtilization", 1.5),
                "spec.rollout.vllm.gpuMemoryUtilization: must be <= 1, not 1.5"),
    "quantity": (_set("spec.learner.resources.limits.memory", "lots"),
                 "spec.learner.resources.limits.memory: must be a quantity like 4, 500m or 16Gi, not 'lots'"),
    "node-selector": (_set("spec.rollout.nodeSelector", {"zone": 1}), "spec.rollout.nodeSelector.zone: must be a "
                      "string, not 1"),
    "vllm-args": (_set("spec.rollout.vllm.extraArgs", ["--enforce-eager", 3]),
                  "spec.rollout.vllm.extraArgs[1]: must be a string, not 3"),
    "max-length": (_set("spec.dataset.config", "c" * 300),
                   "spec.dataset.config: must be at most 256 characters long, not 300"),
    "max-properties": (_set("spec.training.extraArgs", {f"arg{i}": i for i in range(65)}),
                       "spec.training.extraArgs: must set at most 64 entries, not 65"),
    "managed-by-not-domain-prefixed": (_set("spec.managedBy", "multikueue"), "spec.managedBy: must match "
                                       "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
                                       "[-A-Za-z0-9/._~%!$&()*+,;=:]+$, not 'multikueue'"),
    "managed-by-too-long": (_set("spec.managedBy", "a" * 60 + ".io/x"),
                            "spec.managedBy: must be at most 63 characters long, not 65"),
    "lora-rank": (_set("spec.training.lora.r", 0), "spec.training.lora.r: must be >= 1, not 0"),
    "lora-alpha": (_set("spec.training.lora.alpha", 0), "spec.training.lora.alpha: must be > 0, not 0"),
    "lora-rank-unserved": (_set("spec.training.lora.r", 513), "spec.training.lora.r: must be <= 512, not 513"),
    "lora-sync": (_set("spec.training.lora.sync", "full"),
                  "spec.training.lora.sync: must be one of adapter, merged, not 'full'"),
    "lora-dropout": (_set("spec.training.lora.dropout", 1), "spec.training.lora.dropout: must be < 1, not 1"),
    "lora-no-targets": (_set("spec.training.lora.targetModules", []),
                        "spec.training.lora.targetModules: must list at least 1 item"),
    "lora-empty-target": (_set("spec.training.lora.targetModules", ["q_proj", ""]),
                          "spec.training.lora.targetModules[1]: must not be empty"),
    "lora-unknown": (_set("spec.training.lora.rank", 4),
                     "spec.training.lora.rank: unknown field (known: r, alpha, dropout, targetModules, sync)"),
    "toleration": (_set("spec.learner.tolerations", [{"key": "gpu", "operater": "Exists"}]),
                   "spec.learner.tolerations[0].operater: unknown field (did you mean operator?)"),
}


@pytest.mark.parametrize("make, expected", STRUCTURAL_CASES.values(), ids=STRUCTURAL_CASES.keys())
def test_manifest_structural_schema_rejects(make, expected):
    assert validate_manifest(make()) == [expected]


# --------------------------------------------------------------------------------------------------------------------
# Bad manifests: CEL rules (each fires here and holds in test_manifest_good_fixtures_exercise_every_rule...)
# --------------------------------------------------------------------------------------------------------------------
def _update(change: Callable[[dict], Any], base: Callable[[], dict] = good) -> Callable[[], dict]:
    def make() -> dict:
        manifest = base()
        change(manifest)
        return manifest

    return make


def _nccl() -> dict:
    """The good manifest with NCCL weight sync, which allows one learner process only."""
    manifest = good()
    manifest["spec"]["rollout"]["weightSync"] = {"mode": "nccl"}
    manifest["spec"]["learner"].update(nodes=1, processesPerNode=1)
    return manifest


ONE_MATCH = "a rule sets exactly one of onExitCodes or onPodConditions"


_LEARNER_OVERRIDE = "spec.learner.podTemplateOverride"
_ROLLOUT_OVERRIDE = "spec.rollout.podTemplateOverride"


def _learner_override(manifest: dict) -> dict:
    return manifest["spec"]["learner"]["podTemplateOverride"]


def _learner_container(manifest: dict) -> dict:
    return _learner_override(manifest)["spec"]["containers"][0]


CEL_CASES = {
    # Every bad URI of each field that takes one: tests/crds/test_store_uri_rule.py.
    "output-bad-uri": (_set("spec.output", {"uri": "s3://Models/run"}), "spec.output.uri: must be s3://BUCKET"),
    "model-bad-uri": (_set("spec.model", "s3://models/a/../b"), "spec.model: an object store model must be"),
    "dataset-bad-uri": (_set("spec.dataset", {"path": "s3://data/x?v=1"}),
                        "spec.dataset.path: an object store path must be"),
    "output-nowhere": (_set("spec.output", {}), "spec.output: set volume, uri or both: where the trained model goes"),
    "output-store-settings-without-uri": (
        _set("spec.output", {"volume": {"emptyDir": {}}, "credentialsSecret": "s3"}),
        "spec.output: credentialsSecret, endpoint and region are only for an object store: set uri too"),
    "checkpoint-bad-uri": (_set("spec.checkpoint", {"uri": "s3://Ckpts/run"}),
                           "spec.checkpoint.uri: must be s3://BUCKET"),
    "checkpoint-store-settings-without-uri": (
        _set("spec.checkpoint", {"endpoint": "http://minio:9000"}),
        "spec.checkpoint: credentialsSecret, endpoint and region are only for an object store: set uri too"),
    "checkpoint-store-reached-unlike-output": (
        _update(lambda m: m["spec"].update(checkpoint={"uri": "s3://ckpts/run", "credentialsSecret": "a"},
                                           output={"uri": "s3://models/run", "credentialsSecret": "b"})),
        "spec.checkpoint.uri: with output.uri: checkpoint's and output's credentialsSecret, endpoint and region must "
        "be the same"),
    "wandb-online-without-key": (_set("spec.tracking", {"wandb": {"project": "p"}}),
                                 "spec.tracking.wandb.apiKeySecret: online mode needs apiKeySecret (or mode offline)"),
    "topology-both": (_set("spec.learner.topology", {"required": "r", "preferred": "b"}),
                      "spec.learner.topology: set exactly one of required or preferred"),
    "topology-none": (_set("spec.rollout.topology", {}), "spec.rollout.topology: set exactly one of required or "
                      "preferred"),
    "failure-rule-both": (_set("spec.runPolicy.podFailurePolicy", [
        {"action": "Fail", "onExitCodes": {"operator": "In", "values": [3]},
         "onPodConditions": [{"type": "DisruptionTarget"}]}]), f"spec.runPolicy.podFailurePolicy[0]: {ONE_MATCH}"),
    "failure-rule-none": (_set("spec.runPolicy.podFailurePolicy", [{"action": "Restart"}]),
                          f"spec.runPolicy.podFailurePolicy[0]: {ONE_MATCH}"),
    "name-dots": (_set("metadata.name", "qwen3.gsm8k"), "metadata.name: must be a DNS-1035 label"),
    "name-long": (_set("metadata.name", "a" * 49), "metadata.name: must be a DNS-1035 label"),
    "name-digit": (_set("metadata.name", "1run"), "metadata.name: must be a DNS-1035 label"),
    "context": (_set("spec.rollout.vllm.maxModelLen", 1024),
                "spec.rollout.vllm.maxModelLen: must be greater than training.maxCompletionLength"),
    "context-default": (_set("spec.training.maxCompletionLength", 4096, base=minimal),
                        "spec.rollout.vllm.maxModelLen: must be greater than training.maxCompletionLength"),
    "token-budget": (_set("spec.training.tokenBudget", 512),
                     "spec.training.tokenBudget: must be greater than training.maxCompletionLength"),
    "learner-cpu-nccl": (_set("spec.learner.device", "cpu", base=_nccl),
                         "spec.rollout.weightSync.mode: must be filesystem when learner.device is cpu"),
    "rollout-cpu-nccl": (_set("spec.rollout.device", "cpu", base=_nccl),
                         "spec.rollout.weightSync.mode: must be filesystem when rollout.device is cpu"),
    "nccl-replicas": (_set("spec.rollout.replicas", 2, base=_nccl),
                      "spec.rollout.replicas: must be 1 with weightSync.mode nccl"),
    "clip-bounds-order": (_update(lambda m: m["spec"]["training"].update(vllmImportanceSamplingClipMin=3.0,
                                                                         vllmImportanceSamplingClipMax=2.0)),
                          "spec.training.vllmImportanceSamplingClipMin: must be below vllmImportanceSamplingClipMax"),
    "strategy-unknown": (_set("spec.learner.strategy", "zero3"), "spec.learner.strategy"),
    "fsdp-unknown-field": (_set("spec.learner.fsdp", {"offload": True}), "spec.learner.fsdp"),
    "nccl-learner-ranks": (_set("spec.learner.processesPerNode", 2, base=_nccl),
                           "spec.rollout.weightSync.mode: must be filesystem when the learner has more than one "
                           "process"),
    **{f"lora-head-{target}": (_set("spec.training.lora.targetModules", ["q_proj", target]),
                               "spec.training.lora.targetModules: must not name lm_head or embed_tokens")
       for target in ("lm_head", "model.lm_head", "embed_tokens", "model.embed_tokens")},
    "dataset-both": (_set("spec.dataset.path", "/data/x.jsonl"),
                     "spec.dataset: set exactly one of dataset.name (a hub dataset) or dataset.path"),
    "dataset-neither": (_set("spec.dataset", {"split": "train"}),
                        "spec.dataset: set exactly one of dataset.name (a hub dataset) or dataset.path"),
    "reward-both": (_update(lambda m: m["spec"]["rewards"][0].update(function="a:b")),
                    "spec.rewards[0]: a reward sets exactly one of name (built-in), function"),
    "reward-neither": (_update(lambda m: m["spec"]["rewards"].append({"weight": 2.0})),
                       "spec.rewards[2]: a reward sets exactly one of name (built-in), function"),
    "reward-name-and-model": (_update(lambda m: m["spec"]["rewards"][0].update(model="org/rm")),
                              "spec.rewards[0]: a reward sets exactly one of name (built-in), function"),
    "reward-model-options-on-a-function": (_update(lambda m: m["spec"]["rewards"][1].update(dtype="bfloat16")),
                                           "spec.rewards[1]: dtype, batchSize and maxLength apply to a reward model"),
    "reward-model-dtype": (_update(lambda m: m["spec"]["rewards"].append({"model": "org/rm", "dtype": "fp16"})),
                           "spec.rewards[2].dtype"),
    "reward-duplicate-model": (_update(lambda m: m["spec"]["rewards"].extend([{"model": "org/rm"}] * 2)),
                               "spec.rewards: each reward may appear only once"),
    "reward-function": (_update(lambda m: m["spec"]["rewards"][1].update(function="mypkg/rewards.py")),
                        "spec.rewards[1].function: must be an import path like 'mypkg.rewards:format_reward'"),
    "tool-not-import-path": (_update(lambda m: m["spec"]["training"].update(tools=["mytools/search.py"])),
                             "spec.training.tools[0]: must be an import path like 'mypkg.tools:search'"),
    "environment-factory-not-import-path": (
        _update(lambda m: m["spec"]["training"].update(environmentFactory="envs.make")),
        "spec.training.environmentFactory: must be an import path like 'mypkg.envs:make_environment'"),
    "reward-function-two-colons": (_update(lambda m: m["spec"]["rewards"][1].update(function="a:b:c")),
                                   "spec.rewards[1].function: must be an import path"),
    "reward-duplicate-name": (_update(lambda m: m["spec"]["rewards"].append({"name": "accuracy"})),
                              "spec.rewards: each reward may appear only once"),
    "reward-duplicate-function": (_update(lambda m: m["spec"]["rewards"].append(dict(m["spec"]["rewards"][1]))),
                                  "spec.rewards: each reward may appear only once"),
    "environment-duplicate": (_update(lambda m: m["spec"]["environments"].append(
        {**m["spec"]["environments"][0], "image": "other"}), base=_agentic),
        "spec.environments: environment names must be unique"),
    "environment-openenv-beside-one-factory": (
        _update(lambda m: m["spec"]["environments"][0].update(protocol="openenv"), base=_agentic),
        "spec.environments: an environment with protocol openenv gets no row while training.environmentFactory plays "
        "every row"),
    "environment-name": (_set("spec.environments", [{"name": "Guess_1", "image": "x"}], base=_agentic),
                         "spec.environments[0].name: must be a DNS-1035 label"),
    "environment-service-name": (_update(lambda m: (m["metadata"].update(name="r" * 48), m["spec"]["environments"][0]
                                                    .update(name="guessing-server")), base=_agentic),
                                 "spec.environments: an environment's Service, <run>-env-<name>, must be at most 63"),
    "environment-container": (_update(lambda m: m["spec"]["environments"][0]["podTemplateOverride"]["spec"]
                                      ["containers"][0].update(name="rollout"), base=_agentic),
                              "spec.environments[0].podTemplateOverride.spec.containers: the environment pods have "
                              "one container, named environment"),
    **{f"override-{name}": case for name, case in {
        "label": (_set(f"{_LEARNER_OVERRIDE}.metadata.labels", {"grpo.dev/role": "rollout"}),
                  f"{_LEARNER_OVERRIDE}.metadata.labels: keys under grpo.dev/ and app.kubernetes.io/name"),
        "app-label": (_set(f"{_LEARNER_OVERRIDE}.metadata.labels", {"app.kubernetes.io/instance": "x"}),
                      f"{_LEARNER_OVERRIDE}.metadata.labels: keys under grpo.dev/"),
        "annotation": (_set(f"{_ROLLOUT_OVERRIDE}.metadata.annotations", {"grpo.dev/attempt": "9"}),
                       f"{_ROLLOUT_OVERRIDE}.metadata.annotations: keys under grpo.dev/ are set by the operator"),
        "name": (_set(f"{_LEARNER_OVERRIDE}.metadata.name", "mine"),
                 f"{_LEARNER_OVERRIDE}.metadata.name: is managed by the operator"),
        "namespace": (_set(f"{_LEARNER_OVERRIDE}.metadata.namespace", "other"),
                      f"{_LEARNER_OVERRIDE}.metadata.namespace: is managed by the operator"),
        "owner": (_set(f"{_LEARNER_OVERRIDE}.metadata.ownerReferences", [{"kind": "Job"}]),
                  f"{_LEARNER_OVERRIDE}.metadata.ownerReferences: is managed by the operator"),
        "restart-policy": (_set(f"{_LEARNER_OVERRIDE}.spec.restartPolicy", "OnFailure"),
                           f"{_LEARNER_OVERRIDE}.spec.restartPolicy: is managed by the operator"),
        "volume": (_update(lambda m: _learner_override(m)["spec"]["volumes"].append(
            {"name": "config", "emptyDir": {}})),
            f"{_LEARNER_OVERRIDE}.spec.volumes[1].name: config, shm, cache, model-cache, output, checkpoints, "
            "weights, model and inputs"),
        "env": (_update(lambda m: _learner_container(m)["env"].append({"name": "GRPO_CONFIG", "value": "/x"})),
                f"{_LEARNER_OVERRIDE}.spec.containers[0].env[2].name: is managed by the operator"),
        "env-home": (_update(lambda m: _learner_container(m)["env"].append({"name": "HF_HOME", "value": "/x"})),
                     f"{_LEARNER_OVERRIDE}.spec.containers[0].env[2].name: is managed by the operator"),
        "mount": (_update(lambda m: _learner_container(m)["volumeMounts"].append(
            {"name": "datasets", "mountPath": "/var/lib/grpo/checkpoints"})),
            f"{_LEARNER_OVERRIDE}.spec.containers[0].volumeMounts[1].mountPath: is managed by the operator"),
        "mount-config": (_update(lambda m: _learner_container(m)["volumeMounts"].append(
            {"name": "datasets", "mountPath": "/etc/grpo/"})),
            f"{_LEARNER_OVERRIDE}.spec.containers[0].volumeMounts[1].mountPath: is managed by the operator"),
        "command": (_update(lambda m: _learner_container(m).update(command=["bash"])),
                    f"{_LEARNER_OVERRIDE}.spec.containers[0].command: is managed by the operator"),
        "args": (_update(lambda m: _learner_container(m).update(args=["--x"])),
                 f"{_LEARNER_OVERRIDE}.spec.containers[0].args: is managed by the operator"),
        "ports": (_update(lambda m: _learner_container(m).update(ports=[{"containerPort": 80}])),
                  f"{_LEARNER_OVERRIDE}.spec.containers[0].ports: is managed by the operator"),
        "learner-container": (_update(lambda m: _learner_container(m).update(name="rollout")),
                              f"{_LEARNER_OVERRIDE}.spec.containers: the learner pods have one container, named "
                              "learner"),
        "rollout-container": (_update(lambda m: m["spec"]["rollout"]["podTemplateOverride"]["spec"]["containers"][0]
                                      .update(name="learner")),
                              f"{_ROLLOUT_OVERRIDE}.spec.containers: the rollout pods have one container, named "
                              "rollout"),
    }.items()},
}


@pytest.mark.parametrize("make, expected", CEL_CASES.values(), ids=CEL_CASES.keys())
def test_manifest_cel_rule_rejects(make, expected):
    errors = validate_manifest(make())
    assert len(errors) == 1 and errors[0].startswith(expected), errors


LORA_CASES = {name: case for name, case in {**STRUCTURAL_CASES, **CEL_CASES}.items() if name.startswith("lora-")}


@pytest.mark.parametrize("make, expected", LORA_CASES.values(), ids=LORA_CASES.keys())
def test_manifest_lora_mistakes_are_refused_by_the_spec_model_naming_the_same_field(make, expected):
    """The operator and the learner check a run with the pydantic models, not the CRD: they refuse what it refuses."""
    with pytest.raises(SpecError) as refused:
        parse_spec(with_defaults(make())["spec"])
    assert refused.value.field_path == expected.split(": ")[0]


IMMUTABLE = "is immutable: the learner's config is fixed when the run is created; create a new GRPORun to change it"
WHILE_SUSPENDED = ("rollout (but for rollout.replicas, which a running run takes live), learner, checkpoint and "
                   "scheduling can change only while the run is suspended (set runPolicy.suspend to true first; the "
                   "pods are then recreated with the change on resume)")
ENVIRONMENTS_WHILE_SUSPENDED = (
    "spec.environments: can change only while the run is suspended, but for each environment's replicas, which a "
    "running run takes live (set runPolicy.suspend to true first; the environment servers and the run config are "
    "recreated with the change on resume)")
UPDATE_CASES = {
    "model": (_set("spec.model", "Qwen/Qwen3-1.7B"), [f"spec.model: {IMMUTABLE}"]),
    "dataset": (_set("spec.dataset.limit", 10), [f"spec.dataset: {IMMUTABLE}"]),
    "rewards": (_update(lambda m: m["spec"]["rewards"][1].update(weight=0.5)), [f"spec.rewards: {IMMUTABLE}"]),
    "training": (_set("spec.training.extraArgs", {"beta": 0.1}), [f"spec.training: {IMMUTABLE}"]),
    "training-default": (_set("spec.training.seed", _DELETE), [f"spec.training: {IMMUTABLE}"]),
    "filter": (_set("spec.filter.dropTruncated", False), [f"spec.filter: {IMMUTABLE}"]),
    "output": (_set("spec.output", {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}),
               ["spec.output: can change only while the run is suspended (set runPolicy.suspend to true first; the "
                "learner is then recreated with it on resume)"]),
    # What Kueue and people change on a live run: suspend/resume and deadlines. Placement, images, sizes and the
    # checkpoint change only while suspended (test_manifest_pods_change_only_while_the_run_is_suspended).
    "suspend": (_set("spec.runPolicy.suspend", True), []),
    "placement": (_update(lambda m: m["spec"]["learner"].update(nodeSelector={"pool": "b"}, tolerations=[])),
                  [f"spec: {WHILE_SUSPENDED}"]),
    "image": (_set("spec.rollout.image", "ghcr.io/example/grpo-trainer:0.1.1"), [f"spec: {WHILE_SUSPENDED}"]),
    # A live PodGroup is never patched while its pods exist: a gang added, removed or changed live would half-apply.
    "scheduling": (_set("spec.scheduling", {"gang": {"scheduler": "coscheduling"}}), [f"spec: {WHILE_SUSPENDED}"]),
    # The rollout servers of a running run scale live (the scale subresource); the bounds and the NCCL rule stay.
    "replicas-live": (_set("spec.rollout.replicas", 3), []),
    "replicas-live-and-image": (_update(lambda m: m["spec"]["rollout"].update(replicas=2, image="x:1")),
                                [f"spec: {WHILE_SUSPENDED}"]),
    "deadlines": (_update(lambda m: m["spec"]["progress"].update(progressDeadlineSeconds=60) or
                          m["spec"]["runPolicy"].update(ttlSecondsAfterFinished=1)), []),
    "unchanged-but-defaulted": (_set("spec.training.maxStaleness", 4), []),
    "environments-added": (_set("spec.environments", [{"name": "guess", "image": "x"}]),
                           [ENVIRONMENTS_WHILE_SUSPENDED]),
    "managed-by": (_set("spec.managedBy", "kueue.x-k8s.io/multikueue"),
                   ["spec.managedBy: is immutable: the controller that reconciles a run is chosen when it is created"]),
}


def _suspended() -> dict[str, Any]:
    manifest = good()
    manifest["spec"]["runPolicy"]["suspend"] = True
    return manifest


POD_EDITS = {
    # Several servers need filesystem weight sync (NCCL serves one): the two change together.
    "scale-rollout": _update(lambda m: m["spec"]["rollout"].update(
        replicas=4, weightSync={"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}),
        base=_suspended),
    "learner-nodes": _set("spec.learner.nodes", 3, base=_suspended),
    "placement-and-resume": _update(lambda m: m["spec"]["learner"].update(nodeSelector={"pool": "b"}) or
                                    m["spec"]["runPolicy"].update(suspend=False), base=_suspended),
    "checkpoint": _set("spec.checkpoint.saveSteps", 10, base=_suspended),
    "scheduling": _set("spec.scheduling", {"gang": {"scheduler": "volcano", "queue": "rl"}}, base=_suspended),
}


@pytest.mark.parametrize("make", POD_EDITS.values(), ids=POD_EDITS.keys())
def test_manifest_pods_change_only_while_the_run_is_suspended(make):
    """A change to the pods' spec is applied whole, by recreating the pods on resume; on a live run it would be
    half-applied (surplus pods kept, a new rank at another world size), so the API server refuses it."""
    assert validate_manifest(make(), old=_suspended()) == []
    running = make()
    running["spec"]["runPolicy"]["suspend"] = False
    assert validate_manifest(running, old=good()) == [f"spec: {WHILE_SUSPENDED}"]


def _environment(change: Callable[[dict], Any]) -> Callable[[], dict]:
    """The agentic manifest with its (first) environment changed."""
    return _update(lambda m: change(m["spec"]["environments"][0]), base=_agentic)


def _two_environments() -> dict:
    manifest = _agentic()
    manifest["spec"]["environments"].append({"name": "maze", "image": "registry.example/maze-env:1"})
    return manifest


def _two_environments_by_row(protocol: str) -> Callable[[], dict]:
    """Two environments the rows choose by name, the second's protocol `protocol` (the first keeps the user's
    factory)."""
    def make() -> dict:
        manifest = _two_environments()
        training = manifest["spec"]["training"]
        training["environmentFactories"] = {"guess": training.pop("environmentFactory")}
        manifest["spec"]["environments"][1]["protocol"] = protocol
        return manifest
    return make


def _reordered() -> dict:
    manifest = _two_environments()
    manifest["spec"]["environments"].reverse()
    return manifest


#: Live changes of spec.environments, judged as an update of the agentic manifest (or of `_two_environments` for
#: the reorder): a server count changes live, as a Service's URL does not depend on it; anything else would leave
#: the run config's URLs or the servers' pods out of date.
ENVIRONMENT_UPDATE_CASES = {
    "scale-up": (_environment(lambda e: e.update(replicas=5)), None, []),
    "scale-down": (_environment(lambda e: e.update(replicas=1)), None, []),
    "scale-to-zero": (_environment(lambda e: e.update(replicas=0)), None, []),
    "replicas-defaulted": (_environment(lambda e: e.pop("replicas")), None, []),
    "replicas-and-image": (_environment(lambda e: e.update(replicas=3, image="registry.example/guess-env:2")), None,
                           [ENVIRONMENTS_WHILE_SUSPENDED]),
    "image": (_environment(lambda e: e.update(image="registry.example/guess-env:2")), None,
              [ENVIRONMENTS_WHILE_SUSPENDED]),
    "port": (_environment(lambda e: e.update(port=9000)), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "protocol": (_two_environments_by_row("openenv"), _two_environments_by_row("http"),
                 [ENVIRONMENTS_WHILE_SUSPENDED]),
    "command": (_environment(lambda e: e.update(command=["guess"])), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "command-removed": (_environment(lambda e: e.pop("command")), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "args": (_environment(lambda e: e.update(args=["--port", "9"])), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "env": (_environment(lambda e: e["env"].append({"name": "X", "value": "1"})), None,
            [ENVIRONMENTS_WHILE_SUSPENDED]),
    "resources": (_environment(lambda e: e.update(resources={"requests": {"cpu": "1"}})), None,
                  [ENVIRONMENTS_WHILE_SUSPENDED]),
    "resources-removed": (_environment(lambda e: e.pop("resources")), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "probe": (_environment(lambda e: e.update(readinessProbe={"tcpSocket": {"port": 8765}})), None,
              [ENVIRONMENTS_WHILE_SUSPENDED]),
    "pod-template-override": (
        _environment(lambda e: e.update(podTemplateOverride={"metadata": {"labels": {"a": "b"}}})), None,
        [ENVIRONMENTS_WHILE_SUSPENDED]),
    "renamed": (_environment(lambda e: e.update(name="maze")), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "added": (_two_environments, None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "removed": (_set("spec.environments", _DELETE, base=_agentic), None, [ENVIRONMENTS_WHILE_SUSPENDED]),
    "reordered": (_reordered, _two_environments, [ENVIRONMENTS_WHILE_SUSPENDED]),
}


def _running(make: Callable[[], dict], suspend: bool) -> dict:
    manifest = make()
    manifest["spec"]["runPolicy"] = {**manifest["spec"].get("runPolicy", {}), "suspend": suspend}
    return manifest


@pytest.mark.parametrize("make, base, expected", ENVIRONMENT_UPDATE_CASES.values(),
                         ids=ENVIRONMENT_UPDATE_CASES.keys())
def test_manifest_environments_change_only_while_the_run_is_suspended_but_for_their_replicas(make, base, expected):
    """A live run's config keeps the URLs it started with: an added environment's URL would never reach the learner,
    a removed one's pods would be left running, and a changed server spec would reach only the servers created
    after it. The number of servers behind a Service changes live."""
    old = base or _agentic
    assert validate_manifest(_running(make, False), old=_running(old, False)) == expected
    assert validate_manifest(_running(make, True), old=_running(old, True)) == []


_MODELS = {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}
_OTHER = {"volume": {"persistentVolumeClaim": {"claimName": "other"}}}


@pytest.mark.parametrize(("before", "after"), [(None, _MODELS), (_MODELS, _OTHER), (_MODELS, None)],
                         ids=["added", "changed", "removed"])
def test_manifest_output_changes_only_while_the_run_is_suspended(before, after):
    def manifest(output: dict | None, suspend: bool) -> dict:
        made = good()
        if output is not None:
            made["spec"]["output"] = output
        made["spec"]["runPolicy"]["suspend"] = suspend
        return made

    assert validate_manifest(manifest(after, suspend=False), old=manifest(before, suspend=False)) == [
        "spec.output: can change only while the run is suspended (set runPolicy.suspend to true first; the learner "
        "is then recreated with it on resume)"]
    assert validate_manifest(manifest(after, suspend=True), old=manifest(before, suspend=True)) == []
    assert validate_manifest(manifest(before, suspend=False), old=manifest(before, suspend=False)) == []


def test_manifest_live_replicas_keep_the_bounds_and_the_nccl_rule():
    """A live scale goes through the same rules: between 1 and 1024 servers, one with NCCL weight sync."""
    for replicas, error in ((0, "must be >= 1, not 0"), (1025, "must be <= 1024, not 1025")):
        scaled = good()
        scaled["spec"]["rollout"]["replicas"] = replicas
        assert validate_manifest(scaled, old=good()) == [f"spec.rollout.replicas: {error}"]
    running = _nccl()
    scaled = _nccl()
    scaled["spec"]["rollout"]["replicas"] = 2
    assert validate_manifest(scaled, old=running) == [
        "spec.rollout.replicas: must be 1 with weightSync.mode nccl (TRL 1.16's NCCL weight transfer opens one NCCL "
        "group with one server); use weightSync.mode filesystem for several replicas"]


@pytest.mark.parametrize("make, expected", UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_manifest_update_keeps_the_learner_config_immutable(make, expected):
    assert validate_manifest(make(), old=good()) == expected
    assert validate_manifest(make()) == [], "transition rules do not apply on create"


def test_manifest_every_cel_rule_has_a_case_where_it_fires():
    fired = set()
    for make, _ in CEL_CASES.values():
        fired |= {result.rule for result in cel_results(with_defaults(make()), SCHEMA) if not result.passed}
    for make, _ in UPDATE_CASES.values():
        results = cel_results(with_defaults(make()), SCHEMA, with_defaults(good()))
        fired |= {result.rule for result in results if not result.passed}
    assert fired == ALL_RULES


def _reference_value(value: Any, schema: dict[str, Any]) -> Any:
    """Plain Python typed by the schema for the reference runtime: `number` fields are floats, as in Kubernetes."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return {cel_field_name(key) if key in properties else key: _reference_value(child, properties.get(key, extra))
                for key, child in value.items()}
    if isinstance(value, list):
        return [_reference_value(child, schema.get("items", {})) for child in value]
    return value


def test_manifest_cel_python_agrees_with_the_reference_cel_runtime():
    """cel-python is a reimplementation: on every rule site of every case here, it must reach the verdict of the
    reference runtime (cel-cpp, the semantics cel-go and so the API server share). It once did not: `!has(a.f) || ...`
    inside a comprehension raised in cel-python where CEL yields true."""
    cel = pytest.importorskip("cel_expr_python.cel", reason="cel-expr-python is in the test extras; pip install it")
    environment = cel.NewEnv(variables={"self": cel.Type.DYN, "oldSelf": cel.Type.DYN})
    manifests = [load_manifest(path) for path in GOOD_FIXTURES]
    # Schema-valid manifests only: next to a type error the rules' verdicts are not reported (cel-python raises on
    # `map == map` with a string where a number belongs; cel-cpp says false).
    manifests += [make() for make, _ in [*CEL_CASES.values(), *UPDATE_CASES.values()]]
    old = with_defaults(good())
    compared = 0
    for manifest in manifests:
        for site in rule_sites(with_defaults(manifest), SCHEMA):
            previous = old_value(old, site.keys)
            ours = evaluate_rule(site.rule, site.value, site.schema, site.path, previous)
            data = {"self": _reference_value(site.value, site.schema)}
            if is_transition_rule(site.rule):
                data["oldSelf"] = _reference_value(previous, site.schema)
            reference = environment.compile(site.rule["rule"]).eval(data=data)
            if reference.type() == cel.Type.ERROR:
                assert ours.evaluation_error is not None, (site.path, site.rule["rule"], reference.plain_value())
            else:
                assert (ours.evaluation_error, ours.passed) == (None, reference.plain_value()), site.path
            compared += 1
    assert compared > 250


def test_manifest_reports_every_problem_at_once_one_line_each():
    manifest = good()
    manifest["spec"]["trainning"] = manifest["spec"].pop("training")
    manifest["spec"]["rollout"]["device"] = "gpu"
    manifest["spec"]["dataset"]["path"] = "/data/x.jsonl"
    manifest["metadata"]["name"] = "Big"
    errors = validate_manifest(manifest)
    assert [error.split(":")[0] for error in errors] == [
        "spec.trainning", "spec.rollout.device", "metadata.name", "spec.dataset"]
    assert all("\n" not in error for error in errors)


def test_manifest_type_error_is_not_buried_under_rule_evaluation_noise():
    manifest = good()
    manifest["spec"]["rollout"]["vllm"]["maxModelLen"] = "8k"
    assert validate_manifest(manifest) == ["spec.rollout.vllm.maxModelLen: must be an integer, not '8k'"]


def test_manifest_rule_that_cannot_be_evaluated_is_reported_not_raised():
    result = evaluate_rule({"rule": "self.missing > 1", "message": "m"}, {"present": 1}, {"type": "object"}, "spec")
    assert not result.passed and result.evaluation_error
    assert result.line.startswith("spec: rule 'self.missing > 1' could not be evaluated: ")


def test_manifest_numbers_are_doubles_in_cel_as_in_kubernetes():
    """`epochs: 2` in a `number` field compares with a double in CEL instead of failing with 'no overload'."""
    schema = {"type": "object", "properties": {"epochs": {"type": "number"}}}
    assert evaluate_rule({"rule": "self.epochs > 1.5"}, {"epochs": 2}, schema, "spec").passed


def test_manifest_read_grporun_returns_typed_defaulted_run():
    run = read_grporun(FIXTURES / "full-gpu.yaml")
    assert (run.name, run.namespace) == ("qwen3-gsm8k", "research")
    assert run.spec.learner_world_size == 16 and run.spec.training.learning_rate == 1e-6
    assert run.manifest["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert read_grporun(FIXTURES / "minimal.yaml").namespace == "default"


def test_manifest_read_grporun_raises_all_problems(tmp_path):
    path = tmp_path / "run.yaml"
    manifest = good()
    manifest["spec"]["training"]["epochs"] = 0
    manifest["spec"]["learner"]["nodes"] = 0
    path.write_text(yaml.safe_dump(manifest))
    with pytest.raises(ManifestInvalid) as raised:
        read_grporun(path)
    assert raised.value.errors == ["spec.learner.nodes: must be >= 1, not 0",
                                   "spec.training.epochs: must be > 0, not 0"]
