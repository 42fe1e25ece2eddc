"""Unit tests of the pure builders: names, ownership, commands, hardening, and validity against the Kubernetes API
schemas (kubernetes-validate, strict: unknown fields are errors)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from grpo_operator import builders
from grpo_operator.api import parse_spec
from grpo_operator.run_ref import RunRef
from grpo_trainer.contract.codes import DEFAULT_TERMINATION_MESSAGE_PATH, LEARNER_HTTP_PORT, ROLLOUT_HTTP_PORT
from grpo_trainer.contract.config import load_run_config
from grpo_trainer.contract.rollout_pod import PROBE_TIMEOUT_S, STARTUP_WAIT_S
from tests.support.specs import minimal_spec

KUBERNETES_VERSION = "1.33"
UID = "0b7c2c9e-1111-2222-3333-444455556666"


def children(**overrides: Any) -> list[dict[str, Any]]:
    spec = parse_spec(minimal_spec(**overrides))
    return builders.build_children(RunRef("run", "ml", UID), spec, trainer_image="registry.example/grpo-trainer:1")


def by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects}


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    return only


SPECS = {
    "minimal": {},
    "multi-node gpu": {"rollout": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                       "learner": {"nodes": 2, "processesPerNode": 4, "resources": {"limits": {"nvidia.com/gpu": 4}},
                                   "nodeSelector": {"gpu": "h100"},
                                   "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
                       "checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
                       "output": {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
    "object store output": {"learner": {"nodes": 2},
                            "output": {"uri": "s3://models/runs", "credentialsSecret": "s3-models",
                                       "endpoint": "http://minio.storage:9000", "region": "eu-west-1"}},
    "inputs and model cache": {"model": "s3://models/qwen3", "rollout": {"replicas": 2},
                               "inputs": {"volume": {"persistentVolumeClaim": {"claimName": "datasets"}},
                                          "credentialsSecret": "s3-inputs", "endpoint": "http://minio:9000",
                                          "hubTokenSecret": "hub"},
                               "modelCache": {"volume": {"persistentVolumeClaim": {"claimName": "model-cache"}}}},
    "cpu filesystem sync": {"rollout": {"device": "cpu", "weightSync": {"mode": "filesystem"}},
                            "learner": {"device": "cpu", "processesPerNode": 2}},
    "environments": {"environments": [
        {"name": "guess", "image": "registry.example/guess:1", "replicas": 2, "port": 8765,
         "command": ["python", "-m", "guess"], "args": ["--port", "8765"],
         "env": [{"name": "LEVEL", "value": "3"},
                 {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "guess", "key": "token"}}}],
         "resources": {"requests": {"cpu": "100m"}},
         "readinessProbe": {"httpGet": {"path": "/ready", "port": 8765}, "periodSeconds": 5},
         "podTemplateOverride": {"metadata": {"labels": {"team": "envs"}},
                                 "spec": {"containers": [{"name": "environment",
                                                          "env": [{"name": "EXTRA", "value": "1"}]}]}}},
        {"name": "code-exec", "image": "registry.example/sandbox:1", "replicas": 0}]},
    "tracking": {"tracking": {"mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "mlflow-login"},
                              "tensorboard": {},
                              "wandb": {"project": "grpo", "apiKeySecret": {"name": "wandb", "key": "apiKey"}}}},
}


@pytest.mark.parametrize("overrides", SPECS.values(), ids=SPECS.keys())
def test_every_object_is_valid_against_the_kubernetes_api_schemas(overrides):
    for obj in children(**overrides):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_names_are_deterministic_and_everything_is_owned_and_labelled():
    objects = children(rollout={"replicas": 2}, learner={"nodes": 2})
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "run-config"), ("Service", "run-rollout"), ("Service", "run-learner"),
        ("Pod", "run-rollout-0"), ("Pod", "run-rollout-1"), ("Pod", "run-learner-0"), ("Pod", "run-learner-1")]
    assert objects == children(rollout={"replicas": 2}, learner={"nodes": 2})
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": "run",
                                            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["grpo.dev/run"] == "run"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "grpo-operator"
        assert meta["labels"]["app.kubernetes.io/instance"] == "run"
    pods = by_name(objects)
    assert pods["run-rollout-1"]["metadata"]["labels"]["grpo.dev/role"] == "rollout"
    assert pods["run-learner-1"]["metadata"]["labels"]["grpo.dev/role"] == "learner"


def test_config_map_holds_the_resolved_run_config_with_per_server_urls():
    objects = by_name(children(rollout={"replicas": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.run_name == "run" and config.namespace == "ml"
    assert config.rollout.urls == [f"http://run-rollout-{i}.run-rollout.ml.svc:{ROLLOUT_HTTP_PORT}" for i in (0, 1)]
    assert config.checkpoint.directory == builders.CHECKPOINT_DIR
    assert config.termination_message_path == DEFAULT_TERMINATION_MESSAGE_PATH
    assert config.rollout.weight_sync.directory is None


def test_filesystem_weight_sync_mounts_one_directory_in_both_roles():
    objects = by_name(children(rollout={"device": "cpu", "weightSync": {
        "mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}},
        learner={"device": "cpu"}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.rollout.weight_sync.directory == builders.WEIGHT_SYNC_DIR
    for name in ("run-rollout-0", "run-learner-0"):
        pod = objects[name]
        assert {"name": "weights", "persistentVolumeClaim": {"claimName": "weights"}} in pod["spec"]["volumes"]
        assert {"name": "weights", "mountPath": builders.WEIGHT_SYNC_DIR} in container(pod)["volumeMounts"]


def test_the_output_volume_is_mounted_by_the_learner_that_exports_and_named_in_the_run_config():
    output = {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}
    objects = by_name(children(output=output, learner={"nodes": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.output is not None
    assert config.output.directory == f"{builders.MODEL_OUTPUT_DIR}/run"
    assert config.output.uri == "pvc://models/run"
    assert config.output.run_spec["output"] == output and config.output.run_spec["model"]  # the spec, as stored
    model_volume = {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    model_mount = {"name": "model", "mountPath": builders.MODEL_OUTPUT_DIR}
    assert model_volume in objects["run-learner-0"]["spec"]["volumes"]
    assert model_mount in container(objects["run-learner-0"])["volumeMounts"]
    for name in ("run-learner-1", "run-rollout-0"):  # a ReadWriteOnce claim is needed by rank 0 alone
        assert "model" not in {volume["name"] for volume in objects[name]["spec"]["volumes"]}
        assert "model" not in {mount["name"] for mount in container(objects[name])["volumeMounts"]}


def test_an_object_store_output_is_staged_in_the_pod_and_uploaded_with_the_secrets_keys_as_env():
    output = {"uri": "s3://models/runs/qwen", "credentialsSecret": "s3-models",
              "endpoint": "http://minio.storage:9000", "region": "eu-west-1"}
    objects = by_name(children(output=output, learner={"nodes": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.output is not None
    assert config.output.directory == f"{builders.OUTPUT_DIR}/run"  # the pod's own emptyDir: no volume to mount
    assert config.output.uri == "s3://models/runs/qwen"
    rank0 = objects["run-learner-0"]
    assert "model" not in {volume["name"] for volume in rank0["spec"]["volumes"]}
    env = {var["name"]: var for var in container(rank0)["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "s3-models", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "s3-models",
                                                                          "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://minio.storage:9000"
    assert env["AWS_REGION"]["value"] == "eu-west-1"
    for name in ("run-learner-1", "run-rollout-0"):  # the credentials go to the pod that uploads alone
        assert not any(var["name"].startswith("AWS_") for var in container(objects[name])["env"])


def test_an_object_store_output_beside_a_volume_is_written_to_the_volume_then_uploaded():
    output = {"volume": {"persistentVolumeClaim": {"claimName": "models"}}, "uri": "s3://models/runs/qwen"}
    objects = by_name(children(output=output))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.output is not None
    assert (config.output.directory, config.output.uri) == (f"{builders.MODEL_OUTPUT_DIR}/run", "s3://models/runs/qwen")
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in objects["run-learner-0"]["spec"][
        "volumes"]
    env = {var["name"] for var in container(objects["run-learner-0"])["env"]}
    assert not env & {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL_S3"}  # no Secret, no endpoint: the pod's own identity


def test_an_object_store_for_checkpoints_reaches_every_learner_rank_and_the_run_config():
    checkpoint = {"uri": "s3://ckpts/runs/qwen", "credentialsSecret": "s3-ckpts", "endpoint": "http://minio:9000",
                  "keep": 3}
    objects = by_name(children(checkpoint=checkpoint, learner={"nodes": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert (config.checkpoint.uri, config.checkpoint.keep) == ("s3://ckpts/runs/qwen", 3)
    assert config.checkpoint.directory == builders.CHECKPOINT_DIR
    # Each learner pod's checkpoint folder is its own: each rank may download the checkpoint it resumes from.
    for name in ("run-learner-0", "run-learner-1"):
        env = {var["name"]: var for var in container(objects[name])["env"]}
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "s3-ckpts",
                                                                          "key": "AWS_ACCESS_KEY_ID"}}
        assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://minio:9000"
        # What a preempted learner may spend waiting for its checkpoint's upload.
        assert env["GRPO_TERMINATION_GRACE_SECONDS"]["value"] == str(
            objects[name]["spec"]["terminationGracePeriodSeconds"])
    assert not any(var["name"].startswith("AWS_") for var in container(objects["run-rollout-0"])["env"])


def test_every_pod_shares_the_model_cache_volume_for_the_hubs_cache_and_the_inputs_downloads():
    cache = {"persistentVolumeClaim": {"claimName": "model-cache"}}
    objects = by_name(children(modelCache={"volume": cache}, rollout={"replicas": 2}, learner={"nodes": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.inputs.cache_dir == builders.INPUTS_CACHE_DIR
    assert config.inputs.cache_dir.startswith(builders.MODEL_CACHE_DIR + "/")
    for name in ("run-rollout-0", "run-rollout-1", "run-learner-0", "run-learner-1"):
        pod = objects[name]
        assert {"name": "model-cache", **cache} in pod["spec"]["volumes"]
        assert {"name": "model-cache", "mountPath": builders.MODEL_CACHE_DIR} in container(pod)["volumeMounts"]
        env = {var["name"]: var.get("value") for var in container(pod)["env"]}
        assert env["HF_HOME"].startswith(builders.MODEL_CACHE_DIR + "/")


def test_without_a_model_cache_each_pod_downloads_into_its_own():
    objects = by_name(children())
    for name in ("run-rollout-0", "run-learner-0"):
        assert {"name": "model-cache", "emptyDir": {}} in objects[name]["spec"]["volumes"]


def test_the_inputs_volume_and_credentials_reach_every_learner_and_rollout_pod():
    inputs = {"volume": {"persistentVolumeClaim": {"claimName": "datasets"}}, "credentialsSecret": "s3-inputs",
              "endpoint": "http://minio:9000", "region": "eu-west-1", "hubTokenSecret": "hub"}
    output = {"uri": "s3://models/runs", "credentialsSecret": "s3-models"}
    objects = by_name(children(model="s3://models/qwen3", inputs=inputs, output=output, learner={"nodes": 2}))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert (config.inputs.endpoint, config.inputs.region) == ("http://minio:9000", "eu-west-1")
    assert (config.inputs.credentials_secret, config.inputs.hub_token_secret) == ("s3-inputs", "hub")
    for name in ("run-rollout-0", "run-learner-0", "run-learner-1"):
        pod = objects[name]
        assert {"name": "inputs", "persistentVolumeClaim": {"claimName": "datasets"}} in pod["spec"]["volumes"]
        assert {"name": "inputs", "mountPath": builders.INPUTS_DIR, "readOnly": True} in container(pod)["volumeMounts"]
        env = {var["name"]: var for var in container(pod)["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            assert env[f"GRPO_INPUTS_{key}"]["valueFrom"] == {
                "secretKeyRef": {"name": "s3-inputs", "key": key, "optional": True}}
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hub", "key": "HF_TOKEN", "optional": True}}
    # spec.output's credentials stay rank 0's, under the names boto3 reads, apart from the inputs'.
    rank0 = {var["name"]: var for var in container(objects["run-learner-0"])["env"]}
    assert rank0["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3-models"


def test_without_an_output_no_model_volume_and_no_output_in_the_run_config():
    objects = by_name(children())
    assert load_run_config(objects["run-config"]["data"]["run.json"]).output is None
    assert "model" not in {volume["name"] for volume in objects["run-learner-0"]["spec"]["volumes"]}


@pytest.mark.parametrize(("volume", "uri"), [
    ({"persistentVolumeClaim": {"claimName": "models"}}, "pvc://models/run"),
    ({"hostPath": {"path": "/data/models/"}}, "file:///data/models/run"),
    ({"nfs": {"server": "nas", "path": "/exports/models"}}, "nfs://nas/exports/models/run"),
    ({"nfs": {"server": "nas", "path": "/"}}, "nfs://nas/run"),
    ({"csi": {"driver": "x"}}, "csi:///run"),
])
def test_the_output_uri_names_where_users_find_the_model(volume, uri):
    assert builders.output_uri("run", volume) == uri


def test_services_are_headless_and_publish_not_ready_addresses():
    objects = by_name(children())
    for name, role in (("run-rollout", "rollout"), ("run-learner", "learner")):
        spec = objects[name]["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
        assert spec["selector"] == {"grpo.dev/run": "run", "grpo.dev/role": role}
    assert [p["port"] for p in objects["run-learner"]["spec"]["ports"]] == [LEARNER_HTTP_PORT, 29500]


def test_rollout_pod_runs_the_server_with_a_health_readiness_probe():
    pod = by_name(children())["run-rollout-0"]
    main = container(pod)
    assert main["command"] == ["python", "-m", "grpo_trainer", "rollout", "--config", "/etc/grpo/run.json"]
    assert main["readinessProbe"]["httpGet"] == {"path": "/health", "port": ROLLOUT_HTTP_PORT}
    assert main["image"] == "registry.example/grpo-trainer:1"
    assert pod["spec"]["hostname"] == "run-rollout-0" and pod["spec"]["subdomain"] == "run-rollout"


def test_rollout_liveness_proves_generation_once_the_server_has_started():
    # /health answers for a hung engine and for one that died: liveness runs the one-token probe
    # (tests/trainer/server/test_health.py runs that command against a stopped server).
    main = container(by_name(children())["run-rollout-0"])
    liveness = main["livenessProbe"]
    assert liveness["exec"]["command"] == ["python", "-m", "grpo_trainer", "probe", "--config", "/etc/grpo/run.json"]
    assert liveness["timeoutSeconds"] > PROBE_TIMEOUT_S
    startup = main["startupProbe"]
    assert startup["exec"]["command"] == [*liveness["exec"]["command"], "--startup"]
    # One run waits minutes for /health; a slow model load fails it once per wait, not once per 10 s.
    assert startup["timeoutSeconds"] > STARTUP_WAIT_S >= 240
    assert startup["failureThreshold"] * (STARTUP_WAIT_S + startup["periodSeconds"]) >= 3600


@pytest.mark.parametrize("name", ["run-rollout-0", "run-learner-0"])
def test_pods_are_hardened_and_leave_retries_to_the_operator(name):
    pod = by_name(children())[name]
    spec, main = pod["spec"], container(pod)
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert main["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert main["terminationMessagePath"] == DEFAULT_TERMINATION_MESSAGE_PATH
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts["config"] == "/etc/grpo" and mounts["checkpoints"] == builders.CHECKPOINT_DIR
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["GRPO_RUN"] == "run" and env["GRPO_CONFIG"] == "/etc/grpo/run.json"


def test_a_single_process_learner_runs_python_directly():
    main = container(by_name(children())["run-learner-0"])
    assert main["command"] == ["python", "-m", "grpo_trainer", "learner", "--config", "/etc/grpo/run.json"]
    assert "readinessProbe" not in main  # the learner waits for the servers itself; ranks > 0 serve nothing


def test_multi_node_learners_get_accelerates_rendezvous_flags_per_rank():
    objects = by_name(children(learner={"nodes": 3, "processesPerNode": 8}))
    for rank in range(3):
        supervised = container(objects[f"run-learner-{rank}"])["command"]
        # grpo_trainer.learner.gang gives the pod the exit code its 8 ranks decided (torchrun alone would say 1)
        assert supervised[:6] == ["python", "-m", "grpo_trainer.learner.gang", "--ranks", "8", "--"]
        command = supervised[6:]
        assert command[:4] == ["python", "-m", "accelerate.commands.launch", "--multi_gpu"]
        flags = dict(zip(command[4:14:2], command[5:14:2], strict=True))
        assert flags == {"--num_machines": "3", "--machine_rank": str(rank),
                         "--main_process_ip": "run-learner-0.run-learner.ml.svc", "--main_process_port": "29500",
                         "--num_processes": "24"}
        assert command[14:] == ["-m", "grpo_trainer", "learner", "--config", "/etc/grpo/run.json"]


def test_fsdp2_learners_launch_under_accelerates_fsdp2_plugin_with_the_specs_offload():
    objects = by_name(children(learner={"nodes": 2, "processesPerNode": 4, "strategy": "fsdp2",
                                        "fsdp": {"cpuOffload": True}}))
    for rank in range(2):
        command = container(objects[f"run-learner-{rank}"])["command"]
        assert command[:6] == ["python", "-m", "grpo_trainer.learner.gang", "--ranks", "4", "--"]
        assert "--multi_gpu" not in command and command[command.index("--fsdp_version") + 1] == "2"
        assert command[command.index("--fsdp_offload_params") + 1] == "true"
        assert command[command.index("--machine_rank") + 1] == str(rank)
        assert command[command.index("--num_processes") + 1] == "8"
    # One GPU under fsdp2 (the CPU offload's case) is launched by accelerate as well.
    single = container(by_name(children(learner={"strategy": "fsdp2"}))["run-learner-0"])["command"]
    assert "--use_fsdp" in single and single[single.index("--fsdp_offload_params") + 1] == "false"
    # GPU ranks compute in bf16; CPU ranks in float32, as every CPU learner.
    assert single[single.index("--mixed_precision") + 1] == "bf16"
    cpu = container(by_name(children(learner={"strategy": "fsdp2", "device": "cpu", "processesPerNode": 2}))[
        "run-learner-0"])["command"]
    assert cpu[cpu.index("--mixed_precision") + 1] == "no"


def test_cpu_learners_launch_with_torchrun_not_accelerates_cpu_flag():
    # `accelerate launch --cpu` uses its single-process launcher whatever --num_processes says: 2 ranks become 1.
    command = container(by_name(children(learner={"device": "cpu", "processesPerNode": 2}))["run-learner-0"])["command"]
    assert "--cpu" not in command and command[9] == "--multi_gpu"
    assert command[command.index("--num_processes") + 1] == "2"


def test_spec_images_resources_and_placement_reach_the_pods():
    objects = by_name(children(**SPECS["multi-node gpu"], ))
    learner = objects["run-learner-1"]
    assert container(learner)["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert learner["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert learner["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in learner["spec"]["volumes"]
    custom = by_name(children(rollout={"image": "vllm:custom", "imagePullPolicy": "Always"}))["run-rollout-0"]
    assert container(custom)["image"] == "vllm:custom" and container(custom)["imagePullPolicy"] == "Always"


def test_the_attempt_is_annotated_on_recreated_pods():
    spec = parse_spec(minimal_spec())
    pods = builders.build_pods(RunRef("run", "ml", UID), spec, trainer_image="img", attempt=2)
    assert {p["metadata"]["annotations"][builders.ATTEMPT_ANNOTATION] for p in pods} == {"2"}


def test_a_rollout_pod_carries_its_servers_restarts_so_far():
    spec = parse_spec(minimal_spec(rollout={"replicas": 2}))
    pods = by_name(builders.build_pods(RunRef("run", "ml", UID), spec, trainer_image="img", rollout_restarts={1: 2}))
    restarts = {name: p["metadata"]["annotations"].get(builders.ROLLOUT_RESTARTS_ANNOTATION)
                for name, p in pods.items()}
    assert restarts == {"run-rollout-0": "0", "run-rollout-1": "2", "run-learner-0": None}


def test_the_schema_check_itself_catches_a_wrong_field():
    pod = by_name(children())["run-learner-0"]
    container(pod)["commandd"] = ["python"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_tracker_credentials_reach_the_learner_pods_only_from_the_named_secrets():
    objects = by_name(children(**SPECS["tracking"]))
    learner_env = {e["name"]: e for e in container(objects["run-learner-0"])["env"]}
    for key, variable in {"username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD",
                          "token": "MLFLOW_TRACKING_TOKEN"}.items():
        assert learner_env[variable]["valueFrom"] == {
            "secretKeyRef": {"name": "mlflow-login", "key": key, "optional": True}}
    assert learner_env["WANDB_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "wandb", "key": "apiKey", "optional": True}}
    rollout_env = {e["name"] for e in container(objects["run-rollout-0"])["env"]}
    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_USERNAME"} & rollout_env
    # The rest of the tracking settings travel in the run config, not as env.
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.tracking.mlflow.tracking_uri == "http://mlflow:5000" and config.tracking.trackers == [
        "mlflow", "tensorboard", "wandb"]


def test_a_run_without_tracking_has_no_tracker_env():
    objects = by_name(children())
    names = {e["name"] for e in container(objects["run-learner-0"])["env"]}
    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} & names


# --- environment servers (spec.environments) --------------------------------------------------------------------------
ENVIRONMENTS = SPECS["environments"]


def test_each_environment_is_a_service_and_its_replicas_as_owned_labelled_pods():
    objects = children(**ENVIRONMENTS)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "run-config"), ("Service", "run-rollout"), ("Service", "run-learner"),
        ("Service", "run-env-guess"), ("Service", "run-env-code-exec"),
        ("Pod", "run-rollout-0"), ("Pod", "run-learner-0"), ("Pod", "run-env-guess-0"), ("Pod", "run-env-guess-1")]
    named = by_name(objects)
    service = named["run-env-guess"]
    # One URL for the pool: a headless Service whose name resolves to the ready servers only, so that the learner's
    # client pins each episode to one of them (a cluster IP would spread an episode's calls over the servers).
    assert service["spec"]["clusterIP"] == "None" and "publishNotReadyAddresses" not in service["spec"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8765, "targetPort": 8765, "protocol": "TCP"}]
    assert service["spec"]["selector"] == {"grpo.dev/run": "run", "grpo.dev/role": "environment",
                                           "grpo.dev/environment": "guess"}
    for name in ("run-env-guess", "run-env-guess-0", "run-env-guess-1"):
        metadata = named[name]["metadata"]
        assert metadata["ownerReferences"][0]["uid"] == UID and metadata["ownerReferences"][0]["controller"]
        assert service["spec"]["selector"].items() <= metadata["labels"].items()
    assert named["run-env-guess-1"]["metadata"]["labels"]["team"] == "envs"


def test_an_environment_pod_runs_the_image_as_specified_hardened_and_restarting_in_place():
    pod = by_name(children(**ENVIRONMENTS))["run-env-guess-0"]
    main = container(pod)
    assert main["name"] == "environment" and main["image"] == "registry.example/guess:1"
    assert main["command"] == ["python", "-m", "guess"] and main["args"] == ["--port", "8765"]
    assert main["ports"] == [{"name": "http", "containerPort": 8765, "protocol": "TCP"}]
    assert main["env"] == [{"name": "LEVEL", "value": "3"},
                           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "guess", "key": "token"}}},
                           {"name": "PORT", "value": "8765"}, {"name": "EXTRA", "value": "1"}]
    assert main["resources"] == {"requests": {"cpu": "100m"}}
    assert main["readinessProbe"] == {"httpGet": {"path": "/ready", "port": 8765}, "periodSeconds": 5}
    assert main["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Always"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # Nothing of the run's own: no run config, checkpoints or credentials on a user's server.
    assert [volume["name"] for volume in spec["volumes"]] == ["shm"]


def test_an_environment_without_a_probe_or_command_is_ready_once_its_port_accepts_and_runs_its_image_entrypoint():
    pod = by_name(children(environments=[{"name": "guess", "image": "guess:1"}]))["run-env-guess-0"]
    main = container(pod)
    assert main["readinessProbe"]["tcpSocket"] == {"port": 8000}
    # The server's port is in $PORT too, for a server that reads it or a command that names it as $(PORT).
    assert "command" not in main and "args" not in main and main["env"] == [{"name": "PORT", "value": "8000"}]


def test_the_run_config_and_the_learner_pods_name_each_environments_url():
    objects = by_name(children(learner={"nodes": 2}, **ENVIRONMENTS))
    config = load_run_config(objects["run-config"]["data"]["run.json"])
    assert config.environments == {"guess": "http://run-env-guess.ml.svc:8765",
                                   "code-exec": "http://run-env-code-exec.ml.svc:8000"}
    for learner in ("run-learner-0", "run-learner-1"):
        env = {item["name"]: item.get("value") for item in container(objects[learner])["env"]}
        assert env["GRPO_ENVIRONMENT_GUESS_URL"] == "http://run-env-guess.ml.svc:8765"
        assert env["GRPO_ENVIRONMENT_CODE_EXEC_URL"] == "http://run-env-code-exec.ml.svc:8000"
    assert not any(item["name"].startswith("GRPO_ENVIRONMENT_") for item in container(objects["run-rollout-0"])["env"])


def test_a_run_without_environments_has_none_in_its_run_config():
    config = load_run_config(by_name(children())["run-config"]["data"]["run.json"])
    assert config.environments == {}


def test_environment_servers_stay_out_of_the_gang():
    objects = by_name(children(scheduling={"gang": {"scheduler": "volcano"}}, **ENVIRONMENTS))
    assert objects["run"]["kind"] == "PodGroup" and objects["run"]["spec"]["minMember"] == 2  # rollout, learner
    assert "schedulerName" not in objects["run-env-guess-0"]["spec"]
