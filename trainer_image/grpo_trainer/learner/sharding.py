"""`learner.strategy: fsdp2` made to hold: accelerate's FSDP2 on CPU ranks, and the check that the model was sharded.

accelerate (1.15) reads the launcher's FSDP flags into a plugin, but `AcceleratorState` switches to FSDP only for GPU
types (`accelerate/state.py`, the branch listing MULTI_GPU, MULTI_XPU, ...): a `use_cpu` run stays MULTI_CPU and its
ranks silently train as DDP. torch's `fully_shard` itself runs on gloo, so `shard_cpu_ranks` completes accelerate's
choice for CPU ranks. `ShardingCheck` makes any fallback loud, on every device: an fsdp2 run whose parameters are not
DTensors once the trainer prepared the model ends as an invalid config instead of training as something else.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from .errors import ConfigError

logger = logging.getLogger(__name__)

_CPU_RANKS_SHARDED = False


def shard_cpu_ranks() -> None:
    """After `AcceleratorState.__init__`, a MULTI_CPU state given an FSDP plugin becomes FSDP with that plugin, as a
    MULTI_GPU state does there (mixed precision handed to the plugin the same way). Idempotent; a state without an
    FSDP plugin (every ddp run) is left as accelerate made it."""
    global _CPU_RANKS_SHARDED
    if _CPU_RANKS_SHARDED:
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    accelerate_init = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        accelerate_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init
    _CPU_RANKS_SHARDED = True


class ShardingCheck(TrainerCallback):
    """An fsdp2 learner refuses to train unless every parameter of the prepared model is a DTensor (FSDP2's shard)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # PartialState: the distributed type AcceleratorState settled on (it writes it there), or a plain one's.
        from accelerate.state import PartialState
        from torch.distributed.tensor import DTensor

        parameters = list(model.parameters())
        plain = sum(1 for parameter in parameters if not isinstance(parameter, DTensor))
        if not plain:
            logger.info("fsdp2: all %d parameters sharded (DTensors over %d ranks)", len(parameters),
                        PartialState().num_processes)
            return
        raise ConfigError(
            f"learner.strategy fsdp2: {plain} of the model's {len(parameters)} parameters are not sharded after "
            f"accelerate prepared it (it runs the ranks as {PartialState().distributed_type.value}): the "
            "learner will not train as another strategy; launch it with accelerate's FSDP2 flags "
            "(grpo_trainer.contract.launch)")
