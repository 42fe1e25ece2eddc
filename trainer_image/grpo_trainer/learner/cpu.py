"""Run TRL 1.16's async GRPO learner on CPU.

Two things in TRL assume CUDA, both swapped here:
- tree attention loads a FlashAttention-3 kernel from the hub (`packing._flash_attn`,
  `trl/experimental/async_grpo/packing.py:159-165 (trl 1.16.0)`): on CPU the per-segment SDPA kernel of
  `grpo_trainer.learner.attention` answers the same varlen call. Measured: steps of a 0.3M-parameter model take
  0.2-0.5 s.
- `get_peak_flops_per_device` calls `torch.cuda.get_device_name`
  (`trl/experimental/async_grpo/async_grpo_trainer.py:1240 (trl 1.16.0)`), which raises on CPU torch: on CPU there
  is no peak to report, so MFU metrics are off (TRL's own behaviour for unknown devices). A GPU keeps TRL's code.
"""

from __future__ import annotations

from . import attention

_PEAK_FLOPS_PATCHED = False


def enable_cpu_support() -> None:
    """Call before building the trainer when the learner runs on CPU; idempotent."""
    global _PEAK_FLOPS_PATCHED
    attention.install(attention.AttentionKernel.SDPA)
    if _PEAK_FLOPS_PATCHED:
        return
    from trl.experimental.async_grpo import async_grpo_trainer

    original_peak_flops = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops_or_none(accelerator, dtype):
        if accelerator.device.type == "cpu":
            return None
        return original_peak_flops(accelerator, dtype)

    async_grpo_trainer.get_peak_flops_per_device = peak_flops_or_none
    _PEAK_FLOPS_PATCHED = True
