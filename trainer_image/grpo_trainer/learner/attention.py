"""Which kernel answers TRL's tree attention, per device, and the kernels themselves.

TRL 1.16 builds the learner's model with `attn_implementation="tree_fa3"`, whose attention calls
`packing._flash_attn().flash_attn_varlen_func(...)` (`trl/experimental/async_grpo/packing.py:159-201 (trl 1.16.0)`),
and `_flash_attn` downloads the FlashAttention-3 kernel from the hub at the first forward. That kernel runs on
compute capability 9.0 only, and a cluster that cannot reach the hub cannot get it at all. `install` puts the kernel
`choose_kernel` picks where TRL looks for it:

- `fa3`: the FlashAttention-3 hub kernel, loaded from a copy baked into the image (the trainer image's `FA3_KERNEL`
  build arg: a `kernels.lock` and the kernel files, read without the network). Hopper (sm90) only.
- `varlen`: torch's own varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention-2 in
  torch), on CUDA GPUs of compute capability 8.0 and up, except head dims above 192 on compute capability 8.6-8.9,
  where its backward has no kernel. Nothing to download.
- `sdpa`: per packed segment, torch's `scaled_dot_product_attention` with a bottom-right causal mask. Runs on any
  device (a CPU learner's only choice); on a GPU it is the slow way that always works.

`choose_kernel` is pure: the device's facts go in (`DeviceFacts`, read by `probe_device`) with the model's head dim
once it is known, the kernel and why come out, or AttentionUnavailable naming `learner.attention` when the requested
kernel cannot run here.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
import torch.nn.functional as F

from ..contract.codes import AttentionKernel

logger = logging.getLogger(__name__)

FA3_REPO = "kernels-community/flash-attn3"
#: Where the trainer image's `FA3_KERNEL=true` build puts the kernel's lock file (its files go to KERNELS_CACHE).
FA3_LOCKFILE_ENV = "GRPO_FA3_KERNEL_LOCK"
DEFAULT_FA3_LOCKFILE = "/opt/kernels/kernels.lock"
#: FlashAttention-3 is built for Hopper only (torch's own `torch/nn/attention/_fa3.py` refuses other majors).
FA3_CAPABILITY = (9, 0)
#: torch's flash attention (what varlen_attn runs) needs Ampere or newer.
VARLEN_MIN_CAPABILITY = (8, 0)
#: Compute capabilities 8.6-8.9 (Ampere's consumer and embedded parts, Ada) have too little shared memory for the
#: flash backward above this head dim. torch's SDPA refuses to train there (sdp_utils.cpp,
#: `check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89`: 192-224 always, above 224 with dropout), but
#: varlen_attn calls the flash kernels directly, past that guard. Everything above 192 is refused: the 256 kernel's
#: backward on these GPUs has not run here.
SMALL_SHARED_MEMORY_CAPABILITIES = ((8, 6), (8, 9))
VARLEN_BACKWARD_MAX_HEAD_DIM = 192
FLASH_DTYPES = (torch.float16, torch.bfloat16)


#: The `learner.attention` value that lets `choose_kernel` decide.
AUTO = "auto"


class AttentionUnavailable(ValueError):
    """The requested kernel cannot run on this device: one line naming `learner.attention`."""


@dataclass(frozen=True)
class DeviceFacts:
    device_type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability; None on CPU
    rocm: bool = False  # a ROCm build of torch: its "capability" is a gfx version, and the FA3 kernel is CUDA's
    fa3_kernel_present: bool = False  # the `kernels` package and a baked FA3 kernel, readable without the network


@dataclass(frozen=True)
class KernelChoice:
    kernel: AttentionKernel
    reason: str


def _fa3_blocker(facts: DeviceFacts) -> str | None:
    if facts.device_type != "cuda":
        return f"it needs a CUDA GPU and the learner runs on {facts.device_type}"
    if facts.rocm:
        return "it is a CUDA kernel and this torch is a ROCm build"
    if facts.capability != FA3_CAPABILITY:
        return f"it runs on compute capability 9.0 (Hopper) only, this GPU is {_sm(facts.capability)}"
    if not facts.fa3_kernel_present:
        return ("the kernel is not in this image (build the trainer image with --build-arg FA3_KERNEL=true; "
                "nothing is downloaded at run time)")
    return None


def _varlen_blocker(facts: DeviceFacts, head_dim: int | None) -> str | None:
    if facts.device_type != "cuda":
        return f"it needs a CUDA GPU and the learner runs on {facts.device_type}"
    if facts.rocm:
        return "it is not known to run on ROCm here"
    if facts.capability is None or facts.capability < VARLEN_MIN_CAPABILITY:
        return f"torch's flash attention needs compute capability 8.0 or newer, this GPU is {_sm(facts.capability)}"
    low, high = SMALL_SHARED_MEMORY_CAPABILITIES
    if head_dim is not None and head_dim > VARLEN_BACKWARD_MAX_HEAD_DIM and low <= facts.capability <= high:
        return (f"its backward has no kernel for the model's head dim {head_dim} on compute capability "
                f"{_sm(facts.capability)} (at most {VARLEN_BACKWARD_MAX_HEAD_DIM} on 8.6-8.9)")
    return None


def _sm(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"


def choose_kernel(requested: str, facts: DeviceFacts, head_dim: int | None = None) -> KernelChoice:
    """The tree-attention kernel for `requested` (`learner.attention`) on the device `facts` describe, for a model of
    attention head dim `head_dim` (None: not known yet, the device alone decides)."""
    blockers = {AttentionKernel.FA3: _fa3_blocker(facts), AttentionKernel.VARLEN: _varlen_blocker(facts, head_dim),
                AttentionKernel.SDPA: None}
    if requested != AUTO:
        kernel = AttentionKernel(requested)
        if blockers[kernel] is not None:
            raise AttentionUnavailable(f"learner.attention: {kernel.value} cannot run here: {blockers[kernel]}")
        return KernelChoice(kernel, "set by learner.attention")
    for kernel in (AttentionKernel.FA3, AttentionKernel.VARLEN):
        if blockers[kernel] is None:
            return KernelChoice(kernel, f"auto: {facts.device_type} compute capability {_sm(facts.capability)}")
    passed_over = "; ".join(f"{kernel.value}: {blockers[kernel]}"
                            for kernel in (AttentionKernel.FA3, AttentionKernel.VARLEN))
    return KernelChoice(AttentionKernel.SDPA, f"auto: {passed_over}")


def precision_problem(kernel: AttentionKernel, *, bf16: bool, fp16: bool, dtype: str | None) -> str | None:
    """Why `kernel` cannot run at the trainer's precision (flash kernels take float16/bfloat16 only), or None. TRL
    casts attention inputs to the autocast dtype (bf16/fp16) or else to the weights' dtype."""
    if kernel is AttentionKernel.SDPA or bf16 or fp16 or str(dtype) in ("bfloat16", "float16"):
        return None
    return (f"learner.attention: {kernel.value} computes in float16 or bfloat16, and training.extraArgs turn mixed "
            f"precision off with {dtype or 'float32'} weights: keep bf16 on, or set learner.attention: sdpa")


def model_head_dim(model_config: Any) -> int:
    """The attention head dim of a transformers config (a multimodal model's text config): its `head_dim`, else
    hidden size over heads."""
    text = model_config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


# --------------------------------------------------------------------------------------------------------------------
# Facts about this process's device
# --------------------------------------------------------------------------------------------------------------------
def fa3_lockfile() -> Path:
    return Path(os.environ.get(FA3_LOCKFILE_ENV, DEFAULT_FA3_LOCKFILE))


def fa3_kernel_present() -> bool:
    """The `kernels` package is installed and the image carries a locked FA3 kernel (its lock file)."""
    return importlib.util.find_spec("kernels") is not None and fa3_lockfile().is_file()


def probe_device(device_type: str, device_index: int | None = None) -> DeviceFacts:
    """This process's device: on CUDA, the GPU of its local rank (LOCAL_RANK, as accelerate sets it) unless named."""
    if device_type != "cuda":
        return DeviceFacts(device_type)
    if device_index is None:
        device_index = int(os.environ.get("LOCAL_RANK", "0"))
    capability = tuple(torch.cuda.get_device_capability(device_index)) if torch.cuda.is_available() else None
    return DeviceFacts("cuda", capability=capability, rocm=bool(torch.version.hip),
                       fa3_kernel_present=fa3_kernel_present())


# --------------------------------------------------------------------------------------------------------------------
# The kernels, each with FlashAttention's `flash_attn_varlen_func` contract: q (Tq, H, D), k/v (Tk, Hkv, D), segment
# i's queries are q[cu_q[i]:cu_q[i+1]] and its keys k[cu_k[i]:cu_k[i+1]]; causal is bottom-right aligned (a
# segment's queries are the tail of its keys: the shared prefix of a tree row is only in K/V).
# --------------------------------------------------------------------------------------------------------------------
class VarlenOptions(TypedDict, total=False):
    """The keyword arguments of `flash_attn_varlen_func` the kernels read (TRL passes these by keyword, after the
    seven positional ones); any other (FlashAttention's dropout_p, deterministic, ...) is ignored.

    softmax_scale: None is 1/sqrt(head dim). causal: True unless said otherwise. window_size: (left, right), (-1, -1)
    for none. softcap: None or 0 for none.
    """

    softmax_scale: float | None
    causal: bool
    window_size: tuple[int, int]
    softcap: float | None


def sdpa_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    **options: Unpack[VarlenOptions],
) -> torch.Tensor:
    """Per segment: GQA by repeat_interleave, a bottom-right causal mask, torch's SDPA. Any device."""
    softmax_scale, causal = options.get("softmax_scale"), options.get("causal", True)
    if tuple(options.get("window_size", (-1, -1))) != (-1, -1) or options.get("softcap"):
        raise NotImplementedError("the sdpa tree-attention kernel supports neither sliding windows nor softcap")
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
            # Query i sees keys up to (len_k - len_q + i).
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - q.shape[1])
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def torch_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    **options: Unpack[VarlenOptions],
) -> torch.Tensor:
    """FlashAttention's call answered by torch's varlen_attn. Its causal mask is the flash kernel's, bottom-right
    aligned (torch/nn/attention/bias.py says so of the same kernel), and it takes GQA as is (`enable_gqa`)."""
    from torch.nn.attention.varlen import varlen_attn

    if options.get("softcap"):
        raise NotImplementedError("torch's varlen attention has no softcap: set learner.attention: fa3 on Hopper")
    if query.dtype not in FLASH_DTYPES:
        raise AttentionUnavailable(f"learner.attention: varlen runs in float16 or bfloat16, the model computes "
                                   f"attention in {query.dtype}: train in bfloat16 or set learner.attention: sdpa")
    left, right = options.get("window_size", (-1, -1))
    if options.get("causal", True):
        right = 0  # (-1, 0) is causal, (W, 0) causal within a sliding window of W
    gqa = {"enable_gqa": query.shape[1] != key.shape[1]} if _takes_gqa_flag(varlen_attn) else {}
    return varlen_attn(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale=options.get("softmax_scale"), window_size=(left, right), **gqa)


def _takes_gqa_flag(varlen_attn: Any) -> bool:
    """Whether this torch's varlen_attn has `enable_gqa` (and refuses fewer K/V heads without it). Releases before
    it (torch 2.11 among them) have no such argument: their flash kernel takes fewer K/V heads as they are."""
    parameters = inspect.signature(varlen_attn).parameters.values()
    return any(p.name == "enable_gqa" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def load_fa3_kernel() -> Any:
    """The baked FA3 kernel module, read from the image's lock file and kernel cache (no network)."""
    from kernels import load_kernel

    return load_kernel(FA3_REPO, lockfile=fa3_lockfile())


class TreeAttentionKernel:
    """Stands where TRL expects the hub kernel module (`packing._flash_attn()`)."""

    def __init__(self, kernel: AttentionKernel):
        self.kernel = kernel
        self._fa3: Any = None

    def flash_attn_varlen_func(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.kernel is AttentionKernel.FA3:
            if self._fa3 is None:
                self._fa3 = load_fa3_kernel()
            return self._fa3.flash_attn_varlen_func(*args, **kwargs)
        if self.kernel is AttentionKernel.VARLEN:
            return torch_varlen_attention(*args, **kwargs)
        return sdpa_varlen_attention(*args, **kwargs)


_installed: TreeAttentionKernel | None = None


def install(kernel: AttentionKernel) -> None:
    """Make TRL's tree attention use `kernel` in this process (before the model's first forward)."""
    global _installed
    from trl.experimental.async_grpo import packing

    _installed = TreeAttentionKernel(kernel)
    packing._flash_attn = lambda: _installed
    logger.info("tree attention: %s", kernel.value)


def installed_kernel() -> AttentionKernel | None:
    return _installed.kernel if _installed is not None else None
