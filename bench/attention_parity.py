"""The tree-attention kernels against dense attention on packed segments, forward and backward.

`python -m bench.attention_parity OUT.json --device cuda --dtype bfloat16 --cases varlen:64,sdpa:64,...` writes one
record per kernel and head dim (the bare device check runs it in a process of its own).

A packed row holds segments one after another; segment i's queries are the tail of its keys (bottom-right causal
alignment: a tree row's shared prefix is only in K/V), with fewer K/V heads than query heads (GQA). Each kernel of
grpo_trainer.learner.attention is called the way TRL's tree attention calls it (`flash_attn_varlen_func` with
`softmax_scale`, `causal`, `window_size`), in the learner's precision (bf16 on a GPU). The truth is one dense,
masked attention over the whole row (every query against every key, a block-diagonal bottom-right causal mask),
computed in float64 (float32 on a GPU) from the same inputs. A kernel passes when its largest error, in the output
and in each of dq, dk and dv, is at most twice the error of that same dense attention computed in the kernel's
precision, plus `FLOOR` (the convention of FlashAttention's own tests): it may round no worse than plain attention
does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: (query tokens, key tokens) per segment: a root (as many queries as keys), children whose prefix is in K/V only,
#: a one-token segment.
SEGMENTS = ((129, 257), (64, 64), (1, 33), (300, 300), (77, 200))
TINY_SEGMENTS = ((3, 7), (5, 5), (1, 4))
HEADS, KV_HEADS = 8, 2
#: Errors of this size pass whatever the baseline's (a float32 baseline can be exact).
FLOOR = 1e-5
FIELDS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    head_dim: int
    segments: tuple[tuple[int, int], ...] = SEGMENTS
    heads: int = HEADS
    kv_heads: int = KV_HEADS


@dataclass(frozen=True)
class Parity:
    """One kernel on one case: the largest absolute error of each of FIELDS, the dense baseline's, and the verdict;
    `error` when the kernel raised (its type and first line)."""

    kernel: str
    head_dim: int
    dtype: str
    errors: dict[str, float]
    baseline: dict[str, float]
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(self.errors[name] <= 2 * self.baseline[name] + FLOOR for name in FIELDS)


def packed_row(case: Case, dtype, device: str, seed: int = 0):
    """q (Tq, H, D), k and v (Tk, Hkv, D), the cumulative offsets and the longest segments, with the gradient that
    comes back into the output."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    lengths_q = [q for q, _ in case.segments]
    lengths_k = [k for _, k in case.segments]

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = draw(sum(lengths_q), case.heads, case.head_dim)
    k = draw(sum(lengths_k), case.kv_heads, case.head_dim)
    v = draw(sum(lengths_k), case.kv_heads, case.head_dim)
    grad = draw(sum(lengths_q), case.heads, case.head_dim)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
                  for lengths in (lengths_q, lengths_k))
    return q, k, v, grad, cu_q, cu_k, max(lengths_q), max(lengths_k)


def dense_attention(q, k, v, cu_q, cu_k, scale: float):
    """One attention over the whole packed row: query i of segment s sees key j of segment s where j's place in
    its segment is at most len_k(s) - len_q(s) + i's place (bottom-right causal); nothing across segments."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    segment_q = torch.repeat_interleave(torch.arange(len(bounds_q) - 1), torch.tensor(bounds_q).diff())
    segment_k = torch.repeat_interleave(torch.arange(len(bounds_k) - 1), torch.tensor(bounds_k).diff())
    place_q = torch.arange(q.shape[0]) - torch.tensor(bounds_q)[segment_q]
    place_k = torch.arange(k.shape[0]) - torch.tensor(bounds_k)[segment_k]
    length_q, length_k = torch.tensor(bounds_q).diff(), torch.tensor(bounds_k).diff()
    reach = (length_k - length_q)[segment_q] + place_q  # the last key each query sees, by place in its segment
    allowed = (segment_q[:, None] == segment_k[None, :]) & (place_k[None, :] <= reach[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _forward_backward(attend, inputs, grad):
    """(output, dq, dk, dv) of `attend` on leaf copies of `inputs`."""
    leaves = [tensor.detach().clone().requires_grad_(True) for tensor in inputs]
    out = attend(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _largest_errors(values, truth) -> dict[str, float]:
    return {name: (value.double() - true.double()).abs().max().item()
            for name, value, true in zip(FIELDS, values, truth, strict=True)}


def parity(kernel_name: str, case: Case, dtype, device: str) -> Parity:
    """`kernel_name` (an AttentionKernel value) on `case` in `dtype` on `device`, against the dense truth."""
    import torch

    from grpo_trainer.contract.codes import AttentionKernel
    from grpo_trainer.learner.attention import TreeAttentionKernel

    q, k, v, grad, cu_q, cu_k, max_q, max_k = packed_row(case, dtype, device)
    scale = 1 / math.sqrt(case.head_dim)
    truth_dtype = torch.float32 if device.startswith("cuda") else torch.float64
    truth = _forward_backward(lambda *t: dense_attention(*t, cu_q, cu_k, scale),
                              [t.to(truth_dtype) for t in (q, k, v)], grad.to(truth_dtype))
    baseline = _largest_errors(_forward_backward(lambda *t: dense_attention(*t, cu_q, cu_k, scale), (q, k, v), grad),
                               truth)
    kernel = TreeAttentionKernel(AttentionKernel(kernel_name))

    def attend(query, key, value):
        return kernel.flash_attn_varlen_func(query, key, value, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                             causal=True, window_size=(-1, -1))

    dtype_name = str(dtype).removeprefix("torch.")
    try:
        errors = _largest_errors(_forward_backward(attend, (q, k, v), grad), truth)
    except Exception as error:  # noqa: BLE001 - a kernel that fails is this check's finding, reported with its type
        first = (str(error).strip().splitlines() or [""])[0]
        return Parity(kernel_name, case.head_dim, dtype_name, {}, baseline, error=f"{type(error).__name__}: {first}")
    return Parity(kernel_name, case.head_dim, dtype_name, errors, baseline)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.attention_parity", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", required=True, help="KERNEL:HEAD_DIM, comma-separated")
    parser.add_argument("--tiny", action="store_true", help=f"the segments {TINY_SEGMENTS}, 4/2 heads")
    args = parser.parse_args(argv)
    results = []
    for kernel, head_dim in (case.split(":") for case in args.cases.split(",")):
        case = Case(int(head_dim), TINY_SEGMENTS, 4, 2) if args.tiny else Case(int(head_dim))
        results.append(parity(kernel, case, getattr(torch, args.dtype), args.device))
    args.out.write_text(json.dumps([asdict(result) for result in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
