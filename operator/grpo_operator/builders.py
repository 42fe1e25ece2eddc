"""Pure builders: a GRPORun spec -> the Kubernetes objects that run it, as plain dicts (no I/O, no clock).

One run is: a ConfigMap with the resolved run config (`run.json`), a headless rollout Service and one pod per vLLM
server, a headless learner Service and one pod per learner node. All of them carry a controller ownerReference to
the GRPORun (deleting the run deletes them), deterministic names (creation is idempotent: 409 means done) and the
`api.RUN_LABEL` + `api.ROLE_LABEL` labels the operator selects them by.

Why the shapes are what they are:
- Both Services are headless with `publishNotReadyAddresses`: the learner addresses every rollout server by its own
  DNS name (weight sync goes to each server, not to a load-balanced one), and learner rank 0 must resolve before
  any pod is ready, or accelerate's rendezvous never starts.
- All pods are created together. The learner waits for the rollout servers itself (TRL's
  VLLMClient.wait_for_server_ready polls /health); creating learners only after the servers are ready would
  deadlock a gang scheduler that admits all pods of a run or none.
- `accelerate launch` ignores MASTER_ADDR/RANK-style variables and silently trains at world size 1 without
  `--num_machines/--machine_rank/--main_process_ip/--main_process_port`, so each learner pod gets its own flags.
- restartPolicy Never: the operator decides retries from the exit code (the learner <-> operator contract), and
  the termination message (FallbackToLogsOnError) survives the container for `status.failure`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_trainer.contract.codes import DEFAULT_TERMINATION_MESSAGE_PATH, LEARNER_HTTP_PORT, ROLLOUT_HTTP_PORT
from grpo_trainer.contract.config import TrackingConfig, request_timeout_seconds
from grpo_trainer.contract.launch import MAIN_PROCESS_PORT, GangLayout, learner_argv
from grpo_trainer.contract.pod_env import (
    HUB_TOKEN_ENV,
    INPUT_CREDENTIALS_ENV_PREFIX,
    MLFLOW_CREDENTIAL_ENV,
    TERMINATION_GRACE_ENV,
    WANDB_API_KEY_ENV,
    environment_url_variable,
)
from grpo_trainer.contract.rollout_pod import (
    LIVENESS_FAILURE_THRESHOLD,
    LIVENESS_PERIOD_S,
    PROBE_TIMEOUT_S,
    STARTUP_WAIT_S,
)
from grpo_trainer.contract.store_uri import ACCESS_KEY_ENV, ENDPOINT_ENV, REGION_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV

from . import podgroup
from .api import (
    ATTEMPT_ANNOTATION,
    ENVIRONMENT_LABEL,
    GENERATION_ANNOTATION,
    MANAGED_BY,
    ROLE_LABEL,
    ROLLOUT_RESTARTS_ANNOTATION,
    RUN_LABEL,
    EnvironmentSpec,
    GRPORunSpec,
    InputsSpec,
    OutputSpec,
    RolePodSpec,
    StoreSpec,
)
from .pod_overrides import apply_override
from .resolve import RunPlacement, resolve_run_config
from .run_ref import RunRef

#: The image of rollout and learner pods whose spec names none; the operator's --trainer-image overrides it.
DEFAULT_TRAINER_IMAGE = "grpo-trainer:cuda"
#: The role label of environment servers' pods and Services (spec.environments).
ENVIRONMENT_ROLE = "environment"
TRAINER_IMAGE_ENV = "GRPO_TRAINER_IMAGE"

CONFIG_DIR = "/etc/grpo"
CONFIG_FILE = "run.json"
CHECKPOINT_DIR = "/var/lib/grpo/checkpoints"
OUTPUT_DIR = "/var/lib/grpo/output"
#: Where the learner's rank 0 mounts spec.output.volume; the model goes to a folder named after the run in it.
MODEL_OUTPUT_DIR = "/var/lib/grpo/model"
MODEL_OUTPUT_VOLUME = "model"
WEIGHT_SYNC_DIR = "/var/lib/grpo/weights"
CACHE_DIR = "/var/cache/grpo"
#: The model cache every pod of a run mounts (spec.modelCache.volume, else the pod's own emptyDir): the hub's cache
#: (HF_HOME) and the s3:// inputs' downloads (INPUTS_CACHE_DIR).
MODEL_CACHE_DIR = "/var/cache/grpo-models"
INPUTS_CACHE_DIR = f"{MODEL_CACHE_DIR}/objects"
#: Where learner and rollout pods mount spec.inputs.volume, read-only: spec.model and dataset.path name paths in it.
INPUTS_DIR = "/var/lib/grpo/inputs"
#: The trainer image's own user (its HOME and caches are that user's), fixed so files on a shared checkpoint volume
#: stay writable across restarts.
RUN_AS_USER = 10001


def default_trainer_image() -> str:
    """$GRPO_TRAINER_IMAGE, else DEFAULT_TRAINER_IMAGE."""
    return os.environ.get(TRAINER_IMAGE_ENV, DEFAULT_TRAINER_IMAGE)


# ---------------------------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------------------------
def config_map_name(run: str) -> str:
    return f"{run}-config"


def rollout_service_name(run: str) -> str:
    return f"{run}-rollout"


def learner_service_name(run: str) -> str:
    return f"{run}-learner"


def rollout_pod_name(run: str, index: int) -> str:
    return f"{run}-rollout-{index}"


def learner_pod_name(run: str, rank: int) -> str:
    return f"{run}-learner-{rank}"


def environment_service_name(run: str, environment: str) -> str:
    return f"{run}-env-{environment}"


def environment_pod_prefix(run: str, environment: str) -> str:
    """What an environment's server pods are named before their index."""
    return f"{run}-env-{environment}-"


def environment_pod_name(run: str, environment: str, index: int) -> str:
    return f"{environment_pod_prefix(run, environment)}{index}"


def environment_urls(run: str, namespace: str, environments: Sequence[EnvironmentSpec] | None) -> dict[str, str]:
    """Each environment's URL by its name: its headless Service's, whose name resolves to the servers that are
    ready."""
    return {environment.name: f"http://{environment_service_name(run, environment.name)}.{namespace}.svc:"
                               f"{environment.port}" for environment in environments or []}


def pod_dns(pod: str, service: str, namespace: str) -> str:
    return f"{pod}.{service}.{namespace}.svc"


def rollout_urls(run: str, namespace: str, replicas: int) -> list[str]:
    service = rollout_service_name(run)
    return [f"http://{pod_dns(rollout_pod_name(run, i), service, namespace)}:{ROLLOUT_HTTP_PORT}"
            for i in range(replicas)]


# ---------------------------------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------------------------------
def run_labels(run: str, role: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "grpo-run",
        "app.kubernetes.io/instance": run,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        RUN_LABEL: run,
    }
    if role is not None:
        labels["app.kubernetes.io/component"] = role
        labels[ROLE_LABEL] = role
    return labels


def selector_labels(run: str, role: str) -> dict[str, str]:
    return {RUN_LABEL: run, ROLE_LABEL: role}


def rollout_selector(run: str) -> str:
    """The run's rollout pods as a label selector string (`status.rollout.selector`, the scale subresource's)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(run, "rollout").items())


def child_metadata(run: RunRef, name: str, role: str | None = None) -> dict[str, Any]:
    """The metadata of a child object: its name, the run's namespace and labels, the run's ownerReference."""
    return {"name": name, "namespace": run.namespace, "labels": run_labels(run.name, role),
            "ownerReferences": [run.owner_reference()]}


# ---------------------------------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------------------------------
def output_uri(run: str, volume: Mapping[str, Any]) -> str:
    """Where users find a run's model on spec.output.volume: `pvc://CLAIM/RUN`, `file:///PATH/RUN` for a host path,
    `nfs://SERVER/PATH/RUN`, else `KIND:///RUN` (the folder inside whatever the volume source is)."""
    if claim := (volume.get("persistentVolumeClaim") or {}).get("claimName"):
        return f"pvc://{claim}/{run}"
    if path := (volume.get("hostPath") or {}).get("path"):
        return f"file://{path.rstrip('/')}/{run}"
    nfs = volume.get("nfs") or {}
    if nfs.get("server") and nfs.get("path"):
        folder = "/".join(part for part in (nfs["path"].strip("/"), run) if part)
        return f"nfs://{nfs['server']}/{folder}"
    kind = next(iter(volume), "volume")
    return f"{kind}:///{run}"


def model_directory(run: str, output: OutputSpec) -> str:
    """The folder learner rank 0 exports the model to: on spec.output.volume, else in the pod's own `output`
    emptyDir, from where it is uploaded to spec.output.uri."""
    return f"{MODEL_OUTPUT_DIR if output.volume is not None else OUTPUT_DIR}/{run}"


def object_store_env(store: StoreSpec | None) -> list[dict[str, Any]]:
    """The variables boto3 reads for an object store (spec.output.uri, spec.checkpoint.uri), on the pod that reaches
    it: the credentials Secret's keys (its session token optional), the endpoint, the region."""
    if store is None or store.uri is None:
        return []
    env: list[dict[str, Any]] = []
    if store.credentials_secret is not None:
        secret = store.credentials_secret
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
                for key in (ACCESS_KEY_ENV, SECRET_KEY_ENV)]
        env.append({"name": SESSION_TOKEN_ENV,
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": SESSION_TOKEN_ENV, "optional": True}}})
    if store.endpoint is not None:
        env.append({"name": ENDPOINT_ENV[0], "value": store.endpoint})
    if store.region is not None:
        env.append({"name": REGION_ENV[0], "value": store.region})
    return env


def learner_store_env(spec: GRPORunSpec, rank: int) -> list[dict[str, Any]]:
    """The object store's variables on a learner pod: every rank's with spec.checkpoint.uri (each pod's checkpoint
    folder is its own, so each downloads the checkpoint it resumes from), else rank 0's alone, which exports the
    model. The two stores are reached the same way (GRPORunSpec's rule), so one set serves both."""
    if spec.checkpoint.uri is not None:
        # A preempted learner waits for its checkpoint's upload as long as its grace period allows.
        grace = {"name": TERMINATION_GRACE_ENV, "value": str(_termination_grace_seconds(spec.learner, "learner"))}
        return [*object_store_env(spec.checkpoint), grace]
    return object_store_env(spec.output) if rank == 0 else []


def build_config_map(run: RunRef, spec: GRPORunSpec) -> dict[str, Any]:
    """The resolved run config, annotated with the spec generation it was rendered from: a spec edited while the
    run was suspended is rendered again on resume; an operator upgrade alone never changes a live run's config."""
    output = None
    if spec.output is not None:
        output = (model_directory(run.name, spec.output),
                  spec.output.uri or output_uri(run.name, spec.output.volume or {}))
    config = resolve_run_config(run.name, run.namespace, spec, RunPlacement(
        rollout_urls=rollout_urls(run.name, run.namespace, spec.rollout.replicas),
        output_dir=OUTPUT_DIR,
        checkpoint_dir=CHECKPOINT_DIR,
        weight_sync_dir=WEIGHT_SYNC_DIR if spec.rollout.weight_sync.mode == "filesystem" else None,
        termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH,
        output=output,
        inputs_cache_dir=INPUTS_CACHE_DIR,
        environment_urls=environment_urls(run.name, run.namespace, spec.environments),
    ))
    metadata = child_metadata(run, config_map_name(run.name))
    metadata["annotations"] = {GENERATION_ANNOTATION: str(run.generation)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
            "data": {CONFIG_FILE: config.model_dump_json(by_alias=True)}}


#: The pods' terminationGracePeriodSeconds unless `podTemplateOverride.spec` sets it. A rollout server only stops:
#: Kubernetes' default. A learner checkpoints on SIGTERM: it finishes its micro-batch (20 s for the tiny model on a
#: loaded 2-core node), writes model and optimizer state, then TRL stops its rollout worker (up to 20 s); in 30 s it
#: was killed mid-way and its restart counted against the backoff limit.
ROLLOUT_TERMINATION_GRACE_S = 30
LEARNER_TERMINATION_GRACE_S = 120


_TERMINATION_GRACE_S = {"rollout": ROLLOUT_TERMINATION_GRACE_S, "learner": LEARNER_TERMINATION_GRACE_S}


def _termination_grace_seconds(settings: RolePodSpec, role: str) -> int:
    """A role's pods' termination grace period: the override's, else the role's default."""
    override = settings.pod_template_override
    chosen = override.spec.termination_grace_period_seconds if override and override.spec else None
    return _TERMINATION_GRACE_S[role] if chosen is None else chosen


def drain_deadline_seconds(spec: GRPORunSpec) -> int:
    """How long a removed rollout server may stay in the learner's report before its pod is deleted anyway: the
    requests in flight on it may take the request timeout (`training.extraArgs.request_timeout`, TRL's default
    otherwise), plus the pod's termination grace period."""
    grace = _termination_grace_seconds(spec.rollout, "rollout")
    return int(request_timeout_seconds(spec.training.extra_args)) + grace


def _headless_service(run: RunRef, name: str, role: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": child_metadata(run, name, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(run.name, role),
            "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def build_rollout_service(run: RunRef) -> dict[str, Any]:
    return _headless_service(run, rollout_service_name(run.name), "rollout", ROLLOUT_HTTP_PORT)


def build_learner_service(run: RunRef) -> dict[str, Any]:
    service = _headless_service(run, learner_service_name(run.name), "learner", LEARNER_HTTP_PORT)
    service["spec"]["ports"].append(
        {"name": "rendezvous", "port": MAIN_PROCESS_PORT, "targetPort": MAIN_PROCESS_PORT, "protocol": "TCP"})
    return service


def _container_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _volumes(run: str, spec: GRPORunSpec, *, exports_model: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and mounts; `exports_model`: learner rank 0's pod, which alone writes the trained model, so
    the other pods need not reach spec.output's volume (a ReadWriteOnce claim)."""
    # vLLM and torch.distributed need a /dev/shm larger than the container runtime's 64 MiB default.
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(run)}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "cache", "emptyDir": {}},
        # Shared by the run's pods when spec.modelCache sets it: a restarted or added pod finds its model there.
        {"name": "model-cache", **(spec.model_cache.volume if spec.model_cache is not None else {"emptyDir": {}})},
        {"name": "output", "emptyDir": {}},
        # Without a volume, checkpoints live as long as the pod: a restart then starts over instead of resuming.
        {"name": "checkpoints", **(spec.checkpoint.volume or {"emptyDir": {}})},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
        {"name": "output", "mountPath": OUTPUT_DIR},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
    ]
    if spec.rollout.weight_sync.mode == "filesystem":
        volumes.append({"name": "weights", **(spec.rollout.weight_sync.volume or {"emptyDir": {}})})
        mounts.append({"name": "weights", "mountPath": WEIGHT_SYNC_DIR})
    if spec.inputs is not None and spec.inputs.volume is not None:
        volumes.append({"name": "inputs", **spec.inputs.volume})
        mounts.append({"name": "inputs", "mountPath": INPUTS_DIR, "readOnly": True})
    if exports_model and spec.output is not None and spec.output.volume is not None:
        volumes.append({"name": MODEL_OUTPUT_VOLUME, **spec.output.volume})
        mounts.append({"name": MODEL_OUTPUT_VOLUME, "mountPath": MODEL_OUTPUT_DIR})
    return volumes, mounts


def _env(run: RunRef, role: str) -> list[dict[str, Any]]:
    return [
        {"name": "GRPO_RUN", "value": run.name},
        {"name": "GRPO_NAMESPACE", "value": run.namespace},
        {"name": "GRPO_ROLE", "value": role},
        {"name": "GRPO_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "GRPO_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # Hub caches must be writable by the non-root user; the image's HOME may not be.
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/huggingface"},
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def inputs_secret_env(inputs: InputsSpec | None) -> list[dict[str, Any]]:
    """The inputs' credentials on every learner and rollout pod: spec.inputs.credentialsSecret's keys under their
    GRPO_INPUTS_ names (learner rank 0 may hold spec.output's under the plain ones), the hub token as HF_TOKEN.
    Optional references: a missing Secret or key is the pod's one-line exit 78 naming the field
    (grpo_trainer.storage.inputs), not a pod that never starts."""
    if inputs is None:
        return []
    env: list[dict[str, Any]] = []
    if inputs.credentials_secret is not None:
        env += [{"name": f"{INPUT_CREDENTIALS_ENV_PREFIX}{key}",
                 "valueFrom": {"secretKeyRef": {"name": inputs.credentials_secret, "key": key, "optional": True}}}
                for key in (ACCESS_KEY_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV)]
    if inputs.hub_token_secret is not None:
        env.append({"name": HUB_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": inputs.hub_token_secret, "key": HUB_TOKEN_ENV, "optional": True}}})
    return env


def tracking_secret_env(tracking: TrackingConfig) -> list[dict[str, Any]]:
    """The trackers' credentials, from the Secrets `spec.tracking` names, as the env vars their clients read.

    Optional references: a missing Secret or key leaves the variable unset and the learner ends with a one-line
    config error naming the field (grpo_trainer.learner.tracking), instead of a pod that never starts.
    """
    env: list[dict[str, Any]] = []
    if tracking.mlflow is not None and tracking.mlflow.credentials_secret:
        secret = tracking.mlflow.credentials_secret
        env += [{"name": variable, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
                for key, variable in MLFLOW_CREDENTIAL_ENV.items()]
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        ref = tracking.wandb.api_key_secret
        env.append({"name": WANDB_API_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": True}}})
    return env


@dataclass(frozen=True)
class PodRole:
    """What one pod has of its own role; everything else a pod shares with the other role's pods (`_pod`)."""

    role: str  # rollout | learner: the container's name and the role label
    settings: RolePodSpec  # spec.rollout or spec.learner: image, resources, placement, override
    name: str
    command: list[str]
    ports: list[dict[str, Any]]
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    env: list[dict[str, Any]] = field(default_factory=list)  # after the shared variables
    annotations: dict[str, str] = field(default_factory=dict)  # after the attempt


_SERVICE_NAMES = {"rollout": rollout_service_name, "learner": learner_service_name}


def _pod(run: RunRef, spec: GRPORunSpec, role: PodRole, *, trainer_image: str, attempt: int) -> dict[str, Any]:
    """A pod of either role, its override (`podTemplateOverride`) applied last."""
    settings = role.settings
    volumes, mounts = _volumes(run.name, spec, exports_model=role.name == learner_pod_name(run.name, 0))
    container: dict[str, Any] = {
        "name": role.role,
        "image": settings.image or trainer_image,
        "command": role.command,
        "ports": role.ports,
        "env": [*_env(run, role.role), *inputs_secret_env(spec.inputs), *role.env],
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "terminationMessagePath": DEFAULT_TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy
    if settings.resources:
        container["resources"] = settings.resources
    container.update(role.probes)
    metadata = child_metadata(run, role.name, role.role)
    metadata["annotations"] = {ATTEMPT_ANNOTATION: str(attempt), **role.annotations}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": _termination_grace_seconds(settings, role.role),
        "hostname": role.name,
        "subdomain": _SERVICE_NAMES[role.role](run.name),  # the headless Service that gives the pod its DNS name
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = list(settings.tolerations)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
    return apply_override(pod, settings.pod_template_override, f"spec.{role.role}.podTemplateOverride")


def rollout_command() -> list[str]:
    return ["python", "-m", "grpo_trainer", "rollout", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]


def learner_command(run: RunRef, spec: GRPORunSpec, rank: int) -> list[str]:
    leader = pod_dns(learner_pod_name(run.name, 0), learner_service_name(run.name), run.namespace)
    gang = GangLayout(num_machines=spec.learner.nodes, processes_per_machine=spec.learner.processes_per_node,
                      machine_rank=rank, main_process_ip=leader, main_process_port=MAIN_PROCESS_PORT)
    return learner_argv(f"{CONFIG_DIR}/{CONFIG_FILE}", gang=gang,
                        strategy=spec.learner.strategy, cpu_offload=spec.learner.fsdp.cpu_offload,
                        device=spec.learner.device)


#: Model download and load before the first /health: up to an hour (12 runs of the startup probe's wait) before the
#: kubelet gives up on a rollout server.
ROLLOUT_STARTUP_PERIOD_S, ROLLOUT_STARTUP_FAILURES = 10, 12
#: Every failed probe is a Warning event on the pod, and the kubelet passes 25 per pod, then one per 5 min: readiness
#: every 10 s (Kubernetes' default) leaves room for the liveness failures after a server froze.
ROLLOUT_READINESS_PERIOD_S = 10


def rollout_probes() -> dict[str, dict[str, Any]]:
    """Readiness by /health; liveness by a generated token (`python -m grpo_trainer probe`), since a hung server and
    one whose engine died both keep answering /health. Liveness starts once the startup probe saw /health answer
    (`probe --startup` waits for it up to STARTUP_WAIT_S in one run)."""
    health = {"httpGet": {"path": "/health", "port": ROLLOUT_HTTP_PORT}}
    probe_command = ["python", "-m", "grpo_trainer", "probe", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    return {
        "readinessProbe": {**health, "periodSeconds": ROLLOUT_READINESS_PERIOD_S, "failureThreshold": 3},
        "startupProbe": {"exec": {"command": [*probe_command, "--startup"]},
                         "periodSeconds": ROLLOUT_STARTUP_PERIOD_S, "timeoutSeconds": STARTUP_WAIT_S + 10,
                         "failureThreshold": ROLLOUT_STARTUP_FAILURES},
        "livenessProbe": {"exec": {"command": probe_command}, "periodSeconds": LIVENESS_PERIOD_S,
                          # the probe's own timeout plus the interpreter's start
                          "timeoutSeconds": int(PROBE_TIMEOUT_S) + 10,
                          "failureThreshold": LIVENESS_FAILURE_THRESHOLD},
    }


def build_rollout_pod(run: RunRef, spec: GRPORunSpec, index: int, *, trainer_image: str, attempt: int = 0,
                      restarts: int = 0) -> dict[str, Any]:
    """`restarts`: the server's restarts so far (status.rollout.servers), kept on the pod so its exit counts once."""
    ports = [{"name": "http", "containerPort": ROLLOUT_HTTP_PORT, "protocol": "TCP"}]
    role = PodRole("rollout", spec.rollout, rollout_pod_name(run.name, index), rollout_command(), ports,
                   probes=rollout_probes(), annotations={ROLLOUT_RESTARTS_ANNOTATION: str(restarts)})
    return _pod(run, spec, role, trainer_image=trainer_image, attempt=attempt)


def build_learner_pod(run: RunRef, spec: GRPORunSpec, rank: int, *, trainer_image: str,
                      attempt: int = 0) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": LEARNER_HTTP_PORT, "protocol": "TCP"}]
    if spec.learner_world_size > 1:
        ports.append({"name": "rendezvous", "containerPort": MAIN_PROCESS_PORT, "protocol": "TCP"})
    env = [{"name": "GRPO_LEARNER_RANK", "value": str(rank)}, *environment_url_env(run, spec),
           *tracking_secret_env(spec.tracking), *learner_store_env(spec, rank)]
    role = PodRole("learner", spec.learner, learner_pod_name(run.name, rank), learner_command(run, spec, rank), ports,
                   env=env)
    return _pod(run, spec, role, trainer_image=trainer_image, attempt=attempt)


def environment_url_env(run: RunRef, spec: GRPORunSpec) -> list[dict[str, Any]]:
    """Each environment's URL as GRPO_ENVIRONMENT_<NAME>_URL: what the learner's environment factory reads, with
    no code of ours (the run config has the same under `environments`)."""
    return [{"name": environment_url_variable(name), "value": url}
            for name, url in environment_urls(run.name, run.namespace, spec.environments).items()]


def environment_selector_labels(run: str, environment: str) -> dict[str, str]:
    return {**selector_labels(run, ENVIRONMENT_ROLE), ENVIRONMENT_LABEL: environment}


def build_environment_service(run: RunRef, environment: EnvironmentSpec) -> dict[str, Any]:
    """A headless Service without `publishNotReadyAddresses`: the factory gets one URL, whose name resolves to the
    servers that are ready, and the learner's client (grpo_trainer.agentic.servers) pins each episode to one of them
    (a server may hold the episode's state; a cluster IP would spread its calls over the servers)."""
    metadata = child_metadata(run, environment_service_name(run.name, environment.name), ENVIRONMENT_ROLE)
    metadata["labels"][ENVIRONMENT_LABEL] = environment.name
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": {
        "clusterIP": "None",
        "selector": environment_selector_labels(run.name, environment.name),
        "ports": [{"name": "http", "port": environment.port, "targetPort": environment.port, "protocol": "TCP"}],
    }}


#: The variable that holds an environment server's port on its pod (and under `grporun local`, where each server gets
#: a free loopback port): a server reads it, or its command or args name it as `$(PORT)`, to listen where its URL says.
ENVIRONMENT_PORT_ENV = "PORT"


#: The readiness probe of an environment server whose spec sets none: a TCP connect to its port, which any server
#: answers once it listens (an HTTP path would assume one the image may not serve).
ENVIRONMENT_READINESS_PERIOD_S = 10


def environment_readiness_probe(environment: EnvironmentSpec) -> dict[str, Any]:
    if environment.readiness_probe is not None:
        return dict(environment.readiness_probe)
    return {"tcpSocket": {"port": environment.port}, "periodSeconds": ENVIRONMENT_READINESS_PERIOD_S,
            "failureThreshold": 3}


def build_environment_pod(run: RunRef, environment: EnvironmentSpec, index: int, *, where: str) -> dict[str, Any]:
    """One server of an environment. restartPolicy Always: a server holds none of the run's own state (its episodes
    in flight, which it may hold, fail as the environment's), so the kubelet restarts its container in place (with
    its backoff) and the run goes on; a pod that is gone or failed (evicted,
    its node lost) is created again by the operator. `where`: the environment's field path, for override errors."""
    name = environment_pod_name(run.name, environment.name, index)
    container: dict[str, Any] = {
        "name": ENVIRONMENT_ROLE,
        "image": environment.image,
        "ports": [{"name": "http", "containerPort": environment.port, "protocol": "TCP"}],
        # PORT last: the server listens on `port`, which its Service and URL name, whatever an entry of its own says.
        "env": [*(item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in environment.env or []),
                {"name": ENVIRONMENT_PORT_ENV, "value": str(environment.port)}],
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        "readinessProbe": environment_readiness_probe(environment),
        "securityContext": _container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if environment.command is not None:
        container["command"] = list(environment.command)
    if environment.args is not None:
        container["args"] = list(environment.args)
    if environment.resources:
        container["resources"] = environment.resources
    metadata = child_metadata(run, name, ENVIRONMENT_ROLE)
    metadata["labels"][ENVIRONMENT_LABEL] = environment.name
    override = environment.pod_template_override
    chosen_grace = override.spec.termination_grace_period_seconds if override and override.spec else None
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": ROLLOUT_TERMINATION_GRACE_S if chosen_grace is None else chosen_grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
    return apply_override(pod, override, f"{where}.podTemplateOverride")


def build_environment_pods(run: RunRef, spec: GRPORunSpec) -> list[dict[str, Any]]:
    return [build_environment_pod(run, environment, index, where=f"spec.environments[{position}]")
            for position, environment in enumerate(spec.environments or [])
            for index in range(environment.replicas)]


def build_pods(run: RunRef, spec: GRPORunSpec, *, trainer_image: str, attempt: int = 0,
               rollout_restarts: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    restarts = rollout_restarts or {}
    pods = [build_rollout_pod(run, spec, i, trainer_image=trainer_image, attempt=attempt,
                              restarts=restarts.get(i, 0))
            for i in range(spec.rollout.replicas)]
    pods += [build_learner_pod(run, spec, r, trainer_image=trainer_image, attempt=attempt)
             for r in range(spec.learner.nodes)]
    return [podgroup.join(pod, run.name, _gang(spec)) for pod in pods]


def _gang(spec: GRPORunSpec) -> podgroup.GangSpec | None:
    return spec.scheduling.gang if spec.scheduling is not None else None


def build_pod_group(run: RunRef, spec: GRPORunSpec) -> dict[str, Any] | None:
    """The gang scheduler's PodGroup for every pod of the run (spec.scheduling.gang), or None."""
    gang_spec = _gang(spec)
    if gang_spec is None:
        return None
    metadata = child_metadata(run, podgroup.pod_group_name(run.name))
    return podgroup.build_pod_group(metadata, gang_spec, min_member=spec.rollout.replicas + spec.learner.nodes)


def build_children(run: RunRef, spec: GRPORunSpec, *, trainer_image: str, attempt: int = 0,
                   rollout_restarts: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    """Everything a run needs, in creation order (the ConfigMap first: pods mount it; the PodGroup before its pods)."""
    pod_group = build_pod_group(run, spec)
    return [
        build_config_map(run, spec),
        build_rollout_service(run),
        build_learner_service(run),
        *(build_environment_service(run, environment) for environment in spec.environments or []),
        *([pod_group] if pod_group else []),
        *build_pods(run, spec, trainer_image=trainer_image, attempt=attempt, rollout_restarts=rollout_restarts),
        # Not in the gang: environment servers hold no accelerator the gang waits for, and start on their own.
        *build_environment_pods(run, spec),
    ]
