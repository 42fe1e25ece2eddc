"""The learner's FSDP2 pieces on real FSDP2 shards: two gloo ranks under torchrun, the tiny model sharded per decoder
layer with torch's `fully_shard` (what accelerate's FSDP2 plugin does on GPUs; on CPU accelerate applies no FSDP).

One optimizer step moves the weights off the checkpoint's, then the ranks run the weight sync's gather (rank 0 writes
what it receives with the filesystem sync's writer), the final model's consolidation, and a sharded checkpoint with
its marker, which a fresh sharded model resumes from. Every rank writes OUT/rank{R}.json with each parameter's
full-tensor sums as it saw them; the test compares the files against them.

    torchrun --nproc_per_node 2 tests/support/learner/fsdp2_scenario.py --model DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from grpo_trainer.learner.checkpoints import write_marker
    from grpo_trainer.progress import RolloutProgress
    from grpo_trainer.rollout.weight_sync import (
        TIED_EMBEDDING_ALIASES,
        gathered_parameters,
        with_aliases,
        write_checkpoint,
    )
    from grpo_trainer.storage.final_model import save_sharded_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = Path(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    device = torch.device("cpu")
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    sums = {name: float(tensor.double().sum()) for name, tensor in gathered_parameters(
        _iter_vllm_named_params(model), device)}
    shapes = {}
    if rank == 0:
        named = list(with_aliases(gathered_parameters(_iter_vllm_named_params(model), device),
                                  TIED_EMBEDDING_ALIASES))
        shapes = {name: list(tensor.shape) for name, tensor in named}
        write_checkpoint(iter(named), out / "synced")
    else:
        for _ in gathered_parameters(_iter_vllm_named_params(model), device):
            pass  # every rank takes part in each gather; rank 0 alone writes
    save_sharded_model(model, AutoTokenizer.from_pretrained(args.model), str(out / "final"), is_main=rank == 0)

    # A sharded checkpoint as the trainer writes one under SHARDED_STATE_DICT (each rank its own files, in the
    # folders accelerate names), vouched for by rank 0's marker once every rank has written.
    checkpoint = out / "checkpoint-1"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(checkpoint / "optimizer_0"))
    dist.barrier()
    if rank == 0:
        progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=4, epochs=1)
        progress.train([0])
        write_marker(str(checkpoint), {**progress.checkpoint_state().to_dict(), "model_version": 1,
                                       "global_step": 1})
    # Resumed: a fresh model sharded the same way loads the shards, and one more identical step on both gives the
    # same weights (the optimizer's moments came back too).
    resumed = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    for layer in resumed.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(resumed, mesh=mesh)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    model_state = get_model_state_dict(resumed)
    dcp.load(model_state, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
    set_model_state_dict(resumed, model_state)
    optimizer_state = get_optimizer_state_dict(resumed, resumed_optimizer)
    dcp.load(optimizer_state, checkpoint_id=str(checkpoint / "optimizer_0"))
    set_optimizer_state_dict(resumed, resumed_optimizer, optimizer_state)
    for trained, trained_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        trained(input_ids=ids.flip(1), labels=ids.flip(1)).loss.backward()
        trained_optimizer.step()
    after = [{name: float(t.double().sum()) for name, t in gathered_parameters(_iter_vllm_named_params(m), device)}
             for m in (model, resumed)]
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"sharded_parameters": sharded, "sums": sums,
                                                      "shapes": shapes, "continued": after[0],
                                                      "resumed": after[1]}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
