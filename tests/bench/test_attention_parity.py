"""bench/attention_parity.py on CPU: its dense truth on packed segments, sdpa passing it in float32 through the
module's own command line, and a kernel with the wrong causal alignment failing it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bench import attention_parity as ap
from grpo_trainer.learner import attention


def test_the_dense_truth_aligns_each_segment_bottom_right_and_keeps_segments_apart():
    # Zero queries weigh every key they see alike: each output is the mean of the values it may see.
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)  # segment 0: 2 queries, 3 keys; segment 1: 1 query, 2 keys
    cu_k = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.zeros(3, 2, 4, dtype=torch.float64)
    k = torch.randn(5, 1, 4, dtype=torch.float64)
    v = torch.arange(5, dtype=torch.float64)[:, None, None].expand(5, 1, 4)
    out = ap.dense_attention(q, k, v, cu_q, cu_k, scale=0.5)
    assert out.shape == (3, 2, 4)
    means = out[:, 0, 0].tolist()  # both heads share the one K/V head
    assert means == pytest.approx([(0 + 1) / 2, (0 + 1 + 2) / 3, (3 + 4) / 2])
    assert torch.equal(out[:, 0], out[:, 1])


def test_sdpa_passes_in_float32_through_the_command_line(tmp_path):
    out = tmp_path / "parity.json"
    assert ap.main([str(out), "--device", "cpu", "--dtype", "float32", "--cases", "sdpa:32,sdpa:64", "--tiny"]) == 0
    results = [ap.Parity(**record) for record in json.loads(out.read_text())]
    assert [(r.kernel, r.head_dim, r.dtype) for r in results] == [("sdpa", 32, "float32"), ("sdpa", 64, "float32")]
    assert all(r.passed and set(r.errors) == set(ap.FIELDS) for r in results), results
    assert all(max(r.errors.values()) < 1e-5 for r in results)


def test_a_kernel_aligned_top_left_fails(monkeypatch):
    """What a kernel that read causal as top-left (queries at the head of their keys) would compute."""

    def top_left(query, key, value, cu_q, cu_k, max_q, max_k, **options):
        groups = query.shape[1] // key.shape[1]
        outputs = []
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
            q = query[q0:q1].transpose(0, 1)
            k = key[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
            v = value[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          scale=options["softmax_scale"]).transpose(0, 1))
        return torch.cat(outputs)

    monkeypatch.setattr(attention, "sdpa_varlen_attention", top_left)
    result = ap.parity("sdpa", ap.Case(32, ap.TINY_SEGMENTS, 4, 2), torch.float32, "cpu")
    assert not result.passed and result.error is None
    assert result.errors["out"] > 100 * (result.baseline["out"] + ap.FLOOR)


def test_a_kernel_that_raises_is_reported_not_raised():
    result = ap.parity("varlen", ap.Case(32, ap.TINY_SEGMENTS, 4, 2), torch.float32, "cpu")
    assert not result.passed
    assert result.error.startswith("AttentionUnavailable: learner.attention: varlen runs in float16 or bfloat16")
