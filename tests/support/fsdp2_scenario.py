"""The learner's FSDP2 pieces on real FSDP2 shards: two gloo ranks under torchrun, the tiny model sharded per decoder
layer with torch's `fully_shard` (what accelerate's FSDP2 plugin does on GPUs; on CPU accelerate applies no FSDP).

One optimizer step moves the weights off the checkpoint's, then the ranks run the weight sync's gather (rank 0 writes
what it receives with the filesystem sync's writer) and the final model's consolidation. Rank 0 writes OUT/rank0.json
with each parameter's full-tensor sum as the ranks saw it; the test compares the files against it.

    torchrun --nproc_per_node 2 tests/support/fsdp2_scenario.py --model DIR --out OUT
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from grpo_trainer.learner_main import save_sharded_model
    from grpo_trainer.weight_sync import TIED_EMBEDDING_ALIASES, gathered_parameters, with_aliases, write_checkpoint

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
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"sharded_parameters": sharded, "sums": sums,
                                                      "shapes": shapes}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
