"""Per-role pod overrides: each reaches the pods of its role and nothing else, the hardened defaults stay, and the
operator's managed fields are refused — by the CRD's CEL rules (so by `grporun validate`) and by the builders."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from grpo_operator import builders, cli
from grpo_operator.api import SpecError, parse_spec
from grpo_operator.cli.render import PLACEHOLDER_UID, render
from grpo_operator.cluster.kueue import QUEUE_LABEL
from grpo_operator.exit_codes import ExitCode
from grpo_operator.manifest import evaluate_rule, load_crd, load_manifest, rule_sites, with_defaults
from grpo_operator.pod_overrides import OverrideError, PodTemplateOverride, apply_override, local_env_notes
from grpo_operator.run_ref import RunRef
from tests.support.paths import MANIFEST_FIXTURES, REPO
from tests.support.specs import minimal_spec

UID = "0b7c2c9e-1111-2222-3333-444455556666"
HF_TOKEN_FROM_SECRET = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}

ROLLOUT_OVERRIDE = {
    "metadata": {"labels": {"team": "serving"}, "annotations": {"example.com/r": "1"}},
    "spec": {"serviceAccountName": "rollout-sa", "priorityClassName": "rollout-prio", "runtimeClassName": "nvidia",
             "imagePullSecrets": [{"name": "rollout-registry"}], "shmSize": "8Gi",
             "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
             "containers": [{"name": "rollout", "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                                                         HF_TOKEN_FROM_SECRET],
                             "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}]},
}
LEARNER_OVERRIDE = {
    "metadata": {"labels": {"team": "training"}},
    "spec": {"serviceAccountName": "learner-sa", "automountServiceAccountToken": True,
             "priorityClassName": "learner-prio", "schedulerName": "my-scheduler",
             "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                 {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
             "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                            "whenUnsatisfiable": "DoNotSchedule"}],
             "containers": [{"name": "learner", "envFrom": [{"secretRef": {"name": "hf"}}],
                             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]},
}


def pods(rollout: dict | None = None, learner: dict | None = None, *, rollout_fields: dict | None = None,
         learner_fields: dict | None = None) -> dict[str, dict[str, Any]]:
    rollout_spec = {"replicas": 2, **(rollout_fields or {}), **({"podTemplateOverride": rollout} if rollout else {})}
    learner_spec = {"nodes": 2, **(learner_fields or {}), **({"podTemplateOverride": learner} if learner else {})}
    spec = parse_spec(minimal_spec(rollout=rollout_spec, learner=learner_spec))
    return {pod["metadata"]["name"]: pod
            for pod in builders.build_pods(RunRef("run", "ml", UID), spec, trainer_image="img")}


def by_role(objects: dict[str, dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [pod for name, pod in objects.items() if f"-{role}-" in name]


def test_each_override_reaches_the_pods_of_its_role_and_nothing_else():
    plain, both = pods(), pods(ROLLOUT_OVERRIDE, LEARNER_OVERRIDE)
    only_rollout, only_learner = pods(rollout=ROLLOUT_OVERRIDE), pods(learner=LEARNER_OVERRIDE)
    for name in plain:
        mine, other = (only_rollout, only_learner) if "-rollout-" in name else (only_learner, only_rollout)
        assert other[name] == plain[name], f"{name} was changed by the other role's override"
        assert mine[name] != plain[name] and mine[name] == both[name]
    for pod in by_role(both, "rollout"):
        spec, main = pod["spec"], pod["spec"]["containers"][0]
        assert pod["metadata"]["labels"]["team"] == "serving"
        assert pod["metadata"]["annotations"]["example.com/r"] == "1"
        assert (spec["serviceAccountName"], spec["priorityClassName"], spec["runtimeClassName"]) == (
            "rollout-sa", "rollout-prio", "nvidia")
        assert spec["imagePullSecrets"] == [{"name": "rollout-registry"}]
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in spec["volumes"]
        assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in main["env"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        assert spec["automountServiceAccountToken"] is False, "the token stays off unless asked for"
        assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for pod in by_role(both, "learner"):
        spec, main = pod["spec"], pod["spec"]["containers"][0]
        assert pod["metadata"]["labels"]["team"] == "training"
        assert (spec["serviceAccountName"], spec["priorityClassName"], spec["schedulerName"]) == (
            "learner-sa", "learner-prio", "my-scheduler")
        assert spec["automountServiceAccountToken"] is True
        assert spec["affinity"] == LEARNER_OVERRIDE["spec"]["affinity"]
        assert spec["topologySpreadConstraints"] == LEARNER_OVERRIDE["spec"]["topologySpreadConstraints"]
        assert main["envFrom"] == [{"secretRef": {"name": "hf"}}]
        # Hardening kept: only the capability asked for is added back, nothing else changes.
        assert main["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                           "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
                                           "seccompProfile": {"type": "RuntimeDefault"}}
    for pod in both.values():
        kubernetes_validate.validate(pod, "1.33", strict=True)
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["labels"]["grpo.dev/run"] == "run"


def test_a_learner_gets_time_to_checkpoint_on_sigterm_and_an_override_sets_each_roles_grace_period():
    def grace(objects: dict[str, dict[str, Any]], role: str) -> set[int]:
        return {pod["spec"]["terminationGracePeriodSeconds"] for pod in by_role(objects, role)}
    plain = pods()
    assert (grace(plain, "rollout"), grace(plain, "learner")) == ({30}, {120})
    overridden = pods({"spec": {"terminationGracePeriodSeconds": 5}},
                      {"spec": {"terminationGracePeriodSeconds": 900}})
    assert (grace(overridden, "rollout"), grace(overridden, "learner")) == ({5}, {900})
    with pytest.raises(SpecError, match="terminationGracePeriodSeconds"):
        pods(learner={"spec": {"terminationGracePeriodSeconds": -1}})


def test_hf_token_from_a_secret_reaches_both_roles():
    override = {"spec": {"containers": [{"name": "{role}", "env": [HF_TOKEN_FROM_SECRET]}]}}

    def for_role(role: str) -> dict:
        return yaml.safe_load(yaml.safe_dump(override).replace("'{role}'", role))
    objects = pods(for_role("rollout"), for_role("learner"))
    for pod in objects.values():
        assert HF_TOKEN_FROM_SECRET in pod["spec"]["containers"][0]["env"], pod["metadata"]["name"]


def _crd_rule_rejects(field_suffix: str, value: Any) -> bool:
    """Whether the CRD's rule on the override field ending in `field_suffix` refuses `value`."""
    manifest = with_defaults(load_manifest(MANIFEST_FIXTURES / "full-gpu.yaml"))
    sites = [site for site in rule_sites(manifest, load_crd().schema) if site.path.endswith(field_suffix)]
    assert sites, field_suffix
    return any(not evaluate_rule(site.rule, value, site.schema, site.path).passed for site in sites)


def test_the_crds_rules_refuse_every_env_var_volume_and_path_the_builders_manage():
    """The CRD spells the managed names in CEL; the builders own them. Every one the builders produce is refused."""
    filesystem_sync = pods(rollout_fields={"device": "cpu", "weightSync": {"mode": "filesystem"}},
                           learner_fields={"device": "cpu"})
    for pod in filesystem_sync.values():
        main = pod["spec"]["containers"][0]
        for env in main["env"]:
            assert _crd_rule_rejects("learner.podTemplateOverride.spec.containers[0].env[0].name", env["name"]), env
        for volume in pod["spec"]["volumes"]:
            assert _crd_rule_rejects("learner.podTemplateOverride.spec.volumes[0].name", volume["name"]), volume
        mount_path = "learner.podTemplateOverride.spec.containers[0].volumeMounts[0].mountPath"
        assert _crd_rule_rejects(mount_path, main["terminationMessagePath"])
        for mount in main["volumeMounts"]:
            assert _crd_rule_rejects(mount_path, mount["mountPath"])
            assert _crd_rule_rejects(mount_path, mount["mountPath"] + "/sub")
        labels = {key: "x" for key in pod["metadata"]["labels"]}
        for key in labels:
            assert _crd_rule_rejects("learner.podTemplateOverride.metadata.labels", {key: "x"}), key
    assert not _crd_rule_rejects("learner.podTemplateOverride.spec.containers[0].env[0].name", "HF_TOKEN")
    assert not _crd_rule_rejects("learner.podTemplateOverride.spec.containers[0].volumeMounts[0].mountPath", "/data")


@pytest.mark.parametrize("override, error", [
    ({"spec": {"containers": [{"name": "learner", "env": [{"name": "GRPO_ROLE", "value": "rollout"}]}]}},
     "spec.learner.podTemplateOverride.spec.containers[0].env[0].name: GRPO_ROLE is managed by the operator"),
    ({"spec": {"volumes": [{"name": "checkpoints", "emptyDir": {}}]}},
     "spec.learner.podTemplateOverride.spec.volumes[0].name: 'checkpoints' is managed by the operator"),
    ({"spec": {"containers": [{"name": "learner", "volumeMounts": [{"name": "v", "mountPath": "/etc/grpo/x"}]}]}},
     "spec.learner.podTemplateOverride.spec.containers[0].volumeMounts[0].mountPath: /etc/grpo/x is managed"),
    ({"metadata": {"labels": {"grpo.dev/run": "other"}}},
     "spec.learner.podTemplateOverride.metadata.labels.grpo.dev/run: is managed by the operator"),
    ({"spec": {"containers": [{"name": "rollout"}]}},
     "spec.learner.podTemplateOverride.spec.containers[0].name: must be 'learner'"),
])
def test_the_builders_refuse_managed_fields_too(override, error):
    """Defence in depth for an API server that did not run the CRD's rules."""
    pod = pods()["run-learner-0"]
    with pytest.raises(OverrideError) as raised:
        apply_override(pod, PodTemplateOverride.model_validate(override), "spec.learner.podTemplateOverride")
    assert str(raised.value).startswith(error)


def test_parse_spec_refuses_declared_managed_fields_naming_them():
    spec = minimal_spec(learner={"podTemplateOverride": {"spec": {"restartPolicy": "Always"}}})
    with pytest.raises(SpecError) as raised:
        parse_spec(spec)
    assert str(raised.value) == ("spec.learner.podTemplateOverride.spec.restartPolicy: is managed by the operator and "
                                 "cannot be overridden")


def _manifest_with(tmp_path, change) -> str:
    manifest = load_manifest(MANIFEST_FIXTURES / "full-gpu.yaml")
    change(manifest["spec"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_grporun_validate_names_each_managed_field(tmp_path, capsys):
    def change(spec):
        learner = spec["learner"]["podTemplateOverride"]
        learner["spec"]["containers"][0]["env"].append({"name": "GRPO_RUN", "value": "x"})
        learner["spec"]["containers"][0]["ports"] = [{"containerPort": 1}]
        spec["rollout"]["podTemplateOverride"]["spec"]["restartPolicy"] = "Always"
    path = _manifest_with(tmp_path, change)
    assert cli.main(["validate", path]) == ExitCode.INVALID
    lines = capsys.readouterr().err.splitlines()
    prefix = f"{path}: spec.learner.podTemplateOverride.spec.containers[0]"
    assert sorted(lines) == sorted([
        f"{prefix}.env[2].name: is managed by the operator: GRPO_* variables, HF_HOME, HOME and PYTHONUNBUFFERED "
        "are set on every pod",
        f"{prefix}.ports: is managed by the operator (the contract's ports) and cannot be overridden",
        f"{path}: spec.rollout.podTemplateOverride.spec.restartPolicy: is managed by the operator (Never: it decides "
        "retries by exit code) and cannot be overridden",
    ])


def test_the_restart_policy_refusal_says_each_roles_own_policy(tmp_path, capsys):
    """Rollout and learner pods never restart in place (the operator retries by exit code); environment servers
    always do: the refusal of an override says which."""
    def change(spec):
        spec["learner"]["podTemplateOverride"]["spec"]["restartPolicy"] = "OnFailure"
        spec["environments"] = [{"name": "guess", "image": "guess:1",
                                 "podTemplateOverride": {"spec": {"restartPolicy": "Never"}}}]
    path = _manifest_with(tmp_path, change)
    assert cli.main(["validate", path]) == ExitCode.INVALID
    assert sorted(capsys.readouterr().err.splitlines()) == [
        f"{path}: spec.environments[0].podTemplateOverride.spec.restartPolicy: is managed by the operator (Always: "
        "an environment server restarts in place, and a pod that ends is created again) and cannot be overridden",
        f"{path}: spec.learner.podTemplateOverride.spec.restartPolicy: is managed by the operator (Never: it decides "
        "retries by exit code) and cannot be overridden",
    ]


def test_grporun_render_shows_the_overrides(tmp_path):
    path = _manifest_with(tmp_path, lambda spec: None)
    objects = {obj["metadata"]["name"]: obj for obj in yaml.safe_load_all(
        render(path, namespace="ml", trainer_image="img", uid=PLACEHOLDER_UID))}
    learner, rollout = objects["qwen3-gsm8k-learner-1"], objects["qwen3-gsm8k-rollout-0"]
    assert learner["spec"]["serviceAccountName"] == "grpo-learner" and learner["spec"]["runtimeClassName"] == "nvidia"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in learner["spec"]["containers"][0]["env"]
    assert rollout["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert "envFrom" not in learner["spec"]["containers"][0] or learner["spec"]["containers"][0]["envFrom"] == [
        {"configMapRef": {"name": "nccl-tuning"}, "prefix": "NCCL_"}]
    assert objects["qwen3-gsm8k"]["kind"] == "PodGroup"  # the fixture also asks for gang scheduling
    for obj in objects.values():
        if obj["kind"] != "PodGroup":  # a CRD kubernetes-validate does not know
            kubernetes_validate.validate(obj, "1.33", strict=True)


def test_local_names_what_it_cannot_resolve():
    override = PodTemplateOverride.model_validate(copy.deepcopy(LEARNER_OVERRIDE) | {"spec": {"containers": [
        {"name": "learner", "env": [HF_TOKEN_FROM_SECRET, {"name": "WANDB_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": "wandb", "key": "k"}}}, {"name": "LITERAL", "value": "1"}],
         "envFrom": [{"configMapRef": {"name": "tuning"}}]}]}})
    assert local_env_notes("learner", override, {"HF_TOKEN": "hf_x"}) == [
        "learner: HF_TOKEN (secretKeyRef) taken from the local environment",
        "learner: WANDB_API_KEY (secretKeyRef) cannot be resolved locally: export WANDB_API_KEY to pass it",
        "learner: envFrom ConfigMap tuning cannot be read locally: export its variables to pass them",
    ]
    assert local_env_notes("learner", None, {}) == []


def test_the_gpu_example_takes_hf_token_from_a_secret_runs_at_a_priority_and_is_queued_by_kueue(capsys):
    example = REPO / "examples" / "gpu.yaml"
    assert cli.main(["validate", str(example)]) == 0, capsys.readouterr().err
    assert load_manifest(example)["metadata"]["labels"][QUEUE_LABEL] == "research"
    objects = list(yaml.safe_load_all(render(str(example), namespace="ml", trainer_image="img", uid=PLACEHOLDER_UID)))
    pods = [obj for obj in objects if obj["kind"] == "Pod"]
    assert {pod["metadata"]["labels"]["grpo.dev/role"] for pod in pods} == {"rollout", "learner"}
    for pod in pods:
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        assert pod["spec"]["priorityClassName"] == "research-high"
