"""The CPU stand-in for TRL's FlashAttention-3 varlen kernel must compute what the kernel computes."""

import math

import torch

from grpo_trainer.cpu import varlen_attention


def reference(q, k, v, scale):
    # One segment, queries are the tail of the keys (bottom-right causal), heads already matched.
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    lq, lk = q.shape[0], k.shape[0]
    allowed = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_matches_dense_attention_per_segment_with_gqa():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 32
    lengths_q, lengths_k = [3, 5], [7, 5]  # segment 0 shares a 4-token prefix held only in K/V
    q = torch.randn(sum(lengths_q), heads, dim)
    k = torch.randn(sum(lengths_k), kv_heads, dim)
    v = torch.randn(sum(lengths_k), kv_heads, dim)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 12], dtype=torch.int32)
    scale = 1 / math.sqrt(dim)
    out = varlen_attention(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=scale, causal=True)
    expanded_k, expanded_v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    expected = torch.cat([
        reference(q[0:3], expanded_k[0:7], expanded_v[0:7], scale),
        reference(q[3:8], expanded_k[7:12], expanded_v[7:12], scale),
    ])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gradients_flow():
    q = torch.randn(4, 2, 32, requires_grad=True)
    k = torch.randn(4, 2, 32, requires_grad=True)
    v = torch.randn(4, 2, 32, requires_grad=True)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    varlen_attention(q, k, v, cu, cu, 4, 4).sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_enable_cpu_support_keeps_the_gpu_path():
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    from grpo_trainer.cpu import enable_cpu_support

    enable_cpu_support()
    enable_cpu_support()  # idempotent
    kernel = packing._flash_attn()
    q = torch.randn(2, 2, 32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    assert kernel.flash_attn_varlen_func(q, q, q, cu, cu, 2, 2).shape == q.shape

    class CpuAccelerator:
        device = torch.device("cpu")

    assert async_grpo_trainer.get_peak_flops_per_device(CpuAccelerator(), "float32") is None
