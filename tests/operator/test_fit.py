"""The fit check's arithmetic and verdict: parameters from a config.json, per-GPU memory by strategy (DDP's gradient
buckets, FSDP2's shards and gathered modules), rank 0's CPU memory against the pod's limit, the GPU a nodeSelector
names or the nodes' GPU feature discovery labels say, refusals past it (activations included, `spec.fitCheck: warn`
the opt-out), and ways out that pass the same check."""

from __future__ import annotations

import pytest

from grpo_operator import fit
from grpo_operator.api import parse_spec
from grpo_operator.fit import (
    GIB,
    LearnerFit,
    ModelConfigError,
    RolloutFit,
    check_fit,
    check_spec_fit,
    gpu_of,
    gpus_for,
    host_estimate,
    learner_estimate,
    model_shape,
)
from grpo_operator.placement import Node, Placement
from tests.support.servers.hub_server import QWEN3_06B, QWEN25_7B, QWEN25_32B
from tests.support.specs import MULTI_RANK_ROLLOUT, minimal_spec

QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
H100_PRODUCT = "NVIDIA-H100-80GB-HBM3"
H100 = {"nvidia.com/gpu.product": H100_PRODUCT}
ONE_GPU = {"limits": {"nvidia.com/gpu": 1}}
EIGHT_GPUS = {"limits": {"nvidia.com/gpu": 8}}


def gfd_node(name: str, product: str = H100_PRODUCT, memory_mib: int = 81559, **labels: str) -> Node:
    """A node as NVIDIA's GPU feature discovery labels it."""
    return Node(name, {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib), **labels})


H100_NODES = [gfd_node(f"h100-{i}", pool="training") for i in range(3)]


def learner(tokens: int = 4096, **fields) -> LearnerFit:
    return LearnerFit(**{"device": "cuda", "tokens": tokens, "resources": ONE_GPU, **fields})


def verdict(config, learner_fit: LearnerFit, *, rollout: RolloutFit | None = None, nodes=None,
            policy="refuse") -> fit.FitReport:
    return check_fit(model_shape(config), learner_fit, rollout or RolloutFit("cpu", 4096), nodes, policy)


# --- shape and estimates ------------------------------------------------------------------------------------------
def test_parameters_match_the_published_counts():
    assert model_shape(QWEN25_7B).parameters == pytest.approx(7.61e9, rel=0.005)
    assert model_shape(QWEN25_05B).parameters == pytest.approx(0.494e9, rel=0.005)  # tied: one embedding matrix
    assert model_shape(QWEN3_06B).parameters == pytest.approx(0.596e9, rel=0.005)
    assert model_shape(QWEN25_32B).parameters == pytest.approx(32.76e9, rel=0.005)


def test_a_multimodal_config_is_read_from_its_text_config():
    assert model_shape({"text_config": QWEN25_05B}).parameters == model_shape(QWEN25_05B).parameters


def test_a_config_without_the_shape_says_what_is_missing():
    with pytest.raises(ModelConfigError, match="config.json has no num_hidden_layers"):
        model_shape({k: v for k, v in QWEN25_7B.items() if k != "num_hidden_layers"})


def test_ddp_holds_the_whole_state_on_every_rank_and_its_gradient_buckets_over_several():
    shape = model_shape(QWEN25_7B)
    alone = learner_estimate(shape, learner())
    assert (alone.state_bytes, alone.bucket_bytes) == (shape.parameters * 16, 0)  # one process: no DDP wrapper
    eight = learner_estimate(shape, learner(processes_per_node=8, resources=EIGHT_GPUS))
    assert (eight.state_bytes, eight.bucket_bytes) == (shape.parameters * 16, shape.parameters * 4)
    lora = learner_estimate(shape, learner(processes_per_node=8, lora_rank=16))
    assert lora.state_bytes == shape.parameters * 4 + shape.lora_parameters(16) * 16
    assert lora.bucket_bytes == shape.lora_parameters(16) * 4  # only what trains is in the buckets
    assert alone.activation_bytes == eight.activation_bytes == lora.activation_bytes > 0


def test_fsdp2_shards_the_state_and_gathers_two_layers_and_the_embeddings_whole():
    shape = model_shape(QWEN25_7B)
    gathered = (2 * shape.layer_parameters + shape.embedding_parameters) * 4
    sharded = learner_estimate(shape, learner(strategy="fsdp2", processes_per_node=8))
    assert (sharded.state_bytes, sharded.gathered_bytes, sharded.bucket_bytes) == (
        shape.parameters * 16 / 8, gathered, 0)
    offloaded = learner_estimate(shape, learner(strategy="fsdp2", processes_per_node=2, cpu_offload=True))
    assert (offloaded.state_bytes, offloaded.offloaded_bytes) == (0, shape.parameters * 16 / 2)
    assert learner_estimate(shape, learner(cpu_offload=True)).offloaded_bytes == 0  # ddp has nothing to offload


def test_activations_grow_with_the_row():
    shape = model_shape(QWEN25_7B)
    assert fit.activation_bytes(shape, 8192) == 2 * fit.activation_bytes(shape, 4096)


def test_rank_0s_pod_holds_the_fp32_model_once_under_fsdp2_and_once_per_process_under_ddp():
    shape = model_shape(QWEN25_32B)
    fsdp = learner(strategy="fsdp2", nodes=2, processes_per_node=8)
    host = host_estimate(shape, fsdp, learner_estimate(shape, fsdp))
    # Loading, consolidating the final model and gathering it for a sync: one fp32 copy on rank 0, ~122 GiB for 32B.
    assert host.weight_bytes == shape.parameters * 4 and round(host.weight_bytes / GIB) == 122
    assert host.total_bytes == host.weight_bytes + 8 * fit.PROCESS_HOST_BYTES
    ddp = learner(processes_per_node=8)
    assert host_estimate(shape, ddp, learner_estimate(shape, ddp)).weight_bytes == 8 * shape.parameters * 4
    offload = learner(strategy="fsdp2", processes_per_node=8, cpu_offload=True)
    estimate = learner_estimate(shape, offload)
    assert host_estimate(shape, offload, estimate).offloaded_bytes == 8 * estimate.offloaded_bytes


# --- which GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("selector", "gib"), [
    ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, 80),
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}, 40),
    ({"nvidia.com/gpu.product": "NVIDIA-L40S"}, 48),
    ({"nvidia.com/gpu.product": "NVIDIA-L4"}, 24),
    ({"nvidia.com/gpu.product": "NVIDIA-H200"}, 141),
    ({"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}, 16),
    ({"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}, 80),
    ({"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, 81559 / 1024),
])
def test_the_gpu_a_node_selector_names(selector, gib):
    assert gpu_of(selector).bytes == pytest.approx(gib * GIB)


@pytest.mark.parametrize("selector", [None, {}, {"kubernetes.io/arch": "amd64"},
                                      {"nvidia.com/gpu.product": "Some-Future-GPU"}])
def test_no_gpu_is_assumed_where_none_is_named(selector):
    assert gpu_of(selector) is None
    assert gpus_for(Placement(selector), None) == []


def test_the_gpus_of_the_nodes_a_role_can_land_on_smallest_first():
    nodes = [*H100_NODES, gfd_node("l4-0", "NVIDIA-L4", 23034, pool="inference"),
             gfd_node("h200-0", "NVIDIA-H200", 143771, pool="training"),
             Node("tainted-h200", {"nvidia.com/gpu.memory": "143771", "pool": "training"},
                  taints=({"key": "reserved", "value": "x", "effect": "NoSchedule"},))]
    (l4, h100, h200) = gpus_for(Placement(), nodes)
    assert [gpu.bytes for gpu in (l4, h100, h200)] == [23034 * 2**20, 81559 * 2**20, 143771 * 2**20]
    assert h100.named_by == "nvidia.com/gpu.memory=81559 on the 3 nodes it can land on"
    assert h200.named_by == "nvidia.com/gpu.memory=143771 on the 1 node it can land on"  # not the tainted one
    assert [gpu.bytes for gpu in gpus_for(Placement({"pool": "training"}), nodes)] == [h100.bytes, h200.bytes]
    reserved = Placement({"pool": "training"}, tolerations=[{"key": "reserved", "operator": "Exists"}])
    assert gpus_for(reserved, nodes)[-1].named_by == "nvidia.com/gpu.memory=143771 on the 2 nodes it can land on"
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["100000"]}]}]}}}
    assert [gpu.bytes for gpu in gpus_for(Placement(affinity=affinity), nodes)] == [h200.bytes]
    # A nodeSelector that names the GPU is the GPU, whatever the nodes say.
    assert gpus_for(Placement(H100), nodes) == [gpu_of(H100)]


# --- the verdict --------------------------------------------------------------------------------------------------
SEVEN_B_ON_ONE_GPU = ("the learner needs ~122 GiB per GPU under ddp (7.6B parameters: 113 GiB fp32 weights, gradients "
                      "and Adam states + 7.9 GiB activations of a 4096-token row + 1.0 GiB CUDA context), more than "
                      "the 80 GiB of its GPU")


@pytest.mark.parametrize(("placement", "nodes", "named_by"), [
    (Placement(H100), None, f"nodeSelector nvidia.com/gpu.product={H100_PRODUCT}"),
    (Placement(), H100_NODES, "nvidia.com/gpu.memory=81559 on the 3 nodes it can land on"),
    (Placement({"pool": "training"}), [*H100_NODES, gfd_node("h200", "NVIDIA-H200", 143771)],
     "nvidia.com/gpu.memory=81559 on the 3 nodes it can land on"),
], ids=["gpu-named", "no-selector", "selector-without-the-gpu"])
def test_a_7b_ddp_learner_on_one_80gb_gpu_is_refused_with_the_numbers(placement, nodes, named_by):
    report = verdict(QWEN25_7B, learner(placement=placement), nodes=nodes)
    (line,) = report.errors
    assert line.startswith(f"spec.learner: {SEVEN_B_ON_ONE_GPU} ({named_by}); ways out, each estimated the same way: "
                           "learner.strategy fsdp2 over 2 GPUs (learner.nodes 2) (~71 GiB per GPU) or ")
    assert "learner.fsdp.cpuOffload on its 1 GPU (~15 GiB per GPU, ~145 GiB of the pod's CPU memory)" in line
    assert line.endswith("LoRA adapters (training.lora, rank 16) under learner.strategy ddp (~38 GiB per GPU)")
    assert report.warnings == []


def test_without_a_known_gpu_a_7b_learner_is_only_warned_of_past_80_gb():
    report = verdict(QWEN25_7B, learner(), nodes=[Node("cpu-0", {"kubernetes.io/arch": "amd64"})])
    assert report.errors == []
    (line,) = report.warnings
    assert "more than an 80 GB GPU holds; its GPU is not known: name it in spec.learner.nodeSelector" in line
    small = verdict(QWEN25_05B, learner())
    assert small.errors == small.warnings == [] and small.notes[0].startswith("spec.learner: the learner needs ~")


def test_activations_past_the_gpu_are_refused_and_fit_check_warn_makes_it_a_warning():
    shape = model_shape(QWEN25_05B)
    estimate = learner_estimate(shape, learner(tokens=32768))
    below_mib = (estimate.total_bytes - estimate.activation_bytes // 2) // 2**20  # the state fits, not the rest
    placement = Placement({"nvidia.com/gpu.memory": str(below_mib)})
    (line,) = verdict(QWEN25_05B, learner(tokens=32768, placement=placement)).errors
    assert f"more than the {below_mib / 1024:.0f} GiB of its GPU" in line
    warned = verdict(QWEN25_05B, learner(tokens=32768, placement=placement), policy="warn")
    assert warned.errors == [] and warned.warnings == [line]


def test_a_learner_that_may_land_on_a_smaller_gpu_is_warned_not_refused():
    nodes = [gfd_node("l40s", "NVIDIA-L40S", 46068), gfd_node("h200", "NVIDIA-H200", 143771)]
    report = verdict(QWEN25_7B, learner(strategy="fsdp2", processes_per_node=2, resources={"limits": {
        "nvidia.com/gpu": 2}}), nodes=nodes)
    assert report.errors == []
    (line,) = report.warnings
    assert "more than the 45 GiB of a GPU it may land on (nvidia.com/gpu.memory=46068 on the 1 node it can land on)" \
           ", though within the 140 GiB of nvidia.com/gpu.memory=143771" in line


def test_qwen25_7b_under_ddp_on_8_gpus_is_offered_only_ways_out_that_pass_the_same_check():
    eight = learner(tokens=2048, processes_per_node=8, resources=EIGHT_GPUS, placement=Placement(H100))
    report = verdict(QWEN25_7B, eight)
    (line,) = report.errors
    assert "~147 GiB per GPU under ddp" in line and "+ 28 GiB DDP gradient buckets" in line
    # fsdp2 over its own 8 GPUs fits: neither more GPUs nor the CPU offload is offered.
    assert [way.change for way in report.ways_out] == [
        "learner.strategy fsdp2 on its 8 GPUs",
        "LoRA adapters (training.lora, rank 16) under learner.strategy ddp"]
    assert line.endswith("ways out, each estimated the same way: learner.strategy fsdp2 on its 8 GPUs (~25 GiB per "
                         "GPU) or LoRA adapters (training.lora, rank 16) under learner.strategy ddp (~34 GiB per GPU)")
    for way in report.ways_out:
        taken = verdict(QWEN25_7B, way.learner)
        assert taken.errors == taken.warnings == [], way.change
        assert taken.notes[0].startswith(f"spec.learner: the learner needs ~{way.estimate.total_bytes / GIB:.0f} GiB")


def test_ways_out_are_held_to_the_pods_memory_limit_too():
    limited = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}
    report = verdict(QWEN25_7B, learner(resources=limited, placement=Placement(H100)))
    # The offload would hold the 113 GiB shard in the pod's 64 GiB: not offered.
    assert [way.change for way in report.ways_out] == [
        "learner.strategy fsdp2 over 2 GPUs (learner.nodes 2)",
        "LoRA adapters (training.lora, rank 16) under learner.strategy ddp"]
    for way in report.ways_out:
        assert verdict(QWEN25_7B, way.learner).errors == []


def test_fsdp2_on_one_rank_is_not_called_sharded_and_is_never_a_way_out():
    report = verdict(QWEN25_7B, learner(strategy="fsdp2", placement=Placement(H100)))
    (line,) = report.errors
    assert "113 GiB fp32 weights, gradients and Adam states (one rank: not sharded)" in line
    assert "sharded over 1 ranks" not in line and "on its 1 GPUs" not in line
    assert "learner.strategy fsdp2 on its" not in verdict(QWEN25_7B, learner(placement=Placement(H100))).errors[0]


def test_an_fsdp2_learner_short_of_gpus_is_offered_more_of_them():
    two = learner(strategy="fsdp2", processes_per_node=2, resources={"limits": {"nvidia.com/gpu": 2}},
                  placement=Placement({"nvidia.com/gpu.product": "NVIDIA-L40S"}))
    report = verdict(QWEN25_7B, two)
    (line,) = report.errors
    assert "under fsdp2" in line and "sharded over 2 ranks" in line
    assert report.ways_out[0].change == "learner.strategy fsdp2 over 4 GPUs (learner.nodes 2)"  # never 2 again


def test_rank_0s_pod_past_its_memory_limit_is_refused_naming_the_limit():
    shape_32b = learner(strategy="fsdp2", nodes=2, processes_per_node=8, placement=Placement(H100),
                        resources={"limits": {"nvidia.com/gpu": 8, "memory": "128Gi"}})
    report = verdict(QWEN25_32B, shape_32b)
    (line,) = report.errors
    assert line.startswith("spec.learner.resources.limits.memory: the learner pod of rank 0 needs ~146 GiB of CPU "
                           "memory (122 GiB fp32 weights on rank 0, as it loads them, consolidates the final model "
                           "and gathers it for a weight sync + 24 GiB for its 8 processes' own memory), more than its "
                           "memory limit of 128 GiB")
    assert line.endswith(": a higher memory limit")
    assert report.notes[0].startswith("spec.learner: the learner needs ~53 GiB per GPU under fsdp2")
    roomy = verdict(QWEN25_32B, learner(strategy="fsdp2", nodes=2, processes_per_node=8, placement=Placement(H100),
                                        resources={"limits": {"nvidia.com/gpu": 8, "memory": "160Gi"}}))
    assert roomy.errors == [] and roomy.notes[1].endswith("within its memory limit of 160 GiB")


def test_the_same_learner_fits_an_h200_and_the_estimate_is_said():
    report = verdict(QWEN25_7B, learner(placement=Placement({"nvidia.com/gpu.product": "NVIDIA-H200"})))
    assert report.errors == report.warnings == []
    assert report.notes[0].startswith("spec.learner: the learner needs ~122 GiB per GPU under ddp")
    assert report.notes[0].endswith("within the 141 GiB of its GPU (nodeSelector nvidia.com/gpu.product=NVIDIA-H200)")
    assert report.notes[1].startswith("spec.learner.resources: the learner pod of rank 0 needs ~31 GiB of CPU memory")


def test_a_learner_that_requests_no_gpu_is_not_held_to_the_nodes_gpu():
    assert verdict(QWEN25_7B, learner(resources=None, placement=Placement(H100)), nodes=H100_NODES).errors == []


def test_a_rollout_server_without_room_for_one_sequence_is_refused():
    big_context = {**QWEN25_7B, "num_key_value_heads": 28}  # no GQA: 7x the KV cache
    rollout = RolloutFit("cuda", 32768, placement=Placement({"nvidia.com/gpu.product": "NVIDIA-L4"}))
    report = verdict(big_context, learner(device="cpu"), rollout=rollout)
    (line,) = report.errors
    # KV: 2 (K and V) x 28 layers x 28 heads x 128 x 2 bytes = 392 KiB a token.
    assert line.startswith("spec.rollout.vllm: a rollout server needs 15 GiB of weights per GPU (tensorParallelSize "
                           "1) and 12 GiB of KV cache per 32768-token sequence")
    assert line.endswith("leaves no room for one sequence: raise gpuMemoryUtilization or tensorParallelSize, or "
                         "lower maxModelLen")


def test_a_rollout_server_that_may_land_on_a_gpu_without_room_is_warned_not_refused():
    big_context = {**QWEN25_7B, "num_key_value_heads": 28}
    nodes = [gfd_node("l4", "NVIDIA-L4", 23034), *H100_NODES]
    report = verdict(big_context, learner(device="cpu"), rollout=RolloutFit("cuda", 32768), nodes=nodes)
    assert report.errors == []
    (line,) = report.warnings
    assert ("and 0.9 of a GPU it may land on (22 GiB, nvidia.com/gpu.memory=23034 on the 1 node it can land on) leaves "
            "no room for one sequence: narrow spec.rollout.nodeSelector") in line


def test_a_rollout_server_that_fits_says_how_many_sequences_its_kv_cache_holds():
    report = verdict(QWEN25_7B, learner(device="cpu"), rollout=RolloutFit("cuda", 4096, placement=Placement(H100)))
    assert report.errors == []
    assert report.notes[0].endswith("0.9 of its GPU (80 GiB, nodeSelector nvidia.com/gpu.product="
                                    "NVIDIA-H100-80GB-HBM3) holds ~255 such sequences")
    # Tensor parallelism halves both per GPU; the GPU from the nodes the servers can land on.
    halved = verdict(QWEN25_7B, learner(device="cpu"), rollout=RolloutFit("cuda", 4096, tensor_parallel_size=2),
                     nodes=H100_NODES)
    assert "needs 7.1 GiB of weights per GPU (tensorParallelSize 2)" in halved.notes[0]
    assert "(80 GiB, nvidia.com/gpu.memory=81559 on the 3 nodes it can land on)" in halved.notes[0]


def test_a_cpu_run_is_not_checked():
    report = verdict(QWEN25_7B, learner(device="cpu"))
    assert report.errors == report.warnings == report.notes == []


def test_the_spec_decides_strategy_ranks_placement_and_the_policy():
    def spec(**overrides):
        return parse_spec(minimal_spec(model="Qwen/Qwen2.5-7B", **overrides))

    pool = {"nodeSelector": {"pool": "training"}, "resources": ONE_GPU}
    refused = check_spec_fit(spec(learner=pool), QWEN25_7B, H100_NODES)
    assert refused.errors[0].startswith("spec.learner: the learner needs ~")
    warned = check_spec_fit(spec(learner=pool, fitCheck="warn"), QWEN25_7B, H100_NODES)
    assert warned.errors == [] and warned.warnings == refused.errors
    # The override's required node affinity and the tolerations decide the nodes too.
    elsewhere = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "pool", "operator": "In", "values": ["inference"]}]}]}}
    away = spec(learner={"resources": ONE_GPU, "podTemplateOverride": {"spec": {"affinity": {
        "nodeAffinity": elsewhere}}}})
    assert check_spec_fit(away, QWEN25_7B, H100_NODES).errors == []  # no labelled node there: the GPU is not known
    tainted = [Node(n.name, n.labels, ({"key": "nvidia.com/gpu", "effect": "NoSchedule"},)) for n in H100_NODES]
    assert check_spec_fit(spec(learner=pool), QWEN25_7B, tainted).errors == []
    tolerated = spec(learner={**pool, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
    assert check_spec_fit(tolerated, QWEN25_7B, tainted).errors != []
    sharded = spec(learner={"nodes": 2, "processesPerNode": 4, "strategy": "fsdp2",
                            "resources": {"limits": {"nvidia.com/gpu": 4}}}, rollout=MULTI_RANK_ROLLOUT)
    assert "sharded over 8 ranks" in check_spec_fit(sharded, QWEN25_7B, H100_NODES).notes[0]


def test_a_lora_learner_that_does_not_fit_is_offered_fsdp2_with_its_adapters():
    # 32B's frozen fp32 weights alone (131 GiB) pass an 80 GB GPU: sharding them is the way out, LoRA kept.
    report = verdict(QWEN25_32B, learner(lora_rank=16, placement=Placement(H100)))
    (line,) = report.errors
    assert report.ways_out and all(way.learner.lora_rank == 16 and way.learner.strategy == "fsdp2"
                                   for way in report.ways_out)
    assert report.ways_out[0].change.startswith("learner.strategy fsdp2 over ")
    assert "LoRA adapters" not in line  # it has them already
    for way in report.ways_out:
        assert verdict(QWEN25_32B, way.learner).errors == [], way.change


def test_an_fsdp2_learner_is_offered_lora_under_fsdp2():
    four = learner(strategy="fsdp2", tokens=2048, processes_per_node=4, resources={"limits": {"nvidia.com/gpu": 4}},
                   placement=Placement(H100))
    report = verdict(QWEN25_32B, four)
    assert report.errors
    lora = [way for way in report.ways_out if way.learner.lora_rank is not None]
    assert [way.change for way in lora] == ["LoRA adapters (training.lora, rank 16) under learner.strategy fsdp2"]
    assert lora[0].learner.strategy == "fsdp2" and verdict(QWEN25_32B, lora[0].learner).errors == []
