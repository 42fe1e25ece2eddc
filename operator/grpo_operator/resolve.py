"""Spec -> the learner's resolved run config: what the operator renders into the ConfigMap and `grporun local`
writes to disk. Pure; the caller supplies what only it knows (server addresses, paths inside the pods).

Built-in reward names are not checked here: `api.check_reward_names` checks them against the contract's list
(grpo_trainer.contract.config.BUILTIN_REWARD_NAMES) with the spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from grpo_operator.api import UNPINNED_REVISION, GRPORunSpec
from grpo_trainer.contract.config import (
    CheckpointConfig,
    EnvironmentServersConfig,
    InputsConfig,
    LearnerConfig,
    OutputConfig,
    ProgressConfig,
    RolloutConfig,
    RunConfig,
    WeightSyncConfig,
)


@dataclass(frozen=True)
class RunPlacement:
    """What only the caller knows: where the rollout servers answer and where things live inside the pods.

    `output`: (the model's folder as the learner sees it, its URI as users find it) when the spec has an output.
    `inputs_cache_dir`: where the pods download s3:// inputs (None: the learner's and server's own default)."""

    rollout_urls: Sequence[str]
    output_dir: str
    checkpoint_dir: str | None
    weight_sync_dir: str | None
    termination_message_path: str
    output: tuple[str, str] | None = None
    inputs_cache_dir: str | None = None
    environment_urls: Mapping[str, str] = field(default_factory=dict)  # by spec.environments[].name


def resolve_run_config(name: str, namespace: str, spec: GRPORunSpec, placement: RunPlacement) -> RunConfig:
    """Raises ValueError when the caller's part does not fit the spec (no rollout URL, no weight-sync directory for
    filesystem mode, no output folder for spec.output): a bug in the caller, not a user mistake."""
    rollout_urls, weight_sync_dir, output = placement.rollout_urls, placement.weight_sync_dir, placement.output
    if not rollout_urls:
        raise ValueError("rollout_urls: at least one rollout server URL is needed")
    weight_sync = spec.rollout.weight_sync
    if weight_sync.mode == "filesystem" and not weight_sync_dir:
        raise ValueError("weight_sync_dir: filesystem weight sync needs a directory both roles see")
    if (spec.output is None) != (output is None):
        raise ValueError("output: a folder and URI exactly when the spec has an output")
    vllm = spec.rollout.vllm
    training = spec.training.model_copy(deep=True)
    if training.token_budget is None:
        training.token_budget = vllm.max_model_len  # the contract's documented default, made explicit
    return RunConfig(
        run_name=name,
        namespace=namespace,
        model=spec.model,
        model_revision=_loaded(spec.model_revision),
        dataset=spec.dataset.model_copy(update={"revision": _loaded(spec.dataset.revision)}, deep=True),
        rewards=[reward.model_copy(deep=True) for reward in spec.rewards],
        training=training,
        filter=spec.filter.model_copy(deep=True),
        progress=ProgressConfig(**spec.progress.model_dump(include=set(ProgressConfig.model_fields))),
        rollout=RolloutConfig(
            urls=list(rollout_urls),
            max_model_len=vllm.max_model_len,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            tensor_parallel_size=vllm.tensor_parallel_size,
            device=spec.rollout.device,
            weight_sync=WeightSyncConfig(mode=weight_sync.mode, directory=weight_sync_dir,
                                         deadline_seconds=weight_sync.deadline_seconds),
            extra_args=list(vllm.extra_args),
        ),
        learner=LearnerConfig(
            nodes=spec.learner.nodes,
            processes_per_node=spec.learner.processes_per_node,
            device=spec.learner.device,
            attention=spec.learner.attention,
            strategy=spec.learner.strategy,
            fsdp=spec.learner.fsdp.model_copy(deep=True),
        ),
        checkpoint=CheckpointConfig(directory=placement.checkpoint_dir, save_steps=spec.checkpoint.save_steps,
                                    uri=spec.checkpoint.uri, keep=spec.checkpoint.keep),
        output=None if output is None else OutputConfig(
            directory=output[0], uri=output[1],
            run_spec=spec.model_dump(mode="json", by_alias=True, exclude_none=True)),
        inputs=_inputs(spec, placement.inputs_cache_dir),
        tracking=spec.tracking.model_copy(deep=True),
        output_dir=placement.output_dir,
        termination_message_path=placement.termination_message_path,
        environments=dict(placement.environment_urls),
        environment_protocols={environment.name: environment.protocol for environment in spec.environments or []},
        environment_servers={environment.name: EnvironmentServersConfig(
            replicas=environment.replicas, unavailable_seconds=environment.unavailable_seconds)
            for environment in spec.environments or []},
    )


def _loaded(revision: str | None) -> str | None:
    """The revision the pods load: the spec's (the commit, once the run is pinned: status.revision.pinned_spec);
    none for `unpinned`."""
    return None if revision == UNPINNED_REVISION else revision


def _inputs(spec: GRPORunSpec, cache_dir: str | None) -> InputsConfig:
    inputs = spec.inputs
    if inputs is None:
        return InputsConfig(cache_dir=cache_dir)
    return InputsConfig(cache_dir=cache_dir, endpoint=inputs.endpoint, region=inputs.region,
                        credentials_secret=inputs.credentials_secret, hub_token_secret=inputs.hub_token_secret)
