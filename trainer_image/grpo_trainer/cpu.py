"""Run TRL 1.16's async GRPO learner on CPU.

Two things in TRL assume CUDA, both swapped here only for CPU tensors/devices (a GPU run keeps TRL's own code):
- tree attention loads a FlashAttention-3 kernel from the hub (`packing._flash_attn`,
  `trl/experimental/async_grpo/packing.py:159-165 (trl 1.16.0)`): on CPU the same
  varlen call is answered by a pure-torch implementation (per packed segment: bottom-right causal mask, GQA by
  repeat_interleave). Measured: steps of a 0.3M-parameter model take 0.2-0.5 s.
- `get_peak_flops_per_device` calls `torch.cuda.get_device_name`
  (`trl/experimental/async_grpo/async_grpo_trainer.py:1240 (trl 1.16.0)`), which raises on CPU torch: on CPU there
  is no peak to report, so MFU metrics are off (TRL's own behaviour for unknown devices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ENABLED = False


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    **_: object,
) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` contract in plain torch: q (Tq, H, D), k/v (Tk, Hkv, D)."""
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("the CPU tree-attention fallback supports neither sliding windows nor softcap")
    heads, kv_heads = query.shape[1], key.shape[1]
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outputs = []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]), strict=True):
        q = query[q0:q1].transpose(0, 1)
        k = key[k0:k1].transpose(0, 1)
        v = value[k0:k1].transpose(0, 1)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        mask = None
        if causal:
            # Bottom-right alignment: query i sees keys up to (len_k - len_q + i), as FlashAttention does when a
            # segment's queries are the tail of its keys (the shared prefix is only in K/V).
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - q.shape[1])
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(outputs, dim=0)


class _KernelForDevice:
    """Stands where TRL expects the hub kernel module; answers CPU tensors itself, the rest with the real kernel."""

    def __init__(self, load_original):
        self._load_original = load_original

    def flash_attn_varlen_func(self, query, *args, **kwargs):
        if query.device.type == "cpu":
            return varlen_attention(query, *args, **kwargs)
        return self._load_original().flash_attn_varlen_func(query, *args, **kwargs)


def enable_cpu_support() -> None:
    """Idempotent; call before building the trainer when the learner runs on CPU."""
    global _ENABLED
    if _ENABLED:
        return
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    kernel = _KernelForDevice(packing._flash_attn)
    packing._flash_attn = lambda: kernel

    original_peak_flops = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops_or_none(accelerator, dtype):
        if accelerator.device.type == "cpu":
            return None
        return original_peak_flops(accelerator, dtype)

    async_grpo_trainer.get_peak_flops_per_device = peak_flops_or_none
    _ENABLED = True
