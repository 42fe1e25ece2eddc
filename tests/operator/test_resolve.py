"""resolve_run_config turns a GRPORun spec into the learner's RunConfig: the user's values flow through untouched, the
caller's addresses and paths land where the learner reads them, and a defaulted spec resolves to the contract's own
defaults (so the CRD, the spec model and the contract agree)."""

from __future__ import annotations

import pytest

from grpo_operator.api import SpecError, parse_spec
from grpo_operator.manifest import read_grporun
from grpo_operator.resolve import RunPlacement, resolve_run_config
from grpo_trainer.contract.codes import DEFAULT_TERMINATION_MESSAGE_PATH
from grpo_trainer.contract.config import (
    DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS,
    CheckpointConfig,
    EnvironmentServersConfig,
    FilterConfig,
    LearnerConfig,
    ProgressConfig,
    RolloutConfig,
    TrainingConfig,
    load_run_config,
)
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES


def resolve(fixture: str, **overrides):
    run = read_grporun(FIXTURES / fixture)
    arguments = dict(rollout_urls=["http://run-rollout-0.run-rollout:8000"], output_dir="/out", checkpoint_dir=None,
                     weight_sync_dir=None, termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH)
    arguments.update(overrides)
    return run, resolve_run_config(run.name, run.namespace, run.spec, RunPlacement(**arguments))


def test_resolve_defaulted_spec_gives_the_contracts_defaults():
    _, config = resolve("minimal.yaml")
    assert config.training.model_dump(exclude={"token_budget"}) == TrainingConfig().model_dump(exclude={"token_budget"})
    assert config.filter == FilterConfig()
    assert config.progress == ProgressConfig()
    defaults = RolloutConfig()
    for field in ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "device", "extra_args"):
        assert getattr(config.rollout, field) == getattr(defaults, field), field
    assert config.rollout.weight_sync == defaults.weight_sync
    assert config.learner == LearnerConfig()
    assert config.checkpoint == CheckpointConfig()


def test_resolve_token_budget_defaults_to_the_servers_context_length():
    _, config = resolve("cpu-local.yaml", weight_sync_dir="/sync")
    assert config.training.token_budget == 256 == config.rollout.max_model_len
    run, config = resolve("full-gpu.yaml", weight_sync_dir="/weights")
    assert config.training.token_budget == 3072
    assert read_grporun(FIXTURES / "cpu-local.yaml").spec.training.token_budget is None, "the spec is not mutated"


def test_resolve_carries_every_user_value_and_the_callers_paths():
    run, config = resolve(
        "full-gpu.yaml",
        rollout_urls=["http://a:8000", "http://b:8000"],
        checkpoint_dir="/checkpoints",
        weight_sync_dir="/weights",
        termination_message_path="/tmp/termination",
    )
    spec = run.spec
    assert (config.run_name, config.namespace, config.model) == ("qwen3-gsm8k", "research", "Qwen/Qwen3-0.6B")
    assert config.dataset == spec.dataset and config.dataset.limit == 5000
    assert [reward.model_dump(exclude_defaults=True) for reward in config.rewards] == [
        {"name": "accuracy"},
        {"function": "mypkg.rewards:format_reward", "weight": 0.2},
    ]
    assert config.training.model_dump() == spec.training.model_dump()
    assert config.training.extra_args == {"epsilon_high": 0.28, "top_p": 1.0}
    assert config.filter.drop_truncated and config.filter.no_signal_epsilon == 0.0001
    assert config.progress.model_dump() == {"stall_groups": 500, "progress_deadline_seconds": 1800,
                                            "stall_policy": "Fail"}
    assert config.rollout.urls == ["http://a:8000", "http://b:8000"]
    assert (config.rollout.max_model_len, config.rollout.gpu_memory_utilization) == (4096, 0.85)
    assert config.rollout.extra_args == ["--enforce-eager"]
    assert config.rollout.weight_sync.model_dump() == {"mode": "filesystem", "directory": "/weights",
                                                       "deadline_seconds": 1200}
    assert (config.learner.nodes, config.learner.processes_per_node, config.learner.device) == (2, 8, "cuda")
    assert config.learner.attention == "varlen"
    assert config.learner.strategy == "ddp" and config.learner.fsdp.cpu_offload
    assert config.checkpoint.model_dump() == {"directory": "/checkpoints", "save_steps": 50, "uri": None, "keep": 2}
    assert (config.output_dir, config.termination_message_path) == ("/out", "/tmp/termination")


def test_resolve_filesystem_weight_sync_gets_the_callers_directory():
    _, config = resolve("cpu-local.yaml", weight_sync_dir="/shared/weights")
    assert config.rollout.weight_sync.model_dump() == {"mode": "filesystem", "directory": "/shared/weights",
                                                       "deadline_seconds": 900}
    assert (config.rollout.device, config.learner.device) == ("cpu", "cpu")


def test_resolve_round_trips_through_the_configmap_json():
    _, config = resolve("full-gpu.yaml", checkpoint_dir="/ckpt", weight_sync_dir="/weights")
    assert load_run_config(config.model_dump_json(by_alias=True)) == config


@pytest.mark.parametrize(
    "fixture, overrides, message",
    [
        ("minimal.yaml", {"rollout_urls": []}, "rollout_urls: at least one rollout server URL"),
        ("cpu-local.yaml", {"weight_sync_dir": None}, "weight_sync_dir: filesystem weight sync needs a directory"),
        # The fixtures have no spec.output: a folder for one is a caller that misread the spec.
        ("minimal.yaml", {"output": ("/models/run", "pvc://models/run")}, "output: a folder and URI exactly when"),
    ],
)
def test_resolve_rejects_a_caller_that_leaves_out_what_the_spec_needs(fixture, overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve(fixture, **overrides)


def test_resolve_carries_the_learners_strategy():
    run = read_grporun(FIXTURES / "minimal.yaml")
    spec = run.spec.model_copy(update={"learner": run.spec.learner.model_copy(update={"strategy": "fsdp2"})})
    config = resolve_run_config(run.name, run.namespace, spec, RunPlacement(
        rollout_urls=["http://r:8000"], output_dir="/out", checkpoint_dir=None, weight_sync_dir=None,
        termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH))
    assert config.learner.strategy == "fsdp2" and not config.learner.fsdp.cpu_offload


def test_resolve_loads_the_specs_revisions_and_none_for_unpinned():
    run = read_grporun(FIXTURES / "minimal.yaml")
    placement = RunPlacement(rollout_urls=["http://r:8000"], output_dir="/out", checkpoint_dir=None,
                             weight_sync_dir=None, termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH)
    commit = "ab" * 20
    pinned = run.spec.model_copy(update={"model_revision": commit, "dataset": run.spec.dataset.model_copy(
        update={"revision": "v2"})})
    config = resolve_run_config(run.name, run.namespace, pinned, placement)
    assert (config.model_revision, config.dataset.revision) == (commit, "v2")
    unpinned = run.spec.model_copy(update={"model_revision": "unpinned", "dataset": run.spec.dataset.model_copy(
        update={"revision": "unpinned"})})
    config = resolve_run_config(run.name, run.namespace, unpinned, placement)
    assert (config.model_revision, config.dataset.revision) == (None, None)


def test_resolve_carries_each_environments_protocol_to_the_learner():
    run, config = resolve("agentic.yaml", weight_sync_dir="/sync", environment_urls={"guess": "http://guess:8765"})
    assert config.environment_protocols == {"guess": "http"} and config.openenv_environments() == []
    spec = run.spec.model_copy(deep=True)
    spec.training.environment_factory = None
    spec.environments[0].protocol = "openenv"
    config = resolve_run_config(run.name, run.namespace, spec, RunPlacement(
        rollout_urls=["http://r:8000"], output_dir="/out", checkpoint_dir=None, weight_sync_dir="/sync",
        termination_message_path=DEFAULT_TERMINATION_MESSAGE_PATH, environment_urls={"guess": "http://guess:8765"}))
    assert load_run_config(config.model_dump_json(by_alias=True)).openenv_environments() == ["guess"]
def test_resolve_carries_each_environments_servers_and_how_long_the_learner_waits_for_them():
    run, config = resolve("agentic.yaml", weight_sync_dir="/weights", environment_urls={"guess": "http://guess:8765"})
    (environment,) = run.spec.environments
    assert config.environment_servers == {environment.name: EnvironmentServersConfig(
        replicas=environment.replicas, unavailable_seconds=DEFAULT_ENVIRONMENT_UNAVAILABLE_SECONDS)}
    spec = run.spec.model_dump(by_alias=True, exclude_none=True)
    spec["environments"][0]["unavailableSeconds"] = 5
    assert parse_spec(spec).environments[0].unavailable_seconds == 5
    for bad in (0, 86401, "soon"):
        spec["environments"][0]["unavailableSeconds"] = bad
        with pytest.raises(SpecError, match=r"^spec\.environments\[0\]\.unavailableSeconds: "):
            parse_spec(spec)
