"""The resolved run config: what the operator renders into the run's ConfigMap (`run.json`) and `grporun local`
writes to disk, read by the learner and the rollout server. Field names and defaults mirror the GRPORun spec
(crds/), so the ConfigMap reads like the manifest the user wrote, plus what only the operator knows (addresses,
paths)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .codes import DEFAULT_TERMINATION_MESSAGE_PATH, LEARNER_HTTP_PORT, ROLLOUT_HTTP_PORT
from .store_uri import InvalidObjectStoreURI, is_object_store_uri, parse_uri
from .wire import REPORTED_NAME, WireModel


class DatasetConfig(WireModel):
    name: str | None = Field(None, description="Hub dataset id, loaded with datasets.load_dataset.")
    path: str | None = Field(None, description="A local JSON/JSONL file or a directory saved with save_to_disk.")
    config: str | None = None
    split: str = "train"
    prompt_field: str = "prompt"
    limit: int | None = Field(None, ge=1, description="Use only the first N prompts.")
    revision: str | None = Field(
        None, description="The hub dataset's commit (or branch or tag) to load; None: the hub's main when loaded.")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.name is None) == (self.path is None):
            raise ValueError("set exactly one of dataset.name or dataset.path")
        return self


#: Completions a reward model scores per forward unless the reward sets batchSize.
REWARD_MODEL_BATCH_SIZE = 16


#: `module:function`: how rewards, tools and environment factories name user code (the CRD's rules hold the same).
IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def check_import_path(value: str, what: str) -> None:
    """Raises ValueError unless `value` names user code as 'module:function'."""
    if not IMPORT_PATH.match(value):
        raise ValueError(f"{what} {value!r} must look like 'module:function'")


#: The built-in rewards' names, which `RewardConfig.name` may take (grpo_trainer.learner.rewards has the functions; a
#: test holds the two equal): the operator refuses any other before the run starts.
BUILTIN_REWARD_NAMES = ("letter_a_fraction", "constant", "accuracy")


class UnknownRewardName(ValueError):
    """A `RewardConfig.name` that is no built-in reward; the message names it and the built-in ones."""


def check_reward_name(name: str) -> None:
    """Raises UnknownRewardName unless `name` is a built-in reward."""
    if name not in BUILTIN_REWARD_NAMES:
        raise UnknownRewardName(f"unknown reward {name!r}; built-in rewards: {', '.join(sorted(BUILTIN_REWARD_NAMES))}")


class RewardConfig(WireModel):
    name: str | None = Field(None, description="A built-in reward (grpo_trainer.learner.rewards).")
    function: str | None = Field(None, description="A user reward as 'module:function'.")
    model: str | None = Field(
        None, description="A sequence-classification reward model (hub id or path), scored on the learner."
    )
    weight: float = 1.0
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="The reward model's dtype; default: bfloat16 on GPU, float32 on CPU."
    )
    batch_size: int | None = Field(
        None, ge=1, description=f"Completions the reward model scores per forward; default {REWARD_MODEL_BATCH_SIZE}."
    )
    max_length: int | None = Field(
        None, ge=1, description="The reward model's context; longer samples are unscorable. Default: the model's."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if sum(value is not None for value in (self.name, self.function, self.model)) != 1:
            raise ValueError("a reward sets exactly one of name, function or model")
        if self.function is not None:
            check_import_path(self.function, "reward function")
        if self.model is not None and not self.model.strip():
            raise ValueError("reward model must name a hub id or a local path")
        if self.model is None and (self.dtype, self.batch_size, self.max_length) != (None, None, None):
            raise ValueError("dtype, batchSize and maxLength apply to a reward model only")
        return self

    @property
    def is_model(self) -> bool:
        return self.model is not None


#: AsyncGRPOConfig arguments the operator derives from the spec, with the spec field that sets each.
#: `training.extraArgs` may not set them (`extraArgs: {num_train_epochs: 99}` ran 1584 groups where the spec said 12
#: epochs); the CRD's rule on extraArgs lists the same keys (tests/trainer/contract/test_managed_args.py holds the two
#: together).
MANAGED_TRAINER_ARGS: dict[str, str] = {
    "num_train_epochs": "training.epochs",
    "num_generations": "training.numGenerations",
    "per_device_train_batch_size": "training.perDeviceTrainBatchSize",
    "gradient_accumulation_steps": "training.gradientAccumulationSteps",
    "learning_rate": "training.learningRate",
    "max_completion_length": "training.maxCompletionLength",
    "max_staleness": "training.maxStaleness",
    "weight_sync_steps": "training.weightSyncSteps",
    "temperature": "training.temperature",
    "seed": "training.seed",
    "token_budget": "training.tokenBudget",
    "output_dir": "checkpoint.directory",
    "save_strategy": "checkpoint.saveSteps",
    "save_steps": "checkpoint.saveSteps",
    "run_name": "metadata.name",
    "vllm_server_base_url": "rollout (the operator points the learner at its rollout servers)",
    "use_cpu": "learner.device",
    "max_tool_calling_iterations": "training.maxToolCallingIterations",
}


def managed_args_message(keys: list[str]) -> str:
    return "; ".join(f"{key} is set from the spec: use {MANAGED_TRAINER_ARGS[key]}" for key in keys)


#: Modules a LoRA adapter may not target (a `targetModules` entry naming one, alone or as a dotted path's end).
#: The output embedding: TRL's fused log-probabilities read the head's base weight, so an adapter on it would train a
#: policy the learner never scores. The input embedding: a model that ties the two shares that weight.
LORA_REFUSED_MODULES = ("lm_head", "embed_tokens")
#: The largest adapter rank vLLM serves (the top of the ranks it builds LoRA buffers for, `--max-lora-rank`).
MAX_SERVED_LORA_RANK = 512


class LoraConfig(WireModel):
    """A LoRA adapter trained in place of the full policy (peft's LoraConfig through TRL's `peft_config`)."""

    r: int = Field(8, ge=1, le=MAX_SERVED_LORA_RANK, description="The adapter's rank.")
    alpha: float = Field(16.0, gt=0, description="Scales the adapter's update by alpha / r (peft's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1,
        description="Module names (or dotted suffixes) to adapt; default: every linear layer but the output layer.",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter", description="What a weight sync sends the rollout servers: the adapter alone (loaded on every "
        "server under a versioned name), or the base weights with the adapter merged in.")

    @field_validator("target_modules")
    @classmethod
    def _not_the_head(cls, value: list[str] | None) -> list[str] | None:
        if any(target.rsplit(".", 1)[-1] in LORA_REFUSED_MODULES for target in value or []):
            raise ValueError(LORA_HEAD_MESSAGE)
        return value


#: Said by the spec's validation and the CRD's rule alike (tests/operator/test_manifest.py holds them together).
LORA_HEAD_MESSAGE = ("must not name lm_head or embed_tokens: the learner scores log-probabilities with the output "
                     "embedding's base weight, so an adapter there would never be scored")


class TrainingConfig(WireModel):
    epochs: float = Field(1, gt=0)
    num_generations: int = Field(8, ge=2)
    per_device_train_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-6, gt=0)
    max_completion_length: int = Field(1024, ge=1)
    max_staleness: int = Field(4, ge=0)
    weight_sync_steps: int = Field(1, ge=1)
    temperature: float = Field(1.0, gt=0)
    seed: int = 42
    token_budget: int | None = Field(
        None, ge=1, description="Tokens per row; default: the rollout server's maxModelLen."
    )
    # Masked importance sampling at the sequence level (TRL GRPO's `sequence_mask` mode, under its names): a sample
    # whose exp(sum of learner - rollout logprobs) is outside [clipMin, clipMax] is taken out of the loss. Off unless
    # one is set.
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0, description="Mask samples whose learner/rollout sequence ratio is below this.")
    vllm_importance_sampling_clip_max: float | None = Field(
        None, gt=0, description="Mask samples whose learner/rollout sequence ratio is above this.")
    lora: LoraConfig | None = Field(None, description="Train a LoRA adapter instead of every weight.")
    tools: list[str] = Field(
        default_factory=list, max_length=64,
        description="Functions the policy may call, each as 'module:function' (its name, signature and docstring "
                    "are the tool's schema).")
    environment_factory: str | None = Field(
        None, description="A 'module:function' returning one environment per episode.")
    environment_factories: dict[str, str] | None = Field(
        None, description="Environments by name: each row plays in the one its `environment` column names.")
    max_tool_calling_iterations: int | None = Field(
        None, ge=1, description="Tool-calling rounds an episode may take; unset: until the policy stops calling.")
    call_timeout_seconds: int = Field(
        60, ge=1, le=86400,
        description="Seconds one call of an environment (reset, a tool, get_reward) may take; past it the call is "
                    "abandoned and the episode counts as the environment's failure.")
    episode_timeout_seconds: int = Field(
        600, ge=1, le=86400,
        description="Seconds from an episode's reset by which its environment calls must be done; past it the "
                    "episode counts as the environment's failure.")
    extra_args: dict[str, Any] = Field(default_factory=dict, description="Passed to AsyncGRPOConfig as is.")

    @field_validator("extra_args")
    @classmethod
    def _no_managed_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        managed = [key for key in value if key in MANAGED_TRAINER_ARGS]
        if managed:
            raise ValueError(managed_args_message(managed))
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_import_paths(cls, value: list[str]) -> list[str]:
        for tool in value:
            check_import_path(tool, "tool")
        if len(set(value)) != len(value):
            raise ValueError("each tool may appear only once")
        return value

    @field_validator("environment_factory")
    @classmethod
    def _factory_is_an_import_path(cls, value: str | None) -> str | None:
        if value is not None:
            check_import_path(value, "environment factory")
        return value

    @field_validator("environment_factories")
    @classmethod
    def _factories_are_import_paths(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if not value:
                raise ValueError("environmentFactories names at least one environment")
            for name, factory in value.items():
                if not REPORTED_NAME.fullmatch(name):
                    raise ValueError(f"environment name {name[:70]!r} is not a name (a letter, then up to 62 "
                                     "letters, digits or underscores)")
                check_import_path(factory, f"environment factory {name!r}")
        return value

    @model_validator(mode="after")
    def _one_environment_source(self) -> TrainingConfig:
        if self.environment_factory is not None and self.environment_factories is not None:
            raise ValueError("set environmentFactory or environmentFactories, not both")
        return self

    @model_validator(mode="after")
    def _clip_bounds_in_order(self) -> TrainingConfig:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError("vllmImportanceSamplingClipMin must be below vllmImportanceSamplingClipMax")
        return self


class FilterConfig(WireModel):
    drop_no_signal: bool = True
    drop_truncated: bool = False
    no_signal_epsilon: float = Field(1e-6, ge=0, description="A group whose reward std is <= this has no signal.")


class ProgressConfig(WireModel):
    stall_groups: int = Field(0, ge=0, description="Groups consumed in a row without one training; 0 = one pass.")
    progress_deadline_seconds: int = Field(1800, ge=1)
    stall_policy: Literal["Fail", "Report"] = "Fail"


#: A weight sync running longer than this ends the learner as stalled (docs/learner.md, "Weight-sync deadline", has
#: the measured figures it is drawn from).
WEIGHT_SYNC_DEADLINE_SECONDS = 900


class WeightSyncConfig(WireModel):
    # nccl: TRL's own WeightTransferClient (GPU). filesystem: safetensors into a directory both processes see, then
    # vLLM's reload_weights through /collective_rpc (the CPU path; no CPU transfer engine ships with vLLM).
    mode: Literal["nccl", "filesystem"] = "nccl"
    directory: str | None = None
    deadline_seconds: int = Field(
        WEIGHT_SYNC_DEADLINE_SECONDS, ge=1,
        description="A weight sync still running after this long has hung: the learner ends as stalled.",
    )


class RolloutConfig(WireModel):
    urls: list[str] = Field(default_factory=lambda: [f"http://127.0.0.1:{ROLLOUT_HTTP_PORT}"])
    max_model_len: int = Field(4096, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    device: Literal["cuda", "cpu"] = "cuda"
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM server flags.")

#: `learner.attention`: a kernel, or auto (the rule picks one for the device).
AttentionSetting = Literal["auto", "fa3", "varlen", "sdpa"]


#: `learner.strategy`: how the ranks hold the model. ddp: each rank the whole training state; fsdp2: PyTorch's FSDP2
#: shards parameters, gradients and optimizer state over the ranks (accelerate's FSDP2 plugin; bf16 compute on GPUs).
LearnerStrategy = Literal["ddp", "fsdp2"]


class FsdpConfig(WireModel):
    cpu_offload: bool = Field(False, description="FSDP2 keeps the parameter, gradient and optimizer shards in CPU "
                              "memory and moves each layer to the GPU only while it computes: slower, far less GPU "
                              "memory.")


class LearnerConfig(WireModel):
    nodes: int = Field(1, ge=1)
    processes_per_node: int = Field(1, ge=1)
    device: Literal["cuda", "cpu"] = "cuda"
    strategy: LearnerStrategy = Field(
        "ddp", description="ddp: every rank holds the whole model and its optimizer state; fsdp2: both are sharded "
        "over the ranks.")
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    attention: AttentionSetting = Field(
        "auto", description="The tree-attention kernel; auto: fa3 where baked in and on Hopper, else varlen on a "
        "CUDA GPU (compute capability 8.0+), else sdpa.")
    http_port: int = LEARNER_HTTP_PORT


class CheckpointConfig(WireModel):
    directory: str | None = Field(None, description="Where checkpoints go; resume picks the newest one here.")
    save_steps: int = Field(100, ge=1)
    uri: str | None = Field(None, min_length=1, description="An `s3://bucket/prefix` every checkpoint is uploaded "
                            "to after it is written to `directory`; a learner whose directory holds none resumes "
                            "from the newest complete one there.")
    keep: int = Field(2, ge=2, description="Checkpoints kept under `uri`, the newest.")

    @field_validator("uri")
    @classmethod
    def _object_store_uri(cls, uri: str | None) -> str | None:
        if uri is not None:
            try:
                parse_uri(uri, "checkpoint.uri")
            except InvalidObjectStoreURI as error:
                raise ValueError(error.reason) from None
        return uri


class OutputConfig(WireModel):
    """Where the learner exports the trained model at the end of a run (the GRPORun's `spec.output`)."""

    directory: str = Field(min_length=1, description="The model's folder; staged beside it, then renamed into place.")
    uri: str = Field(min_length=1, description="Where users find it (`pvc://claim/run`, `file:///path`): reported. "
                     "An `s3://bucket/prefix` is also where the folder is uploaded to, its manifest last.")
    run_spec: dict[str, Any] = Field(default_factory=dict, description="The GRPORun spec, kept in the manifest.")

    @field_validator("uri")
    @classmethod
    def _object_store_uri(cls, uri: str) -> str:
        if is_object_store_uri(uri):
            try:
                parse_uri(uri, "output.uri")
            except InvalidObjectStoreURI as error:
                raise ValueError(error.reason) from None
        return uri


class InputsConfig(WireModel):
    """Where the model and dataset come from when they are not a hub id or a plain path (the GRPORun's
    `spec.inputs`), and where downloads are kept (grpo_trainer.storage.inputs)."""

    cache_dir: str | None = Field(
        None, description="Where s3:// inputs are downloaded, once: on spec.modelCache.volume in a pod; default "
        "$XDG_CACHE_HOME/grpo/inputs (grporun local).")
    endpoint: str | None = Field(None, description="The S3-compatible server of s3:// inputs; AWS's own without it.")
    region: str | None = Field(None, description="The inputs' bucket region.")
    credentials_secret: str | None = Field(
        None, description="The Secret whose keys are the inputs' object-store credentials (named in errors).")
    hub_token_secret: str | None = Field(
        None, description="The Secret whose key HF_TOKEN is the hub token (named in errors).")


# --------------------------------------------------------------------------------------------------------------------
# Experiment tracking (spec.tracking). Credentials are named here, as Secrets; their variables are
# grpo_trainer.contract.pod_env's; everything else the learner sets itself (grpo_trainer.learner.tracking).
# --------------------------------------------------------------------------------------------------------------------
class SecretKeyRef(WireModel):
    name: str = Field(min_length=1, description="A Secret in the run's namespace.")
    key: str = Field(min_length=1, description="The key of the Secret that holds the value.")


class MlflowTracking(WireModel):
    tracking_uri: str = Field(min_length=1, description="The MLflow tracking server, e.g. http://mlflow:5000.")
    experiment: str | None = Field(None, min_length=1, description="Experiment name (default: the run's namespace).")
    run_name: str | None = Field(None, min_length=1, description="MLflow run name (default: the GRPORun's name).")
    credentials_secret: str | None = Field(
        None, min_length=1,
        description="Secret whose keys username and password (or token) authenticate to the tracking server.")


class TensorBoardTracking(WireModel):
    """Event files under the checkpoint directory's `tensorboard/` (the checkpoint volume: they outlive the pod)."""


class WandbTracking(WireModel):
    project: str = Field(min_length=1, description="The W&B project.")
    entity: str | None = Field(None, min_length=1, description="The W&B entity (team or user).")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline writes the run under the checkpoint directory's wandb/, with no network.")
    api_key_secret: SecretKeyRef | None = Field(None, description="The W&B API key; online mode needs it.")

    @model_validator(mode="after")
    def _online_needs_a_key(self) -> WandbTracking:
        if self.mode == "online" and self.api_key_secret is None:
            raise ValueError("online mode needs apiKeySecret (or mode offline)")
        return self


class TrackingConfig(WireModel):
    mlflow: MlflowTracking | None = None
    tensorboard: TensorBoardTracking | None = None
    wandb: WandbTracking | None = None
    # `fail` by default: a run that asked for its metrics to be tracked and trained without them loses what it was
    # run for, and a tracker unreachable at start is most often a mistake in the spec (a wrong URI, a Service in
    # another namespace) found in seconds, before any accelerator time is spent. `continue` is for runs whose
    # training matters more than their curves.
    on_unavailable: Literal["fail", "continue"] = Field(
        "fail", description="A tracker that does not answer at the learner's start: fail ends the run as invalid "
        "config naming it; continue trains without it, with a warning and the TrackingDegraded condition.")

    @property
    def trackers(self) -> list[str]:
        """The trackers asked for, by their `report_to` names (transformers' integrations)."""
        return [name for name in ("mlflow", "tensorboard", "wandb") if getattr(self, name) is not None]


#: How the learner plays an environment server (spec.environments[].protocol).
#: - `http`: the user's environment factory (training.environmentFactory/environmentFactories) plays it, reaching it
#:   through grpo_trainer.agentic.transport.EnvironmentClient;
#: - `openenv`: the learner plays it itself with OpenEnv's client (grpo_trainer.agentic.openenv), no factory needed.
EnvironmentProtocol = Literal["http", "openenv"]
DEFAULT_ENVIRONMENT_PROTOCOL: EnvironmentProtocol = "http"

#: spec.environments[].unavailableSeconds' default: how long the learner waits for an environment with no ready
#: server before the run ends as stalled.
DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS = 300
#: Its most: a day, as the other timeouts.
MAX_ENVIRONMENT_UNAVAILABLE_SECONDS = 86400


class EnvironmentServersConfig(WireModel):
    """What the learner knows of one environment's servers beyond its URL (spec.environments[])."""

    replicas: int = Field(1, ge=0, description="The servers the spec asks for: the learner's `ready/replicas`.")
    unavailable_seconds: int = Field(
        DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS, ge=1, le=MAX_ENVIRONMENT_UNAVAILABLE_SECONDS,
        description="Seconds the learner waits while the environment has no ready server, once it had one; past "
                    "them the run ends as stalled.")


class RunConfig(WireModel):
    """Everything the learner and the rollout server need, resolved. One JSON file: the ConfigMap's `run.json`."""

    run_name: str = "grporun"
    namespace: str = "default"
    model: str
    model_revision: str | None = Field(
        None, description="The hub commit every process loads `model` at (the operator or grporun local resolved "
                          "spec.modelRevision to it once); None: a path, or the hub's main when each process loads.")
    dataset: DatasetConfig
    rewards: list[RewardConfig] = Field(min_length=1)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    progress: ProgressConfig = Field(default_factory=ProgressConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    output: OutputConfig | None = None
    inputs: InputsConfig = Field(default_factory=InputsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    output_dir: str = "/tmp/grpo-output"
    termination_message_path: str = DEFAULT_TERMINATION_MESSAGE_PATH
    images: dict[str, list[str]] = Field(
        default_factory=dict,
        description="The images the run's pods have run, by digest (the kubelet's imageID), by role: rollout, "
                    "learner, environment/NAME. The operator adds each one its pods report, in the ConfigMap the "
                    "learner mounts; the export's manifest records them. Empty for a local run.")
    environments: dict[str, str] = Field(
        default_factory=dict,
        description="The run's environment servers (spec.environments) by name: the URL of each one's headless "
                    "Service (under grporun local, its servers' URLs separated by ENVIRONMENT_URL_SEPARATOR). The "
                    "learner's pods also have each as the variable environment_url_variable(name) names.")
    environment_protocols: dict[str, EnvironmentProtocol] = Field(
        default_factory=dict,
        description="The protocol of each environment in `environments` (spec.environments[].protocol; one left "
                    "out is `http`): an `openenv` one the learner plays itself, with no factory of the user's.")
    environment_servers: dict[str, EnvironmentServersConfig] = Field(
        default_factory=dict,
        description="The same environments' servers (spec.environments[].replicas, .unavailableSeconds), by name; "
                    "an environment missing here has the defaults.")

    @field_validator("model")
    @classmethod
    def _model_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model must name a hub id or a local path")
        return value

    @model_validator(mode="after")
    def _protocols_of_known_environments(self) -> RunConfig:
        if unknown := sorted(set(self.environment_protocols) - set(self.environments)):
            raise ValueError(f"environmentProtocols names {', '.join(unknown)}, which environments does not list")
        check_openenv_environments(self.training, self.openenv_environments())
        return self

    def openenv_environments(self) -> list[str]:
        """The environments the learner plays with OpenEnv's client, in the config's order."""
        return [name for name in self.environments if self.environment_protocols.get(name) == "openenv"]


def check_openenv_environments(training: TrainingConfig, names: list[str]) -> None:
    """Raise ValueError when the OpenEnv environments `names` cannot be played beside the training's environment
    factories: rows choose their environment by its name (the dataset's `environment` column), so a single
    environmentFactory (every row's) leaves no row to an OpenEnv environment, and a name must be one environment's."""
    if not names:
        return
    if training.environment_factory is not None:
        raise ValueError(f"environment {names[0]!r} has protocol openenv, which training.environmentFactory (every "
                         "row's environment) leaves no row to: name the factory in training.environmentFactories "
                         "instead, and each row's environment in the dataset's `environment` column")
    if clash := sorted(set(names) & set(training.environment_factories or {})):
        raise ValueError(f"environment {clash[0]!r} has protocol openenv and is also a key of "
                         "training.environmentFactories: a row's environment must name one of them")


#: TRL 1.16's `AsyncGRPOConfig.request_timeout`: how long one generation request may run before it is given up and
#: sent again. With the pod's grace period it bounds how long a rollout server that left the run's set drains.
TRL_REQUEST_TIMEOUT_S = 600


def request_timeout_seconds(extra_args: Mapping[str, Any]) -> float:
    """The run's generation request timeout: `training.extraArgs.request_timeout` (the spec's or the run config's),
    else TRL's default."""
    value = extra_args.get("request_timeout", TRL_REQUEST_TIMEOUT_S)
    usable = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if usable else float(TRL_REQUEST_TIMEOUT_S)


def load_run_config(text: str) -> RunConfig:
    """Parse the ConfigMap's JSON. Raises pydantic.ValidationError naming the field."""
    return RunConfig.model_validate_json(text)

