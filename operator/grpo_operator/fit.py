"""Will the run fit its GPUs? A memory estimate from the model's `config.json`, before any pod starts.

Pure but for `read_model_config`: the estimate is arithmetic on the model's shape and the spec, so `grporun validate`
and the operator say the same thing. What is counted (docs/cli.md, "Fit check", has the figures' sources):

- the learner, per GPU, under the spec's `learner.strategy`: under ddp every rank holds the whole model's training
  state, 16 bytes per parameter (TRL's async GRPO loads float32 weights and trains under bf16 autocast: fp32
  weights 4, gradients 4, Adam's two moments 8); under fsdp2 that state is sharded over the ranks, and with
  `learner.fsdp.cpuOffload` the shards live in CPU memory, the GPU holding only the layer being computed; with LoRA
  the base weights are frozen (4 bytes per parameter) and only the adapters train. Plus the activations of one row of
  `training.tokenBudget` tokens (gradient checkpointing, TRL's default: each layer's fp32 input, one layer
  recomputed in bf16, and the logits in bf16, their fp32 copy and its gradient) and the CUDA context.
- a rollout server, per GPU: the weights in the model's dtype over `tensorParallelSize` GPUs, and what is left of
  `gpuMemoryUtilization` of the GPU for vLLM's KV cache, in sequences of `maxModelLen` tokens.

A GPU's memory is known when the role's nodeSelector names the GPU with the label NVIDIA's GPU feature discovery
sets (`nvidia.com/gpu.memory` in MiB, or `nvidia.com/gpu.product`) or GKE's (`cloud.google.com/gke-accelerator`).
Past a known GPU's memory the check refuses with the numbers; an estimate past the largest common GPU when the GPU
is not named is a warning. Parameter counts follow the dense decoder layout (Llama, Qwen2/3, Mistral): attention
projections, a gated MLP, embeddings and the LM head; mixture-of-experts models are counted by their
`num_experts`/`num_local_experts` when they declare it. Biases and norms are left out (well under 1%).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .api import GRPORunSpec

GIB = 1024**3
#: fp32 weights + fp32 gradients + Adam's two fp32 moments.
TRAIN_STATE_BYTES_PER_PARAM = 16
#: A frozen float32 base under LoRA (TRL's async GRPO loads float32 weights).
FROZEN_BYTES_PER_PARAM = 4
#: CUDA context, cuBLAS workspaces and the allocator's slack of one training process.
CUDA_CONTEXT_BYTES = 1 * GIB
#: What vLLM keeps besides weights and KV cache (its profiled activations, CUDA graphs), per GPU.
VLLM_OVERHEAD_BYTES = 2 * GIB
#: The LoRA rank the way out is figured with (adapters on every attention and MLP projection).
WAY_OUT_LORA_RANK = 16
#: With the GPU not named: the memory of the largest common training GPU (H100/A100 80GB); an estimate past it is
#: a warning.
UNNAMED_GPU_BYTES = 80 * GIB
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

Strategy = Literal["ddp", "fsdp2"]

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB
GPU_PRODUCT_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator")
#: Products whose name does not carry their memory; checked in this order (L40S before L4), lower case.
KNOWN_GPU_GIB = (("h200", 141), ("h100", 80), ("l40s", 48), ("l40", 48), ("a100", 40), ("a10g", 24), ("a10", 24),
                 ("l4", 24), ("v100", 16), ("t4", 16))


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    layers: int
    vocab_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    experts: int = 1
    dtype_bytes: int = 2  # the checkpoint's dtype: what vLLM serves it in

    @property
    def layer_linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each linear projection of one decoder layer (q, k, v, o; gate, up, down per expert)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(h, q), (h, kv), (h, kv), (q, h)] + [(h, i), (h, i), (i, h)] * self.experts

    @property
    def parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.layer_linear_shapes)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings

    def lora_parameters(self, rank: int) -> int:
        return self.layers * sum(rank * (a + b) for a, b in self.layer_linear_shapes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


class ModelConfigError(ValueError):
    """A config.json without the shape the estimate needs."""


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The shape from a transformers `config.json` (a multimodal model's `text_config` when it has one)."""
    text = config.get("text_config") or config
    try:
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        shape = ModelShape(
            hidden_size=hidden,
            layers=layers,
            vocab_size=int(text["vocab_size"]),
            intermediate_size=int(text.get("moe_intermediate_size") or text["intermediate_size"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            experts=int(text.get("num_experts") or text.get("num_local_experts") or 1),
            dtype_bytes=DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2),
        )
    except KeyError as missing:
        raise ModelConfigError(f"config.json has no {missing.args[0]}") from None
    except (TypeError, ValueError) as error:
        raise ModelConfigError(f"config.json: {error}") from None
    return shape


# --------------------------------------------------------------------------------------------------------------------
# The estimates
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LearnerEstimate:
    strategy: Strategy
    ranks: int
    parameters: int
    state_bytes: int  # weights, gradients and optimizer state on one GPU
    activation_bytes: int
    tokens: int
    lora_rank: int | None = None
    host_bytes: int = 0  # the sharded training state one rank keeps in CPU memory (fsdp2 with cpuOffload)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + CUDA_CONTEXT_BYTES


def activation_bytes(shape: ModelShape, tokens: int) -> int:
    layer_inputs = shape.layers * shape.hidden_size * 4
    one_layer = (4 * shape.hidden_size + 3 * shape.intermediate_size) * 2
    logits = shape.vocab_size * (2 + 4 + 4)
    return tokens * (layer_inputs + one_layer + logits)


def learner_estimate(shape: ModelShape, *, tokens: int, strategy: Strategy = "ddp", ranks: int = 1,
                     lora_rank: int | None = None, cpu_offload: bool = False) -> LearnerEstimate:
    """Per-GPU memory of one learner rank (`cpu_offload` applies to fsdp2 only, as `learner.fsdp.cpuOffload`)."""
    parameters = shape.parameters
    if lora_rank is not None:
        state = parameters * FROZEN_BYTES_PER_PARAM + shape.lora_parameters(lora_rank) * TRAIN_STATE_BYTES_PER_PARAM
    else:
        state = parameters * TRAIN_STATE_BYTES_PER_PARAM
    if strategy == "fsdp2":
        # Each rank keeps its shard, and gathers one layer's full fp32 weights (and their gradients) at a time.
        layer = sum(a * b for a, b in shape.layer_linear_shapes) * 8
        shard = math.ceil(state / ranks)
        if cpu_offload:
            return LearnerEstimate(strategy, ranks, parameters, layer, activation_bytes(shape, tokens), tokens,
                                   lora_rank, host_bytes=shard)
        state = shard + layer
    return LearnerEstimate(strategy, ranks, parameters, state, activation_bytes(shape, tokens), tokens, lora_rank)


@dataclass(frozen=True)
class RolloutEstimate:
    weight_bytes: int  # per GPU
    kv_bytes_per_sequence: int  # per GPU, one sequence of max_model_len tokens
    max_model_len: int
    tensor_parallel_size: int

    def sequences(self, gpu_bytes: int, utilization: float) -> int:
        """Sequences of max_model_len tokens vLLM's KV cache holds (0: it cannot start)."""
        room = gpu_bytes * utilization - self.weight_bytes - VLLM_OVERHEAD_BYTES
        return max(0, int(room // self.kv_bytes_per_sequence))


def rollout_estimate(shape: ModelShape, *, max_model_len: int, tensor_parallel_size: int = 1) -> RolloutEstimate:
    return RolloutEstimate(
        weight_bytes=math.ceil(shape.parameters * shape.dtype_bytes / tensor_parallel_size),
        kv_bytes_per_sequence=math.ceil(shape.kv_bytes_per_token * max_model_len / tensor_parallel_size),
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
    )


# --------------------------------------------------------------------------------------------------------------------
# Which GPU
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    bytes: int
    named_by: str  # `nodeSelector[label]=value`, for the message


def gpu_of(node_selector: Mapping[str, str] | None) -> Gpu | None:
    """The GPU a role's nodeSelector names, when it names one this module knows."""
    selector = node_selector or {}
    memory = str(selector.get(GPU_MEMORY_LABEL, ""))
    if memory.isdigit():
        return Gpu(int(memory) * 1024**2, f"nodeSelector {GPU_MEMORY_LABEL}={memory}")
    for label in GPU_PRODUCT_LABELS:
        product = selector.get(label)
        if not product:
            continue
        named_by = f"nodeSelector {label}={product}"
        sized = re.search(r"(\d+)\s*gb", product, re.I)
        if sized:
            return Gpu(int(sized[1]) * GIB, named_by)
        for name, gib in KNOWN_GPU_GIB:
            if name in product.lower():
                return Gpu(gib * GIB, named_by)
    return None


def gpus_requested(resources: Mapping[str, Any] | None) -> int:
    for section in ("limits", "requests"):
        value = ((resources or {}).get(section) or {}).get("nvidia.com/gpu")
        if value is not None and str(value).isdigit():
            return int(value)
    return 0


# --------------------------------------------------------------------------------------------------------------------
# The verdict, one line per problem
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitReport:
    errors: list[str]  # past a known GPU's memory: the run cannot start
    warnings: list[str]  # likely past it
    notes: list[str]  # the estimates themselves, or why the check was skipped


def _gib(size: float) -> str:
    return f"{size / GIB:.0f} GiB" if size >= 10 * GIB else f"{size / GIB:.1f} GiB"


def _billions(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def _learner_breakdown(estimate: LearnerEstimate) -> str:
    if estimate.lora_rank is not None:
        state = f"{_gib(estimate.state_bytes)} frozen fp32 weights and rank-{estimate.lora_rank} LoRA training state"
    else:
        state = f"{_gib(estimate.state_bytes)} fp32 weights, gradients and Adam states"
    sharded = f" sharded over {estimate.ranks} ranks" if estimate.strategy == "fsdp2" else ""
    if estimate.host_bytes:
        state = (f"one layer's gathered weights and gradients ({_gib(estimate.state_bytes)}; the "
                 f"{_gib(estimate.host_bytes)} shard of each rank is offloaded to CPU memory)")
        sharded = ""
    return (f"{_billions(estimate.parameters)} parameters: {state}{sharded} + {_gib(estimate.activation_bytes)} "
            f"activations of a {estimate.tokens}-token row + {_gib(CUDA_CONTEXT_BYTES)} CUDA context")


def ways_out(shape: ModelShape, *, tokens: int, gpu_bytes: int, ranks: int = 1) -> str:
    """FSDP2 (learner.strategy fsdp2) over the fewest GPUs that fit, FSDP2 with its CPU offload on the run's own
    GPUs, and LoRA, each where it fits, with their per-GPU figures."""
    options = []
    for sharded_over in (2, 4, 8, 16, 32, 64):
        if sharded_over <= ranks:
            continue  # already that many (or more) ranks: only more of them would shard further
        sharded = learner_estimate(shape, tokens=tokens, strategy="fsdp2", ranks=sharded_over)
        if sharded.total_bytes <= gpu_bytes:
            options.append(f"FSDP2 over {sharded_over} GPUs (~{_gib(sharded.total_bytes)} each)")
            break
    offloaded = learner_estimate(shape, tokens=tokens, strategy="fsdp2", ranks=ranks, cpu_offload=True)
    if offloaded.total_bytes <= gpu_bytes:
        options.append(f"FSDP2 with learner.fsdp.cpuOffload on {ranks} GPU{'s' if ranks > 1 else ''} "
                       f"(~{_gib(offloaded.total_bytes)} per GPU, {_gib(offloaded.host_bytes)} of CPU memory per rank)")
    lora = learner_estimate(shape, tokens=tokens, lora_rank=WAY_OUT_LORA_RANK)
    if lora.total_bytes <= gpu_bytes:
        options.append(f"LoRA adapters, rank {WAY_OUT_LORA_RANK} (~{_gib(lora.total_bytes)})")
    if not options:
        return "; neither FSDP2 over 64 GPUs nor LoRA fits it: a GPU with more memory"
    return "; ways out: " + " or ".join(options)


@dataclass(frozen=True)
class LearnerFit:
    """What of spec.learner (and the training it runs) decides whether a learner rank fits its GPU."""

    device: str
    ranks: int
    resources: Mapping | None
    node_selector: Mapping[str, str] | None
    tokens: int  # the longest row a rank trains on
    strategy: Strategy = "ddp"
    lora_rank: int | None = None
    cpu_offload: bool = False


@dataclass(frozen=True)
class RolloutFit:
    """What of spec.rollout decides whether a rollout server fits its GPU."""

    device: str
    node_selector: Mapping[str, str] | None
    max_model_len: int
    tensor_parallel_size: int
    gpu_memory_utilization: float


def check_fit(shape: ModelShape, learner: LearnerFit, rollout: RolloutFit) -> FitReport:
    errors: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []
    if learner.device == "cuda":
        estimate = learner_estimate(shape, tokens=learner.tokens, strategy=learner.strategy, ranks=learner.ranks,
                                    lora_rank=learner.lora_rank, cpu_offload=learner.cpu_offload)
        need = (f"the learner needs ~{_gib(estimate.total_bytes)} per GPU under {learner.strategy} "
                f"({_learner_breakdown(estimate)})")
        gpu = gpu_of(learner.node_selector) if gpus_requested(learner.resources) else None
        if gpu is not None and estimate.state_bytes + CUDA_CONTEXT_BYTES > gpu.bytes:
            errors.append(f"spec.learner: {need}, more than the {_gib(gpu.bytes)} of its GPU ({gpu.named_by})"
                          + ways_out(shape, tokens=learner.tokens, gpu_bytes=gpu.bytes, ranks=learner.ranks))
        elif gpu is not None and estimate.total_bytes > gpu.bytes:
            warnings.append(f"spec.learner: {need}, more than the {_gib(gpu.bytes)} of its GPU ({gpu.named_by}) "
                            "once the activations are counted"
                            + ways_out(shape, tokens=learner.tokens, gpu_bytes=gpu.bytes, ranks=learner.ranks))
        elif gpu is None and estimate.total_bytes > UNNAMED_GPU_BYTES:
            warnings.append(f"spec.learner: {need}, more than an 80 GB GPU holds; name the GPU in "
                            f"spec.learner.nodeSelector ({GPU_PRODUCT_LABELS[0]}) to check it"
                            + ways_out(shape, tokens=learner.tokens, gpu_bytes=UNNAMED_GPU_BYTES, ranks=learner.ranks))
        else:
            notes.append(f"spec.learner: {need}" + (f", within the {_gib(gpu.bytes)} of its GPU" if gpu else ""))
    if rollout.device == "cuda":
        server = rollout_estimate(shape, max_model_len=rollout.max_model_len,
                                  tensor_parallel_size=rollout.tensor_parallel_size)
        need = (f"a rollout server needs {_gib(server.weight_bytes)} of weights per GPU (tensorParallelSize "
                f"{rollout.tensor_parallel_size}) and {_gib(server.kv_bytes_per_sequence)} of KV cache per "
                f"{rollout.max_model_len}-token sequence")
        gpu = gpu_of(rollout.node_selector)
        if gpu is None:
            notes.append(f"spec.rollout.vllm: {need}")
        elif (sequences := server.sequences(gpu.bytes, rollout.gpu_memory_utilization)) == 0:
            errors.append(f"spec.rollout.vllm: {need}, and {rollout.gpu_memory_utilization:g} of its GPU "
                          f"({_gib(gpu.bytes)}, {gpu.named_by}) leaves no room for one sequence: raise "
                          "gpuMemoryUtilization or tensorParallelSize, or lower maxModelLen")
        else:
            notes.append(f"spec.rollout.vllm: {need}; {rollout.gpu_memory_utilization:g} of its GPU "
                         f"({_gib(gpu.bytes)}) holds ~{sequences} such sequences")
    return FitReport(errors, warnings, notes)


# --------------------------------------------------------------------------------------------------------------------
# The model's config.json (the only I/O here)
# --------------------------------------------------------------------------------------------------------------------
def read_model_config(model: str, base_dir: str | os.PathLike[str] | None = None) -> tuple[dict | None, str]:
    """(config.json as a dict, "") for a model that is a local directory; (None, why not) otherwise. A relative
    path is taken from `base_dir` (a manifest's folder). Nothing is fetched: a hub id is skipped."""
    expanded = os.path.expanduser(model)
    path = Path(base_dir or ".") / expanded if not os.path.isabs(expanded) else Path(expanded)
    config = path / "config.json"
    if not path.is_dir():
        if model.startswith(("/", "./", "../", "~")):
            return None, f"spec.model {model}: no such directory here"
        return None, f"spec.model {model} is a hub id, and its config.json is read only from a local path"
    try:
        return json.loads(config.read_text()), ""
    except (OSError, ValueError) as error:
        return None, f"spec.model {model}: cannot read config.json ({error})"


def check_spec_fit(spec: GRPORunSpec, config: Mapping[str, Any]) -> FitReport:
    """The check for a run: its model's config.json and its spec (the learner's strategy, ranks and LoRA as
    `grpo_trainer.contract.launch` and the learner apply them)."""
    learner, rollout = spec.learner, spec.rollout
    lora = spec.training.lora
    return check_fit(
        model_shape(config),
        LearnerFit(device=learner.device, ranks=spec.learner_world_size, resources=learner.resources,
                   node_selector=learner.node_selector, strategy=learner.strategy,
                   lora_rank=lora.r if lora is not None else None, cpu_offload=learner.fsdp.cpu_offload,
                   tokens=spec.training.token_budget or rollout.vllm.max_model_len),
        RolloutFit(device=rollout.device, node_selector=rollout.node_selector,
                   max_model_len=rollout.vllm.max_model_len, tensor_parallel_size=rollout.vllm.tensor_parallel_size,
                   gpu_memory_utilization=rollout.vllm.gpu_memory_utilization),
    )


def operator_check(spec: GRPORunSpec) -> tuple[FitReport, str]:
    """The operator's check before a run's pods start: (the report, why it was skipped or ""). The operator reads
    a model's config.json only where its own filesystem has the path (a hub id or a volume only the pods mount is
    skipped, and said so); a CPU run is not checked."""
    if spec.learner.device != "cuda" and spec.rollout.device != "cuda":
        return FitReport([], [], []), ""
    config, why = read_model_config(spec.model) if os.path.isabs(os.path.expanduser(spec.model)) else (
        None, f"spec.model {spec.model} is a hub id, and its config.json is read only from a local path")
    if config is None:
        return FitReport([], [], []), why
    try:
        return check_spec_fit(spec, config), ""
    except ModelConfigError as error:
        return FitReport([], [], []), f"spec.model {spec.model}: {error}"
