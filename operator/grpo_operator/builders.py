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
from collections.abc import Mapping
from typing import Any

from grpo_trainer.contract import DEFAULT_TERMINATION_MESSAGE_PATH, LEARNER_HTTP_PORT, ROLLOUT_HTTP_PORT
from grpo_trainer.launch import MAIN_PROCESS_PORT, learner_argv
from grpo_trainer.rollout_health import LIVENESS_FAILURE_THRESHOLD, LIVENESS_PERIOD_S, PROBE_TIMEOUT_S

from . import podgroup
from .api import (
    API_VERSION,
    ATTEMPT_ANNOTATION,
    GENERATION_ANNOTATION,
    KIND,
    MANAGED_BY,
    ROLE_LABEL,
    ROLLOUT_RESTARTS_ANNOTATION,
    RUN_LABEL,
    GRPORunSpec,
)
from .pod_overrides import apply_override
from .resolve import resolve_run_config

#: The image of rollout and learner pods whose spec names none; the operator's --trainer-image overrides it.
DEFAULT_TRAINER_IMAGE = "grpo-trainer:cuda"
TRAINER_IMAGE_ENV = "GRPO_TRAINER_IMAGE"

CONFIG_DIR = "/etc/grpo"
CONFIG_FILE = "run.json"
CHECKPOINT_DIR = "/var/lib/grpo/checkpoints"
OUTPUT_DIR = "/var/lib/grpo/output"
WEIGHT_SYNC_DIR = "/var/lib/grpo/weights"
CACHE_DIR = "/var/cache/grpo"
#: Any non-root uid works; fixed so files on a shared checkpoint volume stay writable across restarts.
RUN_AS_USER = 1000


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


def owner_reference(run: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": run, "uid": uid, "controller": True,
            "blockOwnerDeletion": True}


def _metadata(name: str, run: str, namespace: str, uid: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": run_labels(run, role),
            "ownerReferences": [owner_reference(run, uid)]}


# ---------------------------------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------------------------------
def build_config_map(run: str, namespace: str, uid: str, spec: GRPORunSpec, generation: int = 1) -> dict[str, Any]:
    """The resolved run config, annotated with the spec generation it was rendered from: a spec edited while the
    run was suspended is rendered again on resume; an operator upgrade alone never changes a live run's config."""
    config = resolve_run_config(
        run, namespace, spec,
        rollout_urls=rollout_urls(run, namespace, spec.rollout.replicas),
        output_dir=OUTPUT_DIR,
        checkpoint_dir=CHECKPOINT_DIR,
        weight_sync_dir=WEIGHT_SYNC_DIR if spec.rollout.weight_sync.mode == "filesystem" else None,
        termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH,
    )
    metadata = _metadata(config_map_name(run), run, namespace, uid)
    metadata["annotations"] = {GENERATION_ANNOTATION: str(generation)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
            "data": {CONFIG_FILE: config.model_dump_json(by_alias=True)}}


def _headless_service(name: str, run: str, namespace: str, uid: str, role: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(name, run, namespace, uid, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(run, role),
            "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def build_rollout_service(run: str, namespace: str, uid: str) -> dict[str, Any]:
    return _headless_service(rollout_service_name(run), run, namespace, uid, "rollout", ROLLOUT_HTTP_PORT)


def build_learner_service(run: str, namespace: str, uid: str) -> dict[str, Any]:
    service = _headless_service(learner_service_name(run), run, namespace, uid, "learner", LEARNER_HTTP_PORT)
    service["spec"]["ports"].append(
        {"name": "rendezvous", "port": MAIN_PROCESS_PORT, "targetPort": MAIN_PROCESS_PORT, "protocol": "TCP"})
    return service


def _container_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _volumes(run: str, spec: GRPORunSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # vLLM and torch.distributed need a /dev/shm larger than the container runtime's 64 MiB default.
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(run)}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "cache", "emptyDir": {}},
        {"name": "output", "emptyDir": {}},
        # Without a volume, checkpoints live as long as the pod: a restart then starts over instead of resuming.
        {"name": "checkpoints", **(spec.checkpoint.volume or {"emptyDir": {}})},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "output", "mountPath": OUTPUT_DIR},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
    ]
    if spec.rollout.weight_sync.mode == "filesystem":
        volumes.append({"name": "weights", **(spec.rollout.weight_sync.volume or {"emptyDir": {}})})
        mounts.append({"name": "weights", "mountPath": WEIGHT_SYNC_DIR})
    return volumes, mounts


def _env(run: str, namespace: str, role: str) -> list[dict[str, Any]]:
    return [
        {"name": "GRPO_RUN", "value": run},
        {"name": "GRPO_NAMESPACE", "value": namespace},
        {"name": "GRPO_ROLE", "value": role},
        {"name": "GRPO_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "GRPO_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # Hub caches must be writable by the non-root user; the image's HOME may not be.
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _pod(name: str, run: str, namespace: str, uid: str, role: str, spec: GRPORunSpec, *, image: str,
         pull_policy: str | None, command: list[str], ports: list[dict[str, Any]], resources: dict[str, Any] | None,
         node_selector: dict[str, str] | None, tolerations: list[dict[str, Any]] | None, service: str,
         attempt: int, probes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    volumes, mounts = _volumes(run, spec)
    container: dict[str, Any] = {
        "name": role,
        "image": image,
        "command": command,
        "ports": ports,
        "env": _env(run, namespace, role),
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "terminationMessagePath": DEFAULT_TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    if resources:
        container["resources"] = resources
    container.update(probes or {})
    metadata = _metadata(name, run, namespace, uid, role)
    metadata["annotations"] = {ATTEMPT_ANNOTATION: str(attempt)}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostname": name,
        "subdomain": service,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = list(tolerations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def rollout_command() -> list[str]:
    return ["python", "-m", "grpo_trainer", "rollout", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]


def learner_command(run: str, namespace: str, spec: GRPORunSpec, rank: int) -> list[str]:
    leader = pod_dns(learner_pod_name(run, 0), learner_service_name(run), namespace)
    return learner_argv(f"{CONFIG_DIR}/{CONFIG_FILE}", num_machines=spec.learner.nodes,
                        processes_per_machine=spec.learner.processes_per_node, machine_rank=rank,
                        main_process_ip=leader, main_process_port=MAIN_PROCESS_PORT)


#: Model download and load before the first /health: up to an hour before the kubelet gives up on a rollout server.
ROLLOUT_STARTUP_PERIOD_S, ROLLOUT_STARTUP_FAILURES = 10, 360


def rollout_probes() -> dict[str, dict[str, Any]]:
    """Readiness by /health; liveness by a generated token (`python -m grpo_trainer probe`), since a hung server and
    one whose engine died both keep answering /health. Liveness starts once /health first answers (startupProbe)."""
    health = {"httpGet": {"path": "/health", "port": ROLLOUT_HTTP_PORT}}
    probe_command = ["python", "-m", "grpo_trainer", "probe", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    return {
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "startupProbe": {**health, "periodSeconds": ROLLOUT_STARTUP_PERIOD_S,
                         "failureThreshold": ROLLOUT_STARTUP_FAILURES},
        "livenessProbe": {"exec": {"command": probe_command}, "periodSeconds": LIVENESS_PERIOD_S,
                          # the probe's own timeout plus the interpreter's start
                          "timeoutSeconds": int(PROBE_TIMEOUT_S) + 10,
                          "failureThreshold": LIVENESS_FAILURE_THRESHOLD},
    }


def build_rollout_pod(run: str, namespace: str, uid: str, spec: GRPORunSpec, index: int, *, trainer_image: str,
                      attempt: int = 0, restarts: int = 0) -> dict[str, Any]:
    """`restarts`: the server's restarts so far (status.rollout.servers), kept on the pod so its exit counts once."""
    rollout = spec.rollout
    pod = _pod(rollout_pod_name(run, index), run, namespace, uid, "rollout", spec,
               image=rollout.image or trainer_image, pull_policy=rollout.image_pull_policy,
               command=rollout_command(),
               ports=[{"name": "http", "containerPort": ROLLOUT_HTTP_PORT, "protocol": "TCP"}],
               resources=rollout.resources, node_selector=rollout.node_selector, tolerations=rollout.tolerations,
               service=rollout_service_name(run), attempt=attempt, probes=rollout_probes())
    pod["metadata"]["annotations"][ROLLOUT_RESTARTS_ANNOTATION] = str(restarts)
    return apply_override(pod, rollout.pod_template_override, "spec.rollout.podTemplateOverride")


def build_learner_pod(run: str, namespace: str, uid: str, spec: GRPORunSpec, rank: int, *, trainer_image: str,
                      attempt: int = 0) -> dict[str, Any]:
    learner = spec.learner
    ports = [{"name": "http", "containerPort": LEARNER_HTTP_PORT, "protocol": "TCP"}]
    if spec.learner_world_size > 1:
        ports.append({"name": "rendezvous", "containerPort": MAIN_PROCESS_PORT, "protocol": "TCP"})
    pod = _pod(learner_pod_name(run, rank), run, namespace, uid, "learner", spec,
               image=learner.image or trainer_image, pull_policy=learner.image_pull_policy,
               command=learner_command(run, namespace, spec, rank), ports=ports, resources=learner.resources,
               node_selector=learner.node_selector, tolerations=learner.tolerations,
               service=learner_service_name(run), attempt=attempt)
    pod["spec"]["containers"][0]["env"].append({"name": "GRPO_LEARNER_RANK", "value": str(rank)})
    return apply_override(pod, learner.pod_template_override, "spec.learner.podTemplateOverride")


def build_pods(run: str, namespace: str, uid: str, spec: GRPORunSpec, *, trainer_image: str,
               attempt: int = 0, rollout_restarts: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    restarts = rollout_restarts or {}
    pods = [build_rollout_pod(run, namespace, uid, spec, i, trainer_image=trainer_image, attempt=attempt,
                              restarts=restarts.get(i, 0))
            for i in range(spec.rollout.replicas)]
    pods += [build_learner_pod(run, namespace, uid, spec, r, trainer_image=trainer_image, attempt=attempt)
             for r in range(spec.learner.nodes)]
    return [podgroup.join(pod, run, _gang(spec)) for pod in pods]


def _gang(spec: GRPORunSpec) -> podgroup.GangSpec | None:
    return spec.scheduling.gang if spec.scheduling is not None else None


def build_pod_group(run: str, namespace: str, uid: str, spec: GRPORunSpec) -> dict[str, Any] | None:
    """The gang scheduler's PodGroup for every pod of the run (spec.scheduling.gang), or None."""
    gang_spec = _gang(spec)
    if gang_spec is None:
        return None
    metadata = _metadata(podgroup.pod_group_name(run), run, namespace, uid)
    return podgroup.build_pod_group(run, namespace, metadata, gang_spec,
                                    min_member=spec.rollout.replicas + spec.learner.nodes)


def build_children(run: str, namespace: str, uid: str, spec: GRPORunSpec, *, trainer_image: str,
                   attempt: int = 0, generation: int = 1,
                   rollout_restarts: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
    """Everything a run needs, in creation order (the ConfigMap first: pods mount it; the PodGroup before its pods)."""
    pod_group = build_pod_group(run, namespace, uid, spec)
    return [
        build_config_map(run, namespace, uid, spec, generation),
        build_rollout_service(run, namespace, uid),
        build_learner_service(run, namespace, uid),
        *([pod_group] if pod_group else []),
        *build_pods(run, namespace, uid, spec, trainer_image=trainer_image, attempt=attempt,
                    rollout_restarts=rollout_restarts),
    ]
