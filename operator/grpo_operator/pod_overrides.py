"""Per-role pod overrides (`spec.rollout.podTemplateOverride`, `spec.learner.podTemplateOverride`): what a platform
team sets on the pods of one role, in the shape of Kubeflow Trainer v2's `podTemplateOverrides`.

The override is applied to the pod the builders made (`apply_override`, pure): it adds to the pod, it never takes the
operator's contract away. The managed parts — the operator's env vars, the config and work volumes and their mount
paths, the ports, the command, the restart policy, names, owner references and the operator's labels — are refused by
the CRD's CEL rules (and so by `grporun validate`); `apply_override` refuses them again (`OverrideError`), so a run
admitted by an API server without those rules still cannot break the contract. The hardened security context stays:
the only addition allowed is the capabilities RDMA needs (`IPC_LOCK`, `SYS_RESOURCE`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from grpo_trainer.contract.wire import WireModel

#: Label and annotation keys under this prefix belong to the operator (it selects its pods by them).
RESERVED_KEY_PREFIX = "grpo.dev/"
#: Capabilities an override may add back (RDMA's memory registration needs IPC_LOCK, a raised memlock SYS_RESOURCE).
ALLOWED_CAPABILITIES = ("IPC_LOCK", "SYS_RESOURCE")


class OverrideError(ValueError):
    """An override that would break the operator's contract; the message names the field."""


MANAGED = "is managed by the operator and cannot be overridden"


def _refuse(value: Any) -> Any:
    """Fields declared only so that setting them is an error naming the field, not a silently pruned value."""
    if value is not None:
        raise ValueError(MANAGED)
    return value


class LocalObjectReference(WireModel):
    name: str = Field(min_length=1)


class EnvVar(WireModel):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = None  # core/v1 EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef, ...


class EnvSourceRef(WireModel):
    name: str = Field(min_length=1)
    optional: bool | None = None


class EnvFromSource(WireModel):
    prefix: str | None = None
    config_map_ref: EnvSourceRef | None = None
    secret_ref: EnvSourceRef | None = None


class VolumeMount(WireModel):
    name: str = Field(min_length=1)
    mount_path: str = Field(min_length=1)
    read_only: bool | None = None
    sub_path: str | None = None


class Capabilities(WireModel):
    add: list[Literal["IPC_LOCK", "SYS_RESOURCE"]] | None = None


class ContainerSecurityContext(WireModel):
    capabilities: Capabilities | None = None


class ContainerOverride(WireModel):
    name: str  # the role's container: `rollout` or `learner`
    env: list[EnvVar] | None = None
    env_from: list[EnvFromSource] | None = None
    volume_mounts: list[VolumeMount] | None = None
    security_context: ContainerSecurityContext | None = None
    command: list[str] | None = None
    args: list[str] | None = None
    ports: list[dict[str, Any]] | None = None

    _managed = field_validator("command", "args", "ports")(_refuse)


class PodMetadataOverride(WireModel):
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    name: str | None = None
    namespace: str | None = None
    owner_references: list[dict[str, Any]] | None = None

    _managed = field_validator("name", "namespace", "owner_references")(_refuse)


class PodSpecOverride(WireModel):
    service_account_name: str | None = None
    automount_service_account_token: bool | None = None
    image_pull_secrets: list[LocalObjectReference] | None = None
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: list[dict[str, Any]] | None = None
    priority_class_name: str | None = None
    scheduler_name: str | None = None
    runtime_class_name: str | None = None
    volumes: list[dict[str, Any]] | None = None  # core/v1 Volume, each with its own name
    containers: list[ContainerOverride] | None = None
    shm_size: str | None = None  # the sizeLimit of the in-memory /dev/shm volume
    termination_grace_period_seconds: int | None = Field(None, ge=0)
    restart_policy: str | None = None

    _managed = field_validator("restart_policy")(_refuse)


class PodTemplateOverride(WireModel):
    metadata: PodMetadataOverride | None = None
    spec: PodSpecOverride | None = None


# ---------------------------------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------------------------------
def _check_keys(kind: str, keys: Mapping[str, str], managed: Mapping[str, str], where: str) -> None:
    for key in keys:
        if key.startswith(RESERVED_KEY_PREFIX) or key in managed:
            raise OverrideError(f"{where}.metadata.{kind}.{key}: is managed by the operator")


def apply_override(pod: dict[str, Any], override: PodTemplateOverride | None, where: str) -> dict[str, Any]:
    """The pod with the role's override applied (a new dict); `where` is the override's field path for errors."""
    if override is None:
        return pod
    pod = copy.deepcopy(pod)
    _apply_metadata(pod["metadata"], override.metadata or PodMetadataOverride(), where)
    _apply_spec(pod["spec"], override.spec or PodSpecOverride(), where)
    return pod


def _apply_metadata(metadata: dict[str, Any], override: PodMetadataOverride, where: str) -> None:
    for kind in ("labels", "annotations"):
        extra = getattr(override, kind) or {}
        _check_keys(kind, extra, metadata.get(kind, {}), where)
        if extra:
            metadata[kind] = {**extra, **metadata.get(kind, {})}


def _apply_spec(spec: dict[str, Any], override: PodSpecOverride, where: str) -> None:
    if override.image_pull_secrets:
        spec["imagePullSecrets"] = [ref.to_wire() for ref in override.image_pull_secrets]
    for field, value in (("serviceAccountName", override.service_account_name),
                         ("automountServiceAccountToken", override.automount_service_account_token),
                         ("affinity", override.affinity),
                         ("topologySpreadConstraints", override.topology_spread_constraints),
                         ("priorityClassName", override.priority_class_name),
                         ("schedulerName", override.scheduler_name),
                         ("runtimeClassName", override.runtime_class_name),
                         ("terminationGracePeriodSeconds", override.termination_grace_period_seconds)):
        if value is not None:
            spec[field] = copy.deepcopy(value)
    managed_volumes = {volume["name"] for volume in spec["volumes"]}
    for index, volume in enumerate(override.volumes or []):
        if volume.get("name") in managed_volumes:
            raise OverrideError(f"{where}.spec.volumes[{index}].name: {volume.get('name')!r} is managed by the "
                                "operator")
        spec["volumes"].append(copy.deepcopy(volume))
    if override.shm_size is not None:
        shm = next(volume for volume in spec["volumes"] if volume["name"] == "shm")
        shm["emptyDir"]["sizeLimit"] = override.shm_size
    for index, container_override in enumerate(override.containers or []):
        container = next((c for c in spec["containers"] if c["name"] == container_override.name), None)
        if container is None:
            raise OverrideError(f"{where}.spec.containers[{index}].name: must be "
                                f"{' or '.join(repr(c['name']) for c in spec['containers'])}")
        _apply_container(container, container_override, f"{where}.spec.containers[{index}]")


def _wire(model: WireModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def _apply_container(container: dict[str, Any], override: ContainerOverride, where: str) -> None:
    managed_env = {item["name"] for item in container.get("env", [])}
    for index, item in enumerate(override.env or []):
        if item.name in managed_env:
            raise OverrideError(f"{where}.env[{index}].name: {item.name} is managed by the operator")
        container["env"].append(_wire(item))
    if override.env_from:
        container["envFrom"] = [_wire(source) for source in override.env_from]
    managed_paths = [mount["mountPath"] for mount in container.get("volumeMounts", [])]
    for index, mount in enumerate(override.volume_mounts or []):
        path = mount.mount_path.rstrip("/")
        if any(path == managed or path.startswith(managed + "/") for managed in managed_paths):
            raise OverrideError(f"{where}.volumeMounts[{index}].mountPath: {mount.mount_path} is managed by the "
                                "operator")
        container["volumeMounts"].append(_wire(mount))
    capabilities = override.security_context.capabilities if override.security_context else None
    if capabilities is not None and capabilities.add:
        container["securityContext"]["capabilities"]["add"] = list(capabilities.add)


# ---------------------------------------------------------------------------------------------------------------------
# `grporun local`: what of an override's environment a local process can get
# ---------------------------------------------------------------------------------------------------------------------
def local_env_notes(role: str, override: PodTemplateOverride | None, environ: Mapping[str, str]) -> list[str]:
    """One line per env/envFrom entry a local process cannot take from the cluster.

    Literal `value`s reach the process with the pod's other env vars. A `valueFrom` (Secret, ConfigMap, field) is
    resolved from a variable of the same name in the local environment, which the local processes inherit; where
    there is none, it is named here. An `envFrom` source's keys are unknown outside the cluster: it is named, with
    the advice to export its variables.
    """
    if override is None or override.spec is None:
        return []
    notes = []
    for container in override.spec.containers or []:
        for item in container.env or []:
            if item.value_from is not None:
                source = ", ".join(sorted(item.value_from))
                if item.name in environ:
                    notes.append(f"{role}: {item.name} ({source}) taken from the local environment")
                else:
                    notes.append(f"{role}: {item.name} ({source}) cannot be resolved locally: "
                                 f"export {item.name} to pass it")
        for source in container.env_from or []:
            ref = source.secret_ref or source.config_map_ref
            kind = "Secret" if source.secret_ref else "ConfigMap"
            if ref is not None:
                notes.append(f"{role}: envFrom {kind} {ref.name} cannot be read locally: export its variables "
                             "to pass them")
    return notes
