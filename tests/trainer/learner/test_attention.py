"""The tree-attention kernel rule, and every kernel against a dense causal reference on packed segments."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_trainer.contract.codes import AttentionKernel
from grpo_trainer.learner import attention
from grpo_trainer.learner.attention import (
    AUTO,
    AttentionUnavailable,
    DeviceFacts,
    choose_kernel,
    sdpa_varlen_attention,
    torch_varlen_attention,
)

H100 = (9, 0)
A100 = (8, 0)
L4 = (8, 9)
T4 = (7, 5)


def cuda(capability, *, fa3=False, rocm=False) -> DeviceFacts:
    return DeviceFacts("cuda", capability=capability, rocm=rocm, fa3_kernel_present=fa3)


# --------------------------------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("facts", "expected"), [
    (DeviceFacts("cpu"), AttentionKernel.SDPA),
    (cuda(H100, fa3=True), AttentionKernel.FA3),
    (cuda(H100, fa3=False), AttentionKernel.VARLEN),  # Hopper without the baked kernel: no download, torch's own
    (cuda(A100, fa3=True), AttentionKernel.VARLEN),  # FA3 is Hopper only, kernel or not
    (cuda(L4), AttentionKernel.VARLEN),
    (cuda(T4), AttentionKernel.SDPA),  # torch's flash attention needs 8.0
    (cuda((9, 4), fa3=True, rocm=True), AttentionKernel.SDPA),  # an MI300's gfx version is not a Hopper
    (cuda(None), AttentionKernel.SDPA),  # CUDA asked for, no GPU visible
])
def test_auto_picks_the_fastest_kernel_that_runs_here(facts, expected):
    assert choose_kernel(AUTO, facts).kernel is expected


def test_auto_says_why_it_passed_a_kernel_over():
    reason = choose_kernel(AUTO, cuda(T4)).reason
    assert "fa3: it runs on compute capability 9.0 (Hopper) only, this GPU is 7.5" in reason
    assert "varlen: torch's flash attention needs compute capability 8.0 or newer" in reason


@pytest.mark.parametrize(("requested", "facts", "why"), [
    ("fa3", cuda(A100, fa3=True), "runs on compute capability 9.0 (Hopper) only, this GPU is 8.0"),
    ("fa3", cuda(H100, fa3=False), "--build-arg FA3_KERNEL=true"),
    ("fa3", DeviceFacts("cpu"), "needs a CUDA GPU and the learner runs on cpu"),
    ("varlen", DeviceFacts("cpu"), "needs a CUDA GPU and the learner runs on cpu"),
    ("varlen", cuda(T4), "needs compute capability 8.0 or newer, this GPU is 7.5"),
])
def test_a_kernel_the_device_cannot_run_is_refused_naming_the_field(requested, facts, why):
    with pytest.raises(AttentionUnavailable, match=rf"^learner\.attention: {requested} cannot run here: .*") as info:
        choose_kernel(requested, facts)
    assert why in str(info.value)


@pytest.mark.parametrize(("requested", "facts"), [
    ("sdpa", cuda(H100, fa3=True)),
    ("sdpa", DeviceFacts("cpu")),
    ("varlen", cuda(H100, fa3=True)),
    ("fa3", cuda(H100, fa3=True)),
])
def test_an_override_wins_where_it_can_run(requested, facts):
    choice = choose_kernel(requested, facts)
    assert choice.kernel is AttentionKernel(requested) and choice.reason == "set by learner.attention"


A10 = (8, 6)


@pytest.mark.parametrize(("facts", "head_dim", "expected"), [
    (cuda(L4), 256, AttentionKernel.SDPA),  # varlen's backward has no kernel for it there
    (cuda(A10), 193, AttentionKernel.SDPA),
    (cuda(L4), 192, AttentionKernel.VARLEN),
    (cuda(L4), 128, AttentionKernel.VARLEN),
    (cuda(L4), None, AttentionKernel.VARLEN),  # the model not read yet: the device alone decides
    (cuda(A100), 256, AttentionKernel.VARLEN),  # sm80 has the shared memory
    (cuda(H100), 256, AttentionKernel.VARLEN),
    (cuda(H100, fa3=True), 256, AttentionKernel.FA3),
])
def test_auto_passes_varlen_over_where_its_backward_cannot_run_the_models_head_dim(facts, head_dim, expected):
    assert choose_kernel(AUTO, facts, head_dim=head_dim).kernel is expected


def test_the_head_dim_refusal_says_why_and_names_the_field():
    assert "varlen: its backward has no kernel for the model's head dim 256 on compute capability 8.9" in (
        choose_kernel(AUTO, cuda(L4), head_dim=256).reason)
    refusal = r"^learner\.attention: varlen cannot run here: its backward has no kernel for the model's head dim 256 "
    with pytest.raises(AttentionUnavailable, match=refusal + r"on compute capability 8\.6"):
        choose_kernel("varlen", cuda(A10), head_dim=256)


def test_the_head_dim_is_read_from_the_config_or_from_hidden_size_over_heads():
    from transformers import Qwen3Config

    assert attention.model_head_dim(Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=128)) == 128

    class NoHeadDim:
        hidden_size, num_attention_heads = 2048, 8

        def get_text_config(self):
            return self

    assert attention.model_head_dim(NoHeadDim()) == 256


def test_the_fa3_kernel_is_present_only_with_the_package_and_the_baked_lock_file(tmp_path, monkeypatch):
    lock = tmp_path / "kernels.lock"
    monkeypatch.setenv(attention.FA3_LOCKFILE_ENV, str(lock))
    installed = {"kernels": True}
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name: object() if installed.get(name) else None)
    assert not attention.fa3_kernel_present()  # the package, no kernel
    lock.write_text("[]")
    assert attention.fa3_kernel_present()
    installed["kernels"] = False
    assert not attention.fa3_kernel_present()  # a lock file without the package that reads it


def test_probe_reads_the_local_ranks_gpu(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0))
    monkeypatch.setattr(attention, "fa3_kernel_present", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    facts = attention.probe_device("cuda")
    assert asked == [3] and facts == DeviceFacts("cuda", capability=(9, 0), rocm=bool(torch.version.hip),
                                                 fa3_kernel_present=True)
    assert attention.probe_device("cpu") == DeviceFacts("cpu")


# --------------------------------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------------------------------
def reference(q, k, v, scale):
    """One segment, dense: queries are the tail of the keys (bottom-right causal), heads already matched."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    lq, lk = q.shape[0], k.shape[0]
    allowed = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


HEADS, KV_HEADS, DIM = 4, 2, 32
LENGTHS_Q, LENGTHS_K = [3, 5, 1], [7, 5, 4]  # segments 0 and 2 share a prefix held only in K/V


def packed(dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(sum(LENGTHS_Q), HEADS, DIM, dtype=dtype)
    k = torch.randn(sum(LENGTHS_K), KV_HEADS, DIM, dtype=dtype)
    v = torch.randn(sum(LENGTHS_K), KV_HEADS, DIM, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(LENGTHS_Q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(LENGTHS_K).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def dense_expected(q, k, v, cu_q, cu_k, scale):
    expanded_k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    expanded_v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    return torch.cat([
        reference(q[q0:q1], expanded_k[k0:k1], expanded_v[k0:k1], scale)
        for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False)
    ])


def test_sdpa_matches_dense_attention_per_segment_with_gqa():
    q, k, v, cu_q, cu_k = packed()
    scale = 1 / math.sqrt(DIM)
    out = sdpa_varlen_attention(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), softmax_scale=scale)
    torch.testing.assert_close(out, dense_expected(q, k, v, cu_q, cu_k, scale), rtol=1e-5, atol=1e-5)


def test_sdpa_gradients_flow():
    q = torch.randn(4, 2, 32, requires_grad=True)
    k = torch.randn(4, 2, 32, requires_grad=True)
    v = torch.randn(4, 2, 32, requires_grad=True)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    sdpa_varlen_attention(q, k, v, cu, cu, 4, 4).sum().backward()
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_trls_tree_attention_runs_through_the_installed_kernel():
    """TRL's own tree_attention (its layout, K/V gather along each segment's path) with the kernel installed where
    TRL looks for it, against dense attention per root-to-segment path."""
    from trl.experimental.async_grpo import packing

    attention.install(AttentionKernel.SDPA)
    assert attention.installed_kernel() is AttentionKernel.SDPA
    # A row of 9 tokens: segment 0 = tokens 0-2 (a root), 1 = tokens 3-7 (a root), 2 = token 8 (a child of 0).
    paths = [[0, 1, 2], [3, 4, 5, 6, 7], [0, 1, 2, 8]]
    segments = [[0, 1, 2], [3, 4, 5, 6, 7], [8]]
    kv_index = torch.tensor([i for path in paths for i in path])
    cu_q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    torch.manual_seed(1)
    q, k, v = torch.randn(9, HEADS, DIM), torch.randn(9, KV_HEADS, DIM), torch.randn(9, KV_HEADS, DIM)
    scale = 1 / math.sqrt(DIM)
    module = torch.nn.Linear(1, 1)  # the attention layer: float32 weights, so no cast
    module.config = None
    out, _ = packing.tree_attention(
        module, *(t.transpose(0, 1)[None] for t in (q, k, v)), None,
        tree_kv_index=kv_index, tree_cu_seqlens_q=cu_q, tree_cu_seqlens_k=cu_k,
        tree_max_seqlen_q=5, tree_max_seqlen_k=5, scaling=scale,
    )
    groups = HEADS // KV_HEADS
    expected = torch.cat([
        reference(q[segment], k[path].repeat_interleave(groups, 1), v[path].repeat_interleave(groups, 1), scale)
        for segment, path in zip(segments, paths, strict=True)
    ])
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_the_varlen_kernel_passes_torchs_own_argument_checks():
    """torch's real varlen_attn on meta tensors (its shape rules run, no GPU): GQA and the causal window accepted."""
    q, k, v, cu_q, cu_k = (t.to("meta") for t in packed(torch.bfloat16))
    out = torch_varlen_attention(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), softmax_scale=0.1,
                                 causal=True, window_size=(-1, -1))
    assert out.shape == q.shape and out.dtype == torch.bfloat16


def test_the_varlen_kernel_asks_torch_for_bottom_right_causal_gqa(monkeypatch):
    """What reaches torch's varlen_attn: window (-1, 0) (torch's causal, the flash kernel's bottom-right), the scale,
    and enable_gqa, for full attention and a sliding window alike."""
    import torch.nn.attention.varlen as varlen

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *args, **kwargs: calls.append((args, kwargs)) or args[0])
    q, k, v, cu_q, cu_k = packed(torch.bfloat16)
    torch_varlen_attention(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.25, causal=True, window_size=(-1, -1))
    torch_varlen_attention(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.25, causal=True, window_size=(127, 0))
    assert [kwargs for _, kwargs in calls] == [
        {"scale": 0.25, "window_size": (-1, 0), "enable_gqa": True},
        {"scale": 0.25, "window_size": (127, 0), "enable_gqa": True},
    ]
    assert calls[0][0][3] is cu_q and calls[0][0][4] is cu_k and calls[0][0][5:] == (5, 7)


def test_the_varlen_kernel_leaves_out_enable_gqa_where_torchs_varlen_attn_has_none(monkeypatch):
    """torch releases before varlen_attn's `enable_gqa` (2.11, the lent GPU machine's) take fewer K/V heads as they
    are and refuse the unknown argument."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def varlen_attn_without_gqa(query, *positional, return_aux=None, scale=None, window_size=(-1, -1)):
        calls.append({"scale": scale, "window_size": window_size})
        return query

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn_without_gqa)
    q, k, v, cu_q, cu_k = packed(torch.bfloat16)
    assert torch_varlen_attention(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.25) is q
    assert calls == [{"scale": 0.25, "window_size": (-1, 0)}]


@pytest.mark.parametrize(("kernel", "bf16", "fp16", "dtype", "refused"), [
    (AttentionKernel.VARLEN, True, False, "float32", False),  # TRL's GPU default: bf16 autocast over fp32 weights
    (AttentionKernel.FA3, False, True, "float32", False),
    (AttentionKernel.VARLEN, False, False, "bfloat16", False),
    (AttentionKernel.VARLEN, False, False, "float32", True),
    (AttentionKernel.FA3, False, False, None, True),
    (AttentionKernel.SDPA, False, False, "float32", False),
])
def test_a_flash_kernel_needs_half_precision_before_the_model_loads(kernel, bf16, fp16, dtype, refused):
    problem = attention.precision_problem(kernel, bf16=bf16, fp16=fp16, dtype=dtype)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"learner.attention: {kernel.value} computes in float16 or bfloat16")


def test_the_varlen_kernel_refuses_float32_naming_the_field():
    q, k, v, cu_q, cu_k = packed(torch.float32)
    with pytest.raises(AttentionUnavailable, match=r"^learner\.attention: varlen runs in float16 or bfloat16"):
        torch_varlen_attention(q, k, v, cu_q, cu_k, 5, 7)


def test_the_fa3_kernel_is_loaded_once_from_the_baked_copy(monkeypatch):
    loads = []

    class Fa3Module:
        @staticmethod
        def flash_attn_varlen_func(query, *args, **kwargs):
            return query * 2

    monkeypatch.setattr(attention, "load_fa3_kernel", lambda: loads.append(1) or Fa3Module)
    kernel = attention.TreeAttentionKernel(AttentionKernel.FA3)
    q = torch.ones(2, 2, 8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    assert kernel.flash_attn_varlen_func(q, q, q, cu, cu, 2, 2).sum() == 64
    kernel.flash_attn_varlen_func(q, q, q, cu, cu, 2, 2)
    assert loads == [1]


def test_the_fa3_loader_reads_the_lock_file_without_the_hub(monkeypatch, tmp_path):
    """`load_fa3_kernel` asks `kernels.load_kernel` (pre-downloaded, locked) for the repo with the image's lock file;
    `kernels` itself is not installed here, so a stand-in module records the call."""
    import sys
    import types

    asked = []
    fake = types.ModuleType("kernels")
    fake.load_kernel = lambda repo_id, *, lockfile: asked.append((repo_id, lockfile)) or "module"
    monkeypatch.setitem(sys.modules, "kernels", fake)
    monkeypatch.setenv(attention.FA3_LOCKFILE_ENV, str(tmp_path / "kernels.lock"))
    assert attention.load_fa3_kernel() == "module"
    assert asked == [(attention.FA3_REPO, tmp_path / "kernels.lock")]
