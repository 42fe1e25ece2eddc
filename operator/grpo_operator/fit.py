"""Will the run fit its GPUs and its learner pod's memory? An estimate from the model's `config.json`, before any pod
starts.

Pure: the model's config.json (grpo_operator.model_config reads it, from a directory or the hub) and the nodes the
run's pods may land on (the cluster's GPU nodes, which grpo_operator.cluster.fit_check reads) come in as values, so
`grporun validate` and the operator say the same thing. What is counted (docs/cli.md, "Fit check", has the figures'
sources):

- the learner, per GPU, under the spec's `learner.strategy`. ddp: every rank holds the whole training state, 16
  bytes per parameter (TRL's async GRPO loads float32 weights and trains under bf16 autocast: fp32 weights 4,
  gradients 4, Adam's two moments 8) and, over several ranks, DDP's gradient buckets: another 4 bytes per trained
  parameter (accelerate leaves `gradient_as_bucket_view` off, so the buckets are a copy). fsdp2: that state sharded
  over the ranks (on one rank, nothing is sharded), plus the modules gathered whole in bf16 with their bf16
  gradients: two decoder layers (the one computing and the one prefetched) and the root's embeddings and head, which
  FSDP2 keeps gathered from forward through backward; with `learner.fsdp.cpuOffload` the shards live in CPU memory.
  With LoRA the base weights are frozen (4 bytes per parameter) and only the adapters train. Plus the activations of
  one row of `training.tokenBudget` tokens (gradient checkpointing, TRL's default: each layer's fp32 input, one layer
  recomputed in bf16, and the logits in bf16, their fp32 copy and its gradient) and the CUDA context.
- the learner pod that holds rank 0, in CPU memory, against its memory limit: the whole model in fp32 as it loads
  (ddp: each of the pod's processes loads its own copy; fsdp2: rank 0 alone, the other ranks get their shards from
  it), which rank 0 holds again later, one copy at a time: to consolidate the final model, and under fsdp2 to gather
  it for an NCCL weight sync; the offloaded shards of the pod's ranks; and each process's own memory.
- a rollout server, per GPU: the weights in the model's dtype over `tensorParallelSize` GPUs, and what is left of
  `gpuMemoryUtilization` of the GPU for vLLM's KV cache, in sequences of `maxModelLen` tokens.

A role's GPU is the one its nodeSelector names, with the labels NVIDIA's GPU feature discovery puts on nodes
(`nvidia.com/gpu.memory` in MiB, or `nvidia.com/gpu.product`) or GKE's (`cloud.google.com/gke-accelerator`); else
those of the nodes it can land on (grpo_operator.placement), read from the same labels. Past the GPU's memory,
activations included, or past the learner pod's memory limit, the check refuses with the numbers (`spec.fitCheck:
warn` makes that a warning). Past the smaller of several GPUs the role may land on, or past 80 GB with no GPU
known, it warns. A learner past its GPU or its pod is offered only the ways out that pass this same check.

Parameter counts follow the dense decoder layout (Llama, Qwen2/3, Mistral): attention projections, a gated MLP,
embeddings and the LM head; mixture-of-experts models are counted by their `num_experts`/`num_local_experts` when
they declare it. Biases and norms are left out (well under 1%).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .placement import Node, Placement

if TYPE_CHECKING:
    from .api import FitPolicy, GRPORunSpec, RolePodSpec

GIB = 1024**3
MIB = 1024**2
#: fp32 weights + fp32 gradients + Adam's two fp32 moments.
TRAIN_STATE_BYTES_PER_PARAM = 16
#: A frozen float32 base under LoRA (TRL's async GRPO loads float32 weights).
FROZEN_BYTES_PER_PARAM = 4
#: DDP's gradient buckets over several ranks: a second fp32 copy of the trained parameters' gradients.
DDP_BUCKET_BYTES_PER_PARAM = 4
#: A module FSDP2 gathers whole: its bf16 weights and its unsharded bf16 gradients (accelerate's bf16 policy).
GATHERED_BYTES_PER_PARAM = 4
#: Decoder layers FSDP2 holds gathered at once: the one computing and the next, prefetched.
GATHERED_LAYERS = 2
#: The whole model in CPU memory, in float32: as a process loads it, and as rank 0 consolidates or gathers it.
HOST_WEIGHT_BYTES_PER_PARAM = 4
#: A training process's own CPU memory besides the model: Python, torch and CUDA's host side, the dataset.
PROCESS_HOST_BYTES = 3 * GIB
#: CUDA context, cuBLAS workspaces and the allocator's slack of one training process.
CUDA_CONTEXT_BYTES = 1 * GIB
#: What vLLM keeps besides weights and KV cache (its profiled activations, CUDA graphs), per GPU.
VLLM_OVERHEAD_BYTES = 2 * GIB
#: The LoRA rank the way out is figured with (adapters on every attention and MLP projection).
WAY_OUT_LORA_RANK = 16
#: The most learner ranks a way out asks for.
WAY_OUT_MAX_RANKS = 64
#: With the GPU not known: the memory of the largest common training GPU (H100/A100 80GB); an estimate past it is
#: a warning.
UNNAMED_GPU_BYTES = 80 * GIB
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

Strategy = Literal["ddp", "fsdp2"]

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # GPU feature discovery
GPU_PRODUCT_LABELS = (GPU_PRODUCT_LABEL, "cloud.google.com/gke-accelerator")
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
    def layer_parameters(self) -> int:
        return sum(a * b for a, b in self.layer_linear_shapes)

    @property
    def embedding_parameters(self) -> int:
        """The input embeddings and the LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_parameters + self.embedding_parameters

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
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise ModelConfigError(f"config.json: {error}") from None
    return shape


# --------------------------------------------------------------------------------------------------------------------
# What of the spec decides the fit
# --------------------------------------------------------------------------------------------------------------------
def gpus_requested(resources: Mapping[str, Any] | None) -> int:
    for section in ("limits", "requests"):
        value = ((resources or {}).get(section) or {}).get("nvidia.com/gpu")
        if value is not None and str(value).isdigit():
            return int(value)
    return 0


def memory_limit(resources: Mapping[str, Any] | None) -> int | None:
    """A container's `resources.limits.memory` in bytes; None when it has none (or none this can read)."""
    quantity = ((resources or {}).get("limits") or {}).get("memory")
    if quantity is None:
        return None
    from kubernetes.utils.quantity import parse_quantity  # the client's own parser; slow to import, so only here

    try:
        return int(parse_quantity(quantity))
    except (ValueError, TypeError, ArithmeticError):
        return None


@dataclass(frozen=True)
class LearnerFit:
    """What of spec.learner (and the training it runs) decides whether a learner rank fits its GPU and its pod."""

    device: str
    tokens: int  # the longest row a rank trains on
    nodes: int = 1
    processes_per_node: int = 1
    resources: Mapping[str, Any] | None = None
    placement: Placement = Placement()
    strategy: Strategy = "ddp"
    lora_rank: int | None = None
    cpu_offload: bool = False

    @property
    def ranks(self) -> int:
        return self.nodes * self.processes_per_node


@dataclass(frozen=True)
class RolloutFit:
    """What of spec.rollout decides whether a rollout server fits its GPU."""

    device: str
    max_model_len: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    placement: Placement = Placement()


# --------------------------------------------------------------------------------------------------------------------
# The estimates
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LearnerEstimate:
    """One learner rank's GPU memory."""

    strategy: Strategy
    ranks: int
    parameters: int
    state_bytes: int  # weights, gradients and optimizer state on the GPU (this rank's shard under fsdp2)
    activation_bytes: int
    tokens: int
    lora_rank: int | None = None
    bucket_bytes: int = 0  # ddp over several ranks: the gradient buckets
    gathered_bytes: int = 0  # fsdp2: the modules gathered whole, with their gradients
    offloaded_bytes: int = 0  # fsdp2 with cpuOffload: this rank's shard, in CPU memory instead

    @property
    def total_bytes(self) -> int:
        return (self.state_bytes + self.bucket_bytes + self.gathered_bytes + self.activation_bytes
                + CUDA_CONTEXT_BYTES)


def activation_bytes(shape: ModelShape, tokens: int) -> int:
    layer_inputs = shape.layers * shape.hidden_size * 4
    one_layer = (4 * shape.hidden_size + 3 * shape.intermediate_size) * 2
    logits = shape.vocab_size * (2 + 4 + 4)
    return tokens * (layer_inputs + one_layer + logits)


def learner_estimate(shape: ModelShape, learner: LearnerFit) -> LearnerEstimate:
    """Per-GPU memory of one learner rank (`cpu_offload` applies to fsdp2 only, as `learner.fsdp.cpuOffload`)."""
    parameters = shape.parameters
    if learner.lora_rank is not None:
        trained = shape.lora_parameters(learner.lora_rank)
        state = parameters * FROZEN_BYTES_PER_PARAM + trained * TRAIN_STATE_BYTES_PER_PARAM
    else:
        trained, state = parameters, parameters * TRAIN_STATE_BYTES_PER_PARAM
    common = dict(strategy=learner.strategy, ranks=learner.ranks, parameters=parameters,
                  activation_bytes=activation_bytes(shape, learner.tokens), tokens=learner.tokens,
                  lora_rank=learner.lora_rank)
    if learner.strategy == "ddp":
        buckets = trained * DDP_BUCKET_BYTES_PER_PARAM if learner.ranks > 1 else 0  # one process: no DDP wrapper
        return LearnerEstimate(state_bytes=state, bucket_bytes=buckets, **common)
    shard = math.ceil(state / learner.ranks)
    gathered = (min(GATHERED_LAYERS, shape.layers) * shape.layer_parameters
                + shape.embedding_parameters) * GATHERED_BYTES_PER_PARAM
    if learner.cpu_offload:
        return LearnerEstimate(state_bytes=0, gathered_bytes=gathered, offloaded_bytes=shard, **common)
    return LearnerEstimate(state_bytes=shard, gathered_bytes=gathered, **common)


@dataclass(frozen=True)
class HostEstimate:
    """The CPU memory of the learner pod that holds rank 0."""

    processes: int
    weight_copies: int  # whole fp32 copies of the model held at once
    weight_bytes: int
    offloaded_bytes: int  # the offloaded shards of the pod's ranks
    process_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.offloaded_bytes + self.process_bytes


def host_estimate(shape: ModelShape, learner: LearnerFit, estimate: LearnerEstimate) -> HostEstimate:
    processes = learner.processes_per_node
    copies = processes if learner.strategy == "ddp" else 1
    return HostEstimate(processes=processes, weight_copies=copies,
                        weight_bytes=copies * shape.parameters * HOST_WEIGHT_BYTES_PER_PARAM,
                        offloaded_bytes=processes * estimate.offloaded_bytes,
                        process_bytes=processes * PROCESS_HOST_BYTES)


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
    named_by: str  # where it was read, for the message: `nodeSelector label=value`, or the nodes' label


def gpu_named_by(labels: Mapping[str, str]) -> tuple[int, str] | None:
    """(bytes, `label=value`) of the GPU these labels (a nodeSelector's or a node's) name, when this module knows it."""
    memory = str(labels.get(GPU_MEMORY_LABEL, ""))
    if memory.isdigit():
        return int(memory) * MIB, f"{GPU_MEMORY_LABEL}={memory}"
    for label in GPU_PRODUCT_LABELS:
        product = labels.get(label)
        if not product:
            continue
        sized = re.search(r"(\d+)\s*gb", product, re.I)
        if sized:
            return int(sized[1]) * GIB, f"{label}={product}"
        for name, gib in KNOWN_GPU_GIB:
            if name in product.lower():
                return gib * GIB, f"{label}={product}"
    return None


def gpu_of(node_selector: Mapping[str, str] | None) -> Gpu | None:
    """The GPU a role's nodeSelector names, when it names one this module knows."""
    named = gpu_named_by(node_selector or {})
    return Gpu(named[0], f"nodeSelector {named[1]}") if named else None


def gpus_for(placement: Placement, nodes: Sequence[Node] | None) -> list[Gpu]:
    """The GPUs a pod placed so may get, smallest first: the one its nodeSelector names, else those of the `nodes`
    it can land on (by their labels); [] when neither says."""
    named = gpu_of(placement.node_selector)
    if named is not None:
        return [named]
    landing: dict[int, tuple[str, int]] = {}  # bytes -> (the first node's label=value, how many nodes)
    for node in nodes or ():
        found = gpu_named_by(node.labels) if placement.admits(node) else None
        if found is not None:
            label, count = landing.get(found[0], (found[1], 0))
            landing[found[0]] = (label, count + 1)
    return [Gpu(size, f"{label} on the {count} node{'s' * (count > 1)} it can land on")
            for size, (label, count) in sorted(landing.items())]


# --------------------------------------------------------------------------------------------------------------------
# The verdict, one line per problem
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Misfit:
    field: str  # the spec field the line names
    text: str
    sure: bool  # past a known GPU's or pod's memory: refused (spec.fitCheck refuse); else a warning

    @property
    def line(self) -> str:
        return f"{self.field}: {self.text}"


@dataclass(frozen=True)
class WayOut:
    """A change to the learner the check offers, with the learner it makes, already checked the same way."""

    change: str
    learner: LearnerFit
    estimate: LearnerEstimate
    host: HostEstimate


@dataclass(frozen=True)
class FitReport:
    errors: list[str]  # past a known GPU's or the pod's memory: the run cannot start
    warnings: list[str]  # likely past it (or past it, with spec.fitCheck warn)
    notes: list[str]  # the estimates themselves, or why the check was skipped
    ways_out: tuple[WayOut, ...] = ()  # offered to a learner past its GPU or its pod


def _gib(size: float) -> str:
    if size < GIB / 10:
        return f"{size / MIB:.0f} MiB"
    return f"{size / GIB:.0f} GiB" if size >= 10 * GIB else f"{size / GIB:.1f} GiB"


def _billions(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def _plural(count: int, word: str, many: str | None = None) -> str:
    return f"{count} {word if count == 1 else many or word + 's'}"


def _learner_breakdown(estimate: LearnerEstimate) -> str:
    if estimate.lora_rank is not None:
        state = f"{_gib(estimate.state_bytes)} frozen fp32 weights and rank-{estimate.lora_rank} LoRA training state"
    else:
        state = f"{_gib(estimate.state_bytes)} fp32 weights, gradients and Adam states"
    if estimate.strategy == "fsdp2":
        state += f" sharded over {estimate.ranks} ranks" if estimate.ranks > 1 else " (one rank: not sharded)"
        if estimate.offloaded_bytes:
            state = (f"the {_gib(estimate.offloaded_bytes)} shard of weights, gradients and Adam states offloaded to "
                     "CPU memory")
        state += f" + {_gib(estimate.gathered_bytes)} of modules gathered whole in bf16 with their gradients"
    if estimate.bucket_bytes:
        state += f" + {_gib(estimate.bucket_bytes)} DDP gradient buckets"
    return (f"{_billions(estimate.parameters)} parameters: {state} + {_gib(estimate.activation_bytes)} "
            f"activations of a {estimate.tokens}-token row + {_gib(CUDA_CONTEXT_BYTES)} CUDA context")


def _host_breakdown(host: HostEstimate, strategy: Strategy) -> str:
    if strategy == "ddp":
        loads = (f"{_gib(host.weight_bytes)} fp32 weights, loaded by each of its "
                 f"{_plural(host.processes, 'process', 'processes')}" if host.processes > 1 else
                 f"{_gib(host.weight_bytes)} fp32 weights as its process loads them")
    else:
        loads = (f"{_gib(host.weight_bytes)} fp32 weights on rank 0, as it loads them, consolidates the final model "
                 "and gathers it for a weight sync")
    offloaded = f" + {_gib(host.offloaded_bytes)} offloaded shards" if host.offloaded_bytes else ""
    whose = "its process's" if host.processes == 1 else f"its {host.processes} processes'"
    return f"{loads}{offloaded} + {_gib(host.process_bytes)} for {whose} own memory"


def _learner_misfits(shape: ModelShape, learner: LearnerFit, gpus: list[Gpu]) -> tuple[list[Misfit], list[str]]:
    """(what is past the learner's GPU or its pod's memory, the estimates that fit) for one learner."""
    estimate = learner_estimate(shape, learner)
    host = host_estimate(shape, learner, estimate)
    misfits: list[Misfit] = []
    notes: list[str] = []
    need = (f"the learner needs ~{_gib(estimate.total_bytes)} per GPU under {learner.strategy} "
            f"({_learner_breakdown(estimate)})")
    if gpus and estimate.total_bytes > gpus[-1].bytes:
        misfits.append(Misfit("spec.learner", f"{need}, more than the {_gib(gpus[-1].bytes)} of its GPU "
                                              f"({gpus[-1].named_by})", sure=True))
    elif gpus and estimate.total_bytes > gpus[0].bytes:
        fits = next(gpu for gpu in gpus if estimate.total_bytes <= gpu.bytes)
        misfits.append(Misfit("spec.learner", f"{need}, more than the {_gib(gpus[0].bytes)} of a GPU it may land on "
                                              f"({gpus[0].named_by}), though within the {_gib(fits.bytes)} of "
                                              f"{fits.named_by}: narrow spec.learner.nodeSelector to those nodes",
                              sure=False))
    elif not gpus and estimate.total_bytes > UNNAMED_GPU_BYTES:
        misfits.append(Misfit("spec.learner", f"{need}, more than an 80 GB GPU holds; its GPU is not known: name it "
                                              f"in spec.learner.nodeSelector ({GPU_PRODUCT_LABEL}) to check it",
                              sure=False))
    else:
        notes.append(f"spec.learner: {need}"
                     + (f", within the {_gib(gpus[0].bytes)} of its GPU ({gpus[0].named_by})" if gpus else ""))
    limit = memory_limit(learner.resources)
    host_need = (f"the learner pod of rank 0 needs ~{_gib(host.total_bytes)} of CPU memory "
                 f"({_host_breakdown(host, learner.strategy)})")
    if limit is not None and host.total_bytes > limit:
        misfits.append(Misfit("spec.learner.resources.limits.memory",
                              f"{host_need}, more than its memory limit of {_gib(limit)}", sure=True))
    else:
        notes.append(f"spec.learner.resources: {host_need}"
                     + (f", within its memory limit of {_gib(limit)}" if limit is not None else ""))
    return misfits, notes


def ways_out(shape: ModelShape, learner: LearnerFit, gpus: list[Gpu]) -> tuple[WayOut, ...]:
    """The changes to the learner that pass this same check on the same GPUs, in this order: fsdp2 on the run's own
    ranks; else fsdp2 over the fewest more ranks (more learner nodes) that pass, and fsdp2 with its CPU offload on
    the run's own ranks; then, for a learner that trains every weight, LoRA adapters under its own strategy. A LoRA
    learner keeps its adapters on every way out. fsdp2 on one rank shards nothing, so it is never offered."""

    def passing(change: str, candidate: LearnerFit) -> WayOut | None:
        if candidate == learner or _learner_misfits(shape, candidate, gpus)[0]:
            return None
        estimate = learner_estimate(shape, candidate)
        return WayOut(change, candidate, estimate, host_estimate(shape, candidate, estimate))

    sharded = dataclasses.replace(learner, strategy="fsdp2", cpu_offload=False)
    offered: list[WayOut | None] = []
    own = passing(f"learner.strategy fsdp2 on its {learner.ranks} GPUs", sharded) if learner.ranks > 1 else None
    offered.append(own)
    if own is None:
        more_nodes = range(learner.nodes + 1, WAY_OUT_MAX_RANKS // learner.processes_per_node + 1)
        offered.append(next(filter(None, (
            passing(f"learner.strategy fsdp2 over {nodes * learner.processes_per_node} GPUs (learner.nodes "
                    f"{nodes})", dataclasses.replace(sharded, nodes=nodes)) for nodes in more_nodes)), None))
        offered.append(passing(f"learner.strategy fsdp2 with learner.fsdp.cpuOffload on its "
                               f"{_plural(learner.ranks, 'GPU')}", dataclasses.replace(sharded, cpu_offload=True)))
    if learner.lora_rank is None:
        lora = dataclasses.replace(learner, lora_rank=WAY_OUT_LORA_RANK)
        offered.append(passing(f"LoRA adapters (training.lora, rank {WAY_OUT_LORA_RANK}) under learner.strategy "
                               f"{learner.strategy}", lora))
    return tuple(way for way in offered if way is not None)


def _ways_out_text(ways: tuple[WayOut, ...], misfit: Misfit) -> str:
    if not ways:
        remedy = "a GPU with more memory" if misfit.field == "spec.learner" else "a higher memory limit"
        return (f"; no way out passes this check (fsdp2 over up to {WAY_OUT_MAX_RANKS} GPUs, its CPU offload, LoRA): "
                f"{remedy}")
    described = [f"{way.change} (~{_gib(way.estimate.total_bytes)} per GPU"
                 + (f", ~{_gib(way.host.total_bytes)} of the pod's CPU memory" if way.estimate.offloaded_bytes else "")
                 + ")" for way in ways]
    return "; ways out, each estimated the same way: " + " or ".join(described)


def _rollout_misfits(shape: ModelShape, rollout: RolloutFit, gpus: list[Gpu]) -> tuple[list[Misfit], list[str]]:
    server = rollout_estimate(shape, max_model_len=rollout.max_model_len,
                              tensor_parallel_size=rollout.tensor_parallel_size)
    need = (f"a rollout server needs {_gib(server.weight_bytes)} of weights per GPU (tensorParallelSize "
            f"{rollout.tensor_parallel_size}) and {_gib(server.kv_bytes_per_sequence)} of KV cache per "
            f"{rollout.max_model_len}-token sequence")
    utilization = rollout.gpu_memory_utilization
    if not gpus:
        return [], [f"spec.rollout.vllm: {need}"]
    smallest, largest = gpus[0], gpus[-1]
    way_out = "raise gpuMemoryUtilization or tensorParallelSize, or lower maxModelLen"
    if server.sequences(largest.bytes, utilization) == 0:
        return [Misfit("spec.rollout.vllm", f"{need}, and {utilization:g} of its GPU ({_gib(largest.bytes)}, "
                                            f"{largest.named_by}) leaves no room for one sequence: {way_out}",
                       sure=True)], []
    if (sequences := server.sequences(smallest.bytes, utilization)) == 0:
        return [Misfit("spec.rollout.vllm", f"{need}, and {utilization:g} of a GPU it may land on "
                                            f"({_gib(smallest.bytes)}, {smallest.named_by}) leaves no room for one "
                                            f"sequence: narrow spec.rollout.nodeSelector, or {way_out}",
                       sure=False)], []
    return [], [f"spec.rollout.vllm: {need}; {utilization:g} of its GPU ({_gib(smallest.bytes)}, "
                f"{smallest.named_by}) holds ~{sequences} such sequences"]


def check_fit(shape: ModelShape, learner: LearnerFit, rollout: RolloutFit, nodes: Sequence[Node] | None = None,
              policy: FitPolicy = "refuse") -> FitReport:
    """The verdict for a run's learner and rollout servers. `nodes`: the cluster's GPU nodes (None: not known), for
    a role whose nodeSelector does not name its GPU."""
    misfits: list[Misfit] = []
    notes: list[str] = []
    offered: tuple[WayOut, ...] = ()
    if learner.device == "cuda":
        gpus = gpus_for(learner.placement, nodes) if gpus_requested(learner.resources) else []
        found, fine = _learner_misfits(shape, learner, gpus)
        if found:
            offered = ways_out(shape, learner, gpus)
            found[0] = dataclasses.replace(found[0], text=found[0].text + _ways_out_text(offered, found[0]))
        misfits += found
        notes += fine
    if rollout.device == "cuda":
        found, fine = _rollout_misfits(shape, rollout, gpus_for(rollout.placement, nodes))
        misfits += found
        notes += fine
    refuse = policy == "refuse"
    return FitReport([misfit.line for misfit in misfits if misfit.sure and refuse],
                     [misfit.line for misfit in misfits if not (misfit.sure and refuse)], notes, offered)


def _placement(role: RolePodSpec) -> Placement:
    override = role.pod_template_override.spec if role.pod_template_override else None
    return Placement(node_selector=role.node_selector, affinity=override.affinity if override else None,
                     tolerations=role.tolerations)


def check_spec_fit(spec: GRPORunSpec, config: Mapping[str, Any], nodes: Sequence[Node] | None = None) -> FitReport:
    """The check for a run: its model's config.json and its spec (the learner's strategy, ranks and LoRA as
    `grpo_trainer.contract.launch` and the learner apply them; `spec.fitCheck`); `nodes` as for check_fit."""
    learner, rollout = spec.learner, spec.rollout
    lora = spec.training.lora
    return check_fit(
        model_shape(config),
        LearnerFit(device=learner.device, tokens=spec.training.token_budget or rollout.vllm.max_model_len,
                   nodes=learner.nodes, processes_per_node=learner.processes_per_node, resources=learner.resources,
                   placement=_placement(learner), strategy=learner.strategy,
                   lora_rank=lora.r if lora is not None else None, cpu_offload=learner.fsdp.cpu_offload),
        RolloutFit(device=rollout.device, max_model_len=rollout.vllm.max_model_len,
                   tensor_parallel_size=rollout.vllm.tensor_parallel_size,
                   gpu_memory_utilization=rollout.vllm.gpu_memory_utilization, placement=_placement(rollout)),
        nodes,
        spec.fit_check,
    )
