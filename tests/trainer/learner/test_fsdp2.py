"""The FSDP2 learner's own pieces: the weight sync's gather order and the final model's consolidation.

accelerate (1.15) applies its FSDP2 plugin to GPU runs only (a `use_cpu` learner stays MULTI_CPU, plain DDP), so a
whole FSDP2 learner cannot train on this CPU machine and the config refuses fsdp2 on CPU. What FSDP2 itself does runs
here on gloo: tests/support/learner/fsdp2_scenario.py shards the tiny model with torch's `fully_shard` over two ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.learner.checkpoints import MarkerError, read_marker
from grpo_trainer.learner.trainer import GRPOLearner
from grpo_trainer.rollout.weight_sync import FilesystemWeightTransfer, gathered_before_sending, gathered_parameters
from tests.support.paths import REPO
from tests.support.ports import free_port

SCENARIO = str(REPO / "tests" / "support" / "learner" / "fsdp2_scenario.py")


class Recorded:
    """Named parameters that record how many were taken."""

    def __init__(self, count: int):
        self.named = [(f"p{i}", torch.full((2,), float(i))) for i in range(count)]
        self.taken = 0

    def __iter__(self):
        for pair in self.named:
            self.taken += 1
            yield pair


def test_a_sender_on_its_own_thread_gets_parameters_all_gathered_before_the_first():
    # TRL's NCCL client consumes the iterator on a daemon thread between broadcasts to vLLM: every gather must be
    # done on the caller's thread first, in the other ranks' order.
    source = Recorded(5)
    handed = gathered_before_sending(source, torch.device("cpu"))
    assert source.taken == 5
    received = []
    consumer = threading.Thread(target=lambda: received.extend(handed))
    consumer.start()
    consumer.join()
    assert [name for name, _ in received] == [f"p{i}" for i in range(5)]


def test_a_sender_on_the_callers_thread_takes_each_parameter_as_it_is_gathered():
    source = Recorded(3)
    stream = gathered_parameters(source, torch.device("cpu"))
    assert source.taken == 0
    next(stream)
    assert source.taken == 1


def learner_stand_in(*, main: bool, ranks: int, transfer) -> SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"), is_main_process=main,
                                  num_processes=ranks)
    return SimpleNamespace(accelerator=accelerator, model=model, weight_transfer=transfer)


@pytest.mark.parametrize(("main", "ranks", "transfer", "eager"), [
    (True, 2, "nccl", True),  # TRL's NCCL client, with other ranks to gather with
    (True, 1, "nccl", False),  # one rank: no collective to order, no copy of the model
    (False, 2, None, False),  # another rank walks the gathers as they come
    (True, 2, "filesystem", False),  # the filesystem writer consumes on the caller's thread
])
def test_the_learner_gathers_everything_first_only_for_a_threaded_sender_among_ranks(main, ranks, transfer, eager,
                                                                                    monkeypatch):
    from grpo_trainer.learner import trainer

    chosen = []
    monkeypatch.setattr(trainer, "gathered_before_sending",
                        lambda named, device: chosen.append("first") or gathered_before_sending(named, device))
    monkeypatch.setattr(trainer, "gathered_parameters",
                        lambda named, device: chosen.append("each") or gathered_parameters(named, device))
    sender = {"nccl": object(), "filesystem": FilesystemWeightTransfer.__new__(FilesystemWeightTransfer),
              None: None}[transfer]
    stream = GRPOLearner._streaming_iter(learner_stand_in(main=main, ranks=ranks, transfer=sender))
    assert chosen == ["first" if eager else "each"]
    assert [name for name, _ in stream] == ["weight", "bias"]


@pytest.mark.slow
def test_fsdp2_shards_sync_whole_consolidate_and_resume_from_their_checkpoint(tiny_model_dir, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), SCENARIO, "--model", tiny_model_dir, "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["sharded_parameters"] == rank1["sharded_parameters"] > 0  # real DTensor shards on both ranks
    assert rank0["sums"] == rank1["sums"]  # both ranks gathered the same whole parameters

    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    synced = load_file(str(tmp_path / "synced" / "model-00000.safetensors"))
    # Whole tensors under the checkpoint's names (the tied output embedding written under its own name too).
    assert {name: list(t.shape) for name, t in synced.items()} == {
        name: list(original[name].shape) for name in synced} == rank0["shapes"]
    assert "lm_head.weight" in synced
    assert {name: pytest.approx(float(t.double().sum()), rel=1e-9) for name, t in synced.items()
            if name in rank0["sums"]} == rank0["sums"]

    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    loaded = final.state_dict()
    for name, tensor in synced.items():
        assert torch.equal(loaded[name], tensor), name  # the consolidated model is what the ranks trained
    assert not torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])

    # The sharded checkpoint: the marker vouches for every rank's files, resume is exact, damage is caught.
    marker = read_marker(str(tmp_path / "checkpoint-1"))
    shards = {f"{folder}/__{r}_0.distcp" for folder in ("pytorch_model_fsdp_0", "optimizer_0") for r in (0, 1)}
    assert shards | {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(marker["files"])
    assert rank0["resumed"] == rank0["continued"] != rank0["sums"]  # one step on from the checkpoint, both alike
    assert rank1["resumed"] == rank1["continued"] == rank0["continued"]
    shard = tmp_path / "checkpoint-1" / "optimizer_0" / "__1_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(MarkerError, match="vouches for optimizer_0/__1_0.distcp, whose content changed"):
        read_marker(str(tmp_path / "checkpoint-1"))
