"""The GRPORun API in one place: its names (group, version, kind, labels, annotations), its phases, conditions and
reasons, and typed models of its spec and status (`crds/grporun.yaml` is the wire schema; these mirror it).

Every other module imports these names; a version bump touches this file and the CRD.

The spec reuses the contract's models wherever the manifest and the resolved run config have the same shape
(dataset, rewards, training, filter, rollout defaults), so a field and its default are spelled once; the
Kubernetes-only parts (images, resources, volumes, run policy) live here. The CRD's defaults are checked against
these models by `tests/operator/test_api.py`, so the two cannot drift apart.

Cross-field rules (maxModelLen vs maxCompletionLength, weight-sync mode vs device, ...) are the CRD's CEL rules;
`grpo_operator.manifest.validate_manifest` evaluates them outside a cluster. `parse_spec` checks types, ranges and
the contract's own exactly-one rules, which is what the operator needs once the API server has admitted a run.
"""

from __future__ import annotations

import copy
import re
import urllib.parse
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from grpo_trainer.contract.config import (
    DEFAULT_ENVIRONMENT_PROTOCOL,
    DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS,
    MAX_ENVIRONMENT_UNAVAILABLE_SECONDS,
    AttentionSetting,
    DatasetConfig,
    EnvironmentProtocol,
    FilterConfig,
    FsdpConfig,
    LearnerConfig,
    LearnerStrategy,
    ProgressConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
    TrainingConfig,
    UnknownRewardName,
    WeightSyncConfig,
    check_openenv_environments,
    check_reward_name,
)
from grpo_trainer.contract.store_uri import InvalidObjectStoreURI, is_object_store_uri, parse_uri
from grpo_trainer.contract.wire import WireModel, field_path, first_error

from .pod_overrides import EnvVar, PodTemplateOverride
from .podgroup import SchedulingSpec

# --------------------------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------------------------
GROUP = "grpo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GRPORun"
PLURAL = "grporuns"
FINALIZER = f"{GROUP}/finalizer"
#: Prefix of the annotations kopf writes onto a GRPORun (its progress and last handled configuration).
KOPF_ANNOTATION_PREFIX = GROUP
RUN_LABEL = f"{GROUP}/run"
ROLE_LABEL = f"{GROUP}/role"
#: On an environment server's pod and its Service's selector: the environment's name (spec.environments[].name).
ENVIRONMENT_LABEL = f"{GROUP}/environment"
ATTEMPT_ANNOTATION = f"{GROUP}/attempt"
#: On a rollout pod: its server's restart count when the pod was created (a crash is counted once).
ROLLOUT_RESTARTS_ANNOTATION = f"{GROUP}/rollout-restarts"
#: On the run's ConfigMap: the spec generation its config was rendered from.
GENERATION_ANNOTATION = f"{GROUP}/generation"
MANAGED_BY = "grpo-operator"
#: `spec.managedBy` of the runs this operator reconciles (the CRD's default). A run naming another controller (Kueue's
#: MultiKueue dispatcher, `kueue.x-k8s.io/multikueue`) is left alone, as the Job controller leaves such a Job.
CONTROLLER_NAME = f"{GROUP}/{MANAGED_BY}"
#: The most rollout servers one run may have (spec.rollout.replicas' maximum, status.rollout.servers' maxItems).
MAX_ROLLOUT_REPLICAS = 1024
#: The most environments one run may have, and the most servers one environment may have (the CRD's maxItems and
#: maximum; status.environments has one entry per environment).
MAX_ENVIRONMENTS = 16
MAX_ENVIRONMENT_REPLICAS = 256
#: An environment's name: a DNS-1035 label (its Service is `<run>-env-<name>`), at most this long.
ENVIRONMENT_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_ENVIRONMENT_NAME = 15

Device = Literal["cuda", "cpu"]
ImagePullPolicy = Literal["Always", "IfNotPresent", "Never"]
#: `spec.fitCheck`: what the fit check (grpo_operator.fit) does with a run past its GPU's or its pod's memory.
FitPolicy = Literal["refuse", "warn"]


class SpecError(ValueError):
    """A user mistake in a GRPORun spec: one line, naming the field (`spec.training.epochs: must be > 0`)."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message


# --------------------------------------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------------------------------------
class ProgressSpec(ProgressConfig):
    # 3600 s: pulling a multi-GB vLLM image and downloading a model routinely takes 10-30 minutes on a cold node.
    startup_deadline_seconds: int | None = Field(
        3600, ge=1, description="Fail the run if it has not trained a group this long after its pods were created."
    )
    # 30 s: progress rides on every pass (5 s) otherwise, 12 status writes per run per minute at steady state.
    status_interval_seconds: int = Field(30, ge=0, description="Write progress to status at most this often.")


_ROLLOUT_FIELDS = RolloutConfig.model_fields


class VllmSpec(WireModel):
    # The vLLM settings and their defaults are the resolved config's: one owner (grpo_trainer.contract).
    tensor_parallel_size: int = _ROLLOUT_FIELDS["tensor_parallel_size"]
    max_model_len: int = _ROLLOUT_FIELDS["max_model_len"]
    gpu_memory_utilization: float = _ROLLOUT_FIELDS["gpu_memory_utilization"]
    extra_args: list[str] = _ROLLOUT_FIELDS["extra_args"]


class WeightSyncSpec(WireModel):
    mode: Literal["nccl", "filesystem"] = "nccl"
    deadline_seconds: int = WeightSyncConfig.model_fields["deadline_seconds"]
    # A Kubernetes volume source (e.g. {"persistentVolumeClaim": {"claimName": "x"}}) both roles mount for
    # filesystem mode; left free-form because the CRD keeps it as x-kubernetes-preserve-unknown-fields.
    volume: dict[str, Any] | None = None


class TopologySpec(WireModel):
    """Kueue topology-aware scheduling of one role's pods: the node label of the topology level they share."""

    required: str | None = Field(None, min_length=1, max_length=317)
    preferred: str | None = Field(None, min_length=1, max_length=317)

    @model_validator(mode="after")
    def _exactly_one(self) -> TopologySpec:
        if (self.required is None) == (self.preferred is None):
            raise ValueError("set exactly one of required or preferred")
        return self


class RolePodSpec(WireModel):
    """The pod fields the rollout and the learner role share: image, resources, device and placement."""

    image: str | None = None
    image_pull_policy: ImagePullPolicy | None = None
    resources: dict[str, Any] | None = None
    device: Device = "cuda"
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    pod_template_override: PodTemplateOverride | None = None
    topology: TopologySpec | None = None


def _check_store_uri(value: str, field: str) -> str:
    """An s3:// input must name a bucket (and a prefix or key) the way parse_uri reads it."""
    if is_object_store_uri(value):
        try:
            parse_uri(value, field)
        except InvalidObjectStoreURI as error:
            raise ValueError(error.reason) from None
    return value


class RolloutSpec(RolePodSpec):
    # Bounded by status.rollout.servers (one entry per server): a larger run could not report its servers.
    replicas: int = Field(1, ge=1, le=MAX_ROLLOUT_REPLICAS)
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)


class LearnerSpec(RolePodSpec):
    nodes: int = Field(1, ge=1)
    processes_per_node: int = Field(1, ge=1)
    attention: AttentionSetting = LearnerConfig.model_fields["attention"]
    strategy: LearnerStrategy = LearnerConfig.model_fields["strategy"]
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)


class EnvironmentSpec(WireModel):
    """An environment server the operator runs for the run: `replicas` pods from `image` behind one Service, whose
    URL the learner's environment factory gets (RunConfig.environments, GRPO_ENVIRONMENT_<NAME>_URL)."""

    name: str = Field(min_length=1, max_length=MAX_ENVIRONMENT_NAME)
    image: str = Field(min_length=1)
    replicas: int = Field(1, ge=0, le=MAX_ENVIRONMENT_REPLICAS)
    port: int = Field(8000, ge=1, le=65535)
    # How the learner plays it: `http`, through the user's environment factory; `openenv`, with OpenEnv's client
    # (grpo_trainer.contract.config.EnvironmentProtocol).
    protocol: EnvironmentProtocol = DEFAULT_ENVIRONMENT_PROTOCOL
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[EnvVar] | None = None
    resources: dict[str, Any] | None = None
    # A core/v1 Probe; free-form like the volume sources. Unset: a TCP connect to `port` (builders).
    readiness_probe: dict[str, Any] | None = None
    pod_template_override: PodTemplateOverride | None = None
    # How long the learner waits while no server is ready (after one was), before the run ends as stalled.
    unavailable_seconds: int = Field(DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS, ge=1,
                                     le=MAX_ENVIRONMENT_UNAVAILABLE_SECONDS)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not re.fullmatch(ENVIRONMENT_NAME_PATTERN, name):
            raise ValueError(f"{name!r} must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
                             "letter): the environment's Service is named after it")
        return name


def check_endpoint(endpoint: str | None) -> str | None:
    """An S3-compatible server's URL: http(s), a host, nothing after the path."""
    if endpoint is not None:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"{endpoint!r} is not an http(s) URL of an S3-compatible server")
    return endpoint


class StoreSpec(WireModel):
    """An `s3://bucket/prefix` and how the learner reaches it: spec.output's and spec.checkpoint's fields."""

    # `s3://bucket/prefix` of an S3 or S3-compatible object store.
    uri: str | None = Field(None, max_length=1024)
    # A Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN): the learner's credentials
    # for `uri`. Without one, boto3's own chain applies (a pod's web identity, an instance role).
    credentials_secret: str | None = Field(None, min_length=1, max_length=253)
    # An S3-compatible server's URL (MinIO, SeaweedFS, Ceph); AWS's own without it.
    endpoint: str | None = Field(None, max_length=1024)
    region: str | None = Field(None, min_length=1, max_length=64)

    @field_validator("uri")
    @classmethod
    def _object_store_uri(cls, uri: str | None) -> str | None:
        if uri is not None:
            try:
                parse_uri(uri, "uri")
            except InvalidObjectStoreURI as error:
                raise ValueError(error.reason) from None
        return uri

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, endpoint: str | None) -> str | None:
        return check_endpoint(endpoint)

    @model_validator(mode="after")
    def _access_needs_a_uri(self) -> StoreSpec:
        if self.uri is None:
            store_only = [name for name, value in (("credentialsSecret", self.credentials_secret),
                                                   ("endpoint", self.endpoint), ("region", self.region)) if value]
            if store_only:
                raise ValueError(f"{', '.join(store_only)}: only for an object store: set uri too")
        return self

    def access(self) -> tuple[str | None, str | None, str | None]:
        """As whom and where the store is reached: the credentials Secret, the endpoint, the region."""
        return self.credentials_secret, self.endpoint, self.region


class CheckpointSpec(StoreSpec):
    volume: dict[str, Any] | None = None
    save_steps: int = Field(100, ge=1)
    # With uri: checkpoints kept in the object store, the newest ones; older ones are deleted once a newer one is
    # complete there. Two or more, so that a torn newest checkpoint leaves one to fall back to.
    keep: int = Field(2, ge=2, le=100)


class OutputSpec(StoreSpec):
    # A Kubernetes volume source (e.g. {"persistentVolumeClaim": {"claimName": "models"}}) the learner's rank 0
    # mounts; the model goes to a folder named after the run in it. Free-form like checkpoint.volume.
    volume: dict[str, Any] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _somewhere(self) -> OutputSpec:
        if self.volume is None and self.uri is None:
            raise ValueError("set volume, uri or both: where the trained model goes")
        return self


class InputsSpec(WireModel):
    # A volume source (e.g. a claim holding models and datasets) that learner and rollout pods mount read-only at
    # builders.INPUTS_DIR; spec.model and spec.dataset.path may name paths under it.
    volume: dict[str, Any] | None = Field(None, min_length=1)
    # For an s3:// model or dataset.path: the Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and
    # AWS_SESSION_TOKEN), the S3-compatible server, the region; as spec.output's.
    credentials_secret: str | None = Field(None, min_length=1, max_length=253)
    endpoint: str | None = Field(None, max_length=1024)
    region: str | None = Field(None, min_length=1, max_length=64)
    # A Secret whose key HF_TOKEN is the hub token (gated or private hub models and datasets).
    hub_token_secret: str | None = Field(None, min_length=1, max_length=253)

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, endpoint: str | None) -> str | None:
        return check_endpoint(endpoint)


class ModelCacheSpec(WireModel):
    # A volume source every pod of the run mounts for the hub's cache (HF_HOME) and the s3:// inputs' downloads: a
    # restarted pod or a new rollout server finds them there. Shared by pods on several nodes: ReadWriteMany.
    volume: dict[str, Any] = Field(min_length=1)


class ExitCodeMatch(WireModel):
    operator: Literal["In", "NotIn"]
    values: list[int] = Field(min_length=1)


class PodConditionMatch(WireModel):
    type: str


class PodFailureRule(WireModel):
    """One rule of `runPolicy.podFailurePolicy`: a failed pod that matches gets `action`."""

    action: Literal["Fail", "Restart", "Ignore"]
    on_exit_codes: ExitCodeMatch | None = None
    on_pod_conditions: list[PodConditionMatch] | None = Field(None, min_length=1)

    def matches(self, exit_code: int | None, true_conditions: frozenset[str]) -> bool:
        if self.on_exit_codes is not None:
            if exit_code is None:
                return False
            return (exit_code in self.on_exit_codes.values) == (self.on_exit_codes.operator == "In")
        return any(match.type in true_conditions for match in self.on_pod_conditions or [])


#: Restarts of one rollout server before its next exit fails the run (`runPolicy.rolloutRestartLimit`'s default;
#: `grporun local --rollout-restart-limit` uses it too).
DEFAULT_ROLLOUT_RESTART_LIMIT = 3


class RunPolicySpec(WireModel):
    suspend: bool = False
    backoff_limit: int = Field(3, ge=0)
    rollout_restart_limit: int = Field(DEFAULT_ROLLOUT_RESTART_LIMIT, ge=0)
    max_disruptions: int | None = Field(None, ge=0)
    pod_failure_policy: list[PodFailureRule] | None = None
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    clean_pod_policy: Literal["Running", "All", "None"] = "Running"


#: spec.modelRevision or spec.dataset.revision that opts out of pinning: each pod loads the hub's main when it starts.
UNPINNED_REVISION = "unpinned"


class GRPORunSpec(WireModel):
    model: str = Field(min_length=1)
    # A branch, tag or commit of a hub model (default main), resolved to a commit once, before the first pod
    # (status.model.revision): every pod of the run loads that commit. `unpinned` opts out.
    model_revision: str | None = Field(None, min_length=1, max_length=256)
    dataset: DatasetConfig
    rewards: list[RewardConfig] = Field(min_length=1)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    progress: ProgressSpec = Field(default_factory=ProgressSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    output: OutputSpec | None = None
    inputs: InputsSpec | None = None
    model_cache: ModelCacheSpec | None = None
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    scheduling: SchedulingSpec | None = None
    environments: list[EnvironmentSpec] | None = Field(None, max_length=MAX_ENVIRONMENTS)
    managed_by: str = Field(CONTROLLER_NAME, max_length=63)
    fit_check: FitPolicy = "refuse"

    @field_validator("model")
    @classmethod
    def _model_uri(cls, model: str) -> str:
        return _check_store_uri(model, "spec.model")

    @field_validator("dataset")
    @classmethod
    def _dataset_uri(cls, dataset: DatasetConfig) -> DatasetConfig:
        if dataset.path is not None:
            _check_store_uri(dataset.path, "spec.dataset.path")
        return dataset

    @field_validator("environments")
    @classmethod
    def _unique_environment_names(cls, environments: list[EnvironmentSpec] | None) -> list[EnvironmentSpec] | None:
        names = [environment.name for environment in environments or []]
        if duplicates := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"environment names must be unique: {', '.join(duplicates)} named more than once")
        return environments

    def openenv_environments(self) -> list[str]:
        """The environments the learner plays with OpenEnv's client, in spec order."""
        return [environment.name for environment in self.environments or [] if environment.protocol == "openenv"]

    @model_validator(mode="after")
    def _checkpoint_store(self) -> GRPORunSpec:
        if self.checkpoint.uri is None:
            return self
        if self.output is not None and self.output.uri is not None and self.output.access() != self.checkpoint.access():
            # One learner process holds one set of boto3 variables (grpo_operator.builders.object_store_env).
            raise ValueError("checkpoint.uri and output.uri: credentialsSecret, endpoint and region must be the same "
                             "for both (the learner reaches one object store)")
        return self

    @property
    def learner_world_size(self) -> int:
        return self.learner.nodes * self.learner.processes_per_node


def managed_by(body: dict[str, Any]) -> str:
    """The controller that reconciles this run: `spec.managedBy`, this operator's name when unset (a run stored
    before the field existed)."""
    value = (body.get("spec") or {}).get("managedBy")
    return value if isinstance(value, str) and value else CONTROLLER_NAME


def spec_error_from(error: ValidationError, prefix: str = "spec") -> SpecError:
    """The first pydantic error as a SpecError naming the field on the wire (camelCase, `rewards[0]`)."""
    return SpecError(*first_error(error, prefix))


def check_reward_names(spec: GRPORunSpec) -> GRPORunSpec:
    """The rule the CRD cannot hold: a built-in reward must exist (the contract lists their names,
    `BUILTIN_REWARD_NAMES`). The same line under `grporun validate`, `grporun local` and the operator; raises
    SpecError."""
    for index, reward in enumerate(spec.rewards):
        if reward.name is not None:
            try:
                check_reward_name(reward.name)
            except UnknownRewardName as error:
                raise SpecError(f"spec.rewards[{index}].name", str(error)) from None
    return spec


def check_environment_protocols(spec: GRPORunSpec) -> GRPORunSpec:
    """The rule across spec.environments and spec.training: every OpenEnv environment can get rows
    (contract.config.check_openenv_environments). Raises SpecError naming the environment's protocol."""
    try:
        check_openenv_environments(spec.training, spec.openenv_environments())
    except ValueError as error:
        position = next(index for index, environment in enumerate(spec.environments or [])
                        if environment.protocol == "openenv")
        raise SpecError(f"spec.environments[{position}].protocol", str(error)) from None
    return spec


def parse_spec(spec: dict[str, Any]) -> GRPORunSpec:
    """Validate a GRPORun's `.spec` (camelCase, as stored) into the typed model; raises SpecError."""
    if not isinstance(spec, dict):
        raise SpecError("spec", f"must be a mapping, not {type(spec).__name__}")
    try:
        parsed = GRPORunSpec.model_validate(spec)
    except ValidationError as error:
        raise spec_error_from(error) from None
    return check_environment_protocols(check_reward_names(parsed))


def parse_stored_spec(spec: dict[str, Any]) -> tuple[GRPORunSpec, list[str]]:
    """A spec as the API server stores it, plus the fields this operator does not know, which are left out.

    A newer CRD (applied before the operator is upgraded) may add and default fields: the operator runs the run
    with what it knows rather than failing every live run as InvalidSpec. Anything else wrong raises SpecError.
    """
    if not isinstance(spec, dict):
        raise SpecError("spec", f"must be a mapping, not {type(spec).__name__}")
    spec, ignored = copy.deepcopy(spec), []
    while True:
        try:
            return check_environment_protocols(check_reward_names(GRPORunSpec.model_validate(spec))), ignored
        except ValidationError as error:
            unknown = [e["loc"] for e in error.errors() if e["type"] == "extra_forbidden"]
            if not unknown or not all(_drop(spec, loc) for loc in unknown):
                raise spec_error_from(error) from None
            ignored += [field_path("spec", loc) for loc in unknown]


def _drop(value: Any, loc: tuple[int | str, ...]) -> bool:
    for part in loc[:-1]:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return False
    if not isinstance(value, dict) or loc[-1] not in value:
        return False
    del value[loc[-1]]
    return True
