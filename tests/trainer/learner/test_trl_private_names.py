"""GRPOLearner rests on private names of trl==1.16.0 (docs/learner.md says where each is used). If an upgrade moves
one, fail here, loudly,
instead of deep inside a training run."""

import importlib.metadata
import inspect

import pytest
from trl.experimental.async_grpo import async_grpo_trainer as T
from trl.experimental.async_grpo import async_rollout_worker as W
from trl.experimental.async_grpo import packing as P


def test_trl_is_the_pinned_release():
    assert importlib.metadata.version("trl") == "1.16.0", "GRPOLearner is written against trl 1.16.0's private API"


@pytest.mark.parametrize(
    "name",
    ["RolloutQueueDataset", "TokenBudgetBatcher", "FixedCountBatcher", "DataCollatorForRollout",
     "_EmptyIterableDataset", "_EpochStopCallback", "AsyncGRPOTrainer", "get_peak_flops_per_device",
     "_iter_vllm_named_params"],
)
def test_module_level_names(name):
    assert hasattr(T, name), f"trl.experimental.async_grpo.async_grpo_trainer.{name} moved"


def test_packing_kernel_loader_and_rollout_sample():
    assert callable(P._flash_attn) and P.TREE_ATTENTION == "tree_fa3"
    fields = set(W.RolloutSample.__dataclass_fields__)
    assert {"input_ids", "completion_mask", "old_log_probs", "advantage", "model_version", "group_id",
            "metrics"} <= fields
    assert "dataset_start_index" in inspect.signature(W.AsyncRolloutWorker.__init__).parameters or \
        "dataset_start_index" in inspect.getsource(W.AsyncRolloutWorker)


def test_trainer_attributes_the_subclass_reads():
    source = inspect.getsource(T.AsyncGRPOTrainer)
    for attribute in ("_trained_groups", "_groups_before_resume", "_epoch_stop_groups", "_rollout_dataset",
                      "_metrics", "rollout_queue", "model_version", '_loop_kwargs["dataset_start_index"]',
                      "eos_token_ids", "vllm_client"):
        assert f"self.{attribute}" in source or attribute in source, f"AsyncGRPOTrainer no longer sets {attribute}"
    collator_fields = set(T.DataCollatorForRollout.__dataclass_fields__)
    assert {"pad_token_id", "num_processes", "groups_trained", "metrics", "token_budget"} <= collator_fields
    assert list(inspect.signature(T.RolloutQueueDataset.__init__).parameters)[1:4] == [
        "rollout_queue", "model_version_fn", "check_health_fn"]


def test_rollout_worker_attributes_the_supervised_worker_reads():
    source = inspect.getsource(W.AsyncRolloutWorker)
    for attribute in ("_process", "_stop_event_mp", "_failed_event", "_exception_info_queue"):
        assert f"self.{attribute} =" in source, f"AsyncRolloutWorker no longer sets {attribute}"
    assert "AsyncRolloutWorker(" in inspect.getsource(T.AsyncGRPOTrainer.__init__)  # TRL still builds it itself


def test_the_weight_sync_streams_what_the_learner_gathers():
    # GRPOLearner._streaming_iter gathers each parameter before it is sent: TRL must still send that iterator, on
    # rank 0, and walk it on the other ranks.
    source = inspect.getsource(T.AsyncGRPOTrainer._sync_weight_merged)
    assert "self.weight_transfer.send_weights(self._streaming_iter())" in source
    assert "for _ in self._streaming_iter():" in source


def test_the_rollout_loop_hooks_the_episode_loop_overrides():
    # EpisodeRolloutLoop (grpo_trainer.rollout.worker) subclasses the child's loop and is the worker's `_loop_cls`.
    assert W.AsyncRolloutWorker._loop_cls is W._AsyncRolloutLoop
    assert list(inspect.signature(W._AsyncRolloutLoop._generate_one).parameters) == [
        "self", "prompt", "tool_dict", "tools", "group_id"]
    assert list(inspect.signature(W._AsyncRolloutLoop._score_group).parameters) == ["self", "group"]
    group_fields = set(W.RolloutGroup.__dataclass_fields__)
    assert {"completions", "completions_sequences", "tool_call_counts", "tool_failure_counts"} <= group_fields
    # An environment's tools reach `_generate_one` only as its bound methods, which is how the loop finds it.
    assert "getattr(environment, member_name)" in inspect.getsource(W._AsyncRolloutLoop._generate_loop)


def test_the_adapter_sync_seams_the_learner_takes_over():
    # GRPOLearner keeps TRL's dispatch (`_sync_weight` on `_lora_sync`) and replaces the adapter arm, reusing TRL's
    # collective save and its rule of what vLLM serves; the worker names `{lora_name}-v{model_version}`.
    assert callable(T.save_lora_adapter) and callable(T.validate_lora_for_vllm_sync)
    assert list(inspect.signature(T.save_lora_adapter).parameters) == ["model", "accelerator", "adapter_name",
                                                                        "dest_dir"]
    assert "self._sync_weight_lora(t0)" in inspect.getsource(T.AsyncGRPOTrainer._sync_weight)
    init = inspect.getsource(T.AsyncGRPOTrainer.__init__)
    for attribute in ("_lora_sync", "_lora_name", "_adapter_name"):
        assert f"self.{attribute} =" in init, f"AsyncGRPOTrainer no longer sets {attribute}"
    assert "lora_name=" in init
    assert 'f"{self.lora_name}-v{self.model_version}"' in inspect.getsource(W)
