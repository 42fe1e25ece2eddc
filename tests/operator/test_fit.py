"""The fit check's arithmetic: parameters from a config.json, per-GPU memory by strategy, the GPU a nodeSelector
names, and the verdict (refuse past a known GPU, warn when likely past it, else say the estimate)."""

from __future__ import annotations

import json

import pytest

from grpo_operator import fit
from grpo_operator.fit import GIB, ModelConfigError, check_fit, gpu_of, learner_estimate, model_shape

# Published shapes (config.json of Qwen2.5-7B and Qwen2.5-0.5B): 7.61B and 0.49B parameters.
QWEN25_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "vocab_size": 152064, "intermediate_size": 18944,
             "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
              "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
ONE_GPU = {"limits": {"nvidia.com/gpu": 1}}


def test_parameters_match_the_published_counts():
    assert model_shape(QWEN25_7B).parameters == pytest.approx(7.61e9, rel=0.005)
    assert model_shape(QWEN25_05B).parameters == pytest.approx(0.494e9, rel=0.005)  # tied: one embedding matrix


def test_a_multimodal_config_is_read_from_its_text_config():
    assert model_shape({"text_config": QWEN25_05B}).parameters == model_shape(QWEN25_05B).parameters


def test_a_config_without_the_shape_says_what_is_missing():
    with pytest.raises(ModelConfigError, match="config.json has no num_hidden_layers"):
        model_shape({k: v for k, v in QWEN25_7B.items() if k != "num_hidden_layers"})


def test_ddp_holds_16_bytes_per_parameter_on_every_rank_fsdp2_shards_them_and_lora_freezes_them():
    shape = model_shape(QWEN25_7B)
    ddp = learner_estimate(shape, tokens=4096, strategy="ddp", ranks=8)
    assert ddp.state_bytes == shape.parameters * 16  # ranks do not matter: every rank holds it all
    fsdp = learner_estimate(shape, tokens=4096, strategy="fsdp2", ranks=8)
    assert shape.parameters * 16 / 8 < fsdp.state_bytes < shape.parameters * 16 / 8 + 2 * GIB
    lora = learner_estimate(shape, tokens=4096, lora_rank=16)
    assert lora.state_bytes == shape.parameters * 4 + shape.lora_parameters(16) * 16
    assert ddp.activation_bytes == fsdp.activation_bytes == lora.activation_bytes > 0


def test_activations_grow_with_the_row():
    shape = model_shape(QWEN25_7B)
    assert fit.activation_bytes(shape, 8192) == 2 * fit.activation_bytes(shape, 4096)


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


def verdict(config, *, learner_selector=H100, rollout_selector=None, resources=ONE_GPU, tokens=4096, **overrides):
    arguments = dict(learner_device="cuda", learner_ranks=1, learner_resources=resources,
                     learner_node_selector=learner_selector, tokens=tokens, rollout_device="cuda",
                     rollout_node_selector=rollout_selector, max_model_len=4096, tensor_parallel_size=1,
                     gpu_memory_utilization=0.9)
    return check_fit(model_shape(config), **{**arguments, **overrides})


def test_a_7b_ddp_learner_on_one_80gb_gpu_is_refused_with_the_numbers_and_the_ways_out():
    report = verdict(QWEN25_7B)
    (line,) = report.errors
    assert line.startswith("spec.learner: the learner needs ~122 GiB per GPU under ddp (7.6B parameters: 113 GiB "
                           "fp32 weights, gradients and Adam states + 7.9 GiB activations of a 4096-token row")
    assert "more than the 80 GiB of its GPU (nodeSelector nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)" in line
    assert line.endswith("; ways out: FSDP2 over 2 GPUs (~67 GiB each) or FSDP2 with learner.fsdp.cpuOffload on 1 "
                         "GPU (~11 GiB per GPU, 113 GiB of CPU memory per rank) or LoRA adapters, rank 16 (~38 GiB)")
    assert report.warnings == []


def test_fsdp2_with_cpu_offload_keeps_one_layer_on_the_gpu_and_the_shard_in_cpu_memory():
    shape = model_shape(QWEN25_7B)
    sharded = learner_estimate(shape, tokens=4096, strategy="fsdp2", ranks=2)
    offloaded = learner_estimate(shape, tokens=4096, strategy="fsdp2", ranks=2, cpu_offload=True)
    layer = sum(a * b for a, b in shape.layer_linear_shapes) * 8
    assert offloaded.state_bytes == layer and offloaded.host_bytes == sharded.state_bytes - layer
    assert learner_estimate(shape, tokens=4096, cpu_offload=True).host_bytes == 0  # ddp has nothing to offload
    report = verdict(QWEN25_7B, strategy="fsdp2", cpu_offload=True)
    assert report.errors == report.warnings == []
    assert report.notes[0].startswith("spec.learner: the learner needs ~11 GiB per GPU under fsdp2 (7.6B parameters: "
                                      "one layer's gathered weights and gradients (1.7 GiB; the 113 GiB shard")


def test_an_fsdp2_learner_short_of_gpus_is_offered_more_of_them():
    report = verdict(QWEN25_7B, strategy="fsdp2", learner_ranks=2, resources={"limits": {"nvidia.com/gpu": 2}},
                     learner_selector={"nvidia.com/gpu.product": "NVIDIA-L40S"})
    (line,) = report.errors
    assert line.startswith("spec.learner: the learner needs ~")
    assert "under fsdp2" in line and "sharded over 2 ranks" in line
    assert "; ways out: FSDP2 over 4 GPUs" in line  # more ranks than it has; never 2 again


def test_the_same_learner_fits_an_h200_and_the_estimate_is_said():
    report = verdict(QWEN25_7B, learner_selector={"nvidia.com/gpu.product": "NVIDIA-H200"})
    assert report.errors == report.warnings == []
    assert report.notes[0].startswith("spec.learner: the learner needs ~122 GiB per GPU under ddp")
    assert report.notes[0].endswith("within the 141 GiB of its GPU")


def test_activations_past_the_gpu_are_a_warning_not_a_refusal():
    shape = model_shape(QWEN25_05B)
    estimate = learner_estimate(shape, tokens=32768)
    between_mib = (estimate.state_bytes + fit.CUDA_CONTEXT_BYTES + estimate.activation_bytes // 2) // 1024**2
    report = verdict(QWEN25_05B, tokens=32768, learner_selector={"nvidia.com/gpu.memory": str(between_mib)})
    assert report.errors == []
    (line,) = report.warnings
    assert "once the activations are counted" in line


def test_an_unnamed_gpu_warns_only_past_80_gb():
    (line,) = verdict(QWEN25_7B, learner_selector=None).warnings
    assert "more than an 80 GB GPU holds; name the GPU in spec.learner.nodeSelector (nvidia.com/gpu.product)" in line
    small = verdict(QWEN25_05B, learner_selector=None)
    assert small.errors == small.warnings == [] and small.notes[0].startswith("spec.learner: the learner needs ~")


def test_a_learner_that_requests_no_gpu_is_not_held_to_the_selectors_gpu():
    assert verdict(QWEN25_7B, resources=None).errors == []


def test_a_rollout_server_without_room_for_one_sequence_is_refused():
    big_context = {**QWEN25_7B, "num_key_value_heads": 28}  # no GQA: 7x the KV cache
    report = verdict(big_context, learner_selector=None, rollout_selector={"nvidia.com/gpu.product": "NVIDIA-L4"},
                     max_model_len=32768)
    (line,) = report.errors
    # KV: 2 (K and V) x 28 layers x 28 heads x 128 x 2 bytes = 392 KiB a token.
    assert line.startswith("spec.rollout.vllm: a rollout server needs 15 GiB of weights per GPU (tensorParallelSize "
                           "1) and 12 GiB of KV cache per 32768-token sequence")
    assert line.endswith("leaves no room for one sequence: raise gpuMemoryUtilization or tensorParallelSize, or "
                         "lower maxModelLen")


def test_a_rollout_server_that_fits_says_how_many_sequences_its_kv_cache_holds():
    report = verdict(QWEN25_7B, learner_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                     rollout_selector=H100)
    assert report.errors == []
    assert report.notes[1].endswith("0.9 of its GPU (80 GiB) holds ~255 such sequences")
    # Tensor parallelism halves both per GPU.
    halved = verdict(QWEN25_7B, learner_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                     rollout_selector=H100, tensor_parallel_size=2)
    assert "needs 7.1 GiB of weights per GPU (tensorParallelSize 2)" in halved.notes[1]


def test_a_cpu_run_is_not_checked():
    report = verdict(QWEN25_7B, learner_device="cpu", rollout_device="cpu")
    assert report.errors == report.warnings == report.notes == []


def test_the_model_config_is_read_only_from_a_local_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN25_05B))
    assert fit.read_model_config(str(tmp_path / "m")) == (QWEN25_05B, "")
    assert fit.read_model_config("./m", tmp_path) == (QWEN25_05B, "")  # relative to the manifest's folder
    assert fit.read_model_config("Qwen/Qwen2.5-7B") == (
        None, "spec.model Qwen/Qwen2.5-7B is a hub id, and its config.json is read only from a local path")
    assert fit.read_model_config(str(tmp_path / "gone")) == (None, f"spec.model {tmp_path / 'gone'}: no such "
                                                                   "directory here")
    (tmp_path / "m" / "config.json").write_text("{")
    config, why = fit.read_model_config(str(tmp_path / "m"))
    assert config is None and why.startswith(f"spec.model {tmp_path / 'm'}: cannot read config.json (")


def test_the_operator_reads_only_an_absolute_path_it_has_and_says_why_it_skipped(tmp_path):
    from grpo_operator.api import parse_spec
    from tests.support.specs import minimal_spec

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN25_05B))
    report, skipped = fit.operator_check(parse_spec(minimal_spec(model=str(tmp_path / "m"))))
    assert skipped == "" and report.notes[0].startswith("spec.learner: the learner needs ~")
    report, skipped = fit.operator_check(parse_spec(minimal_spec(model="Qwen/Qwen2.5-7B")))
    assert report.notes == [] and skipped.endswith("is a hub id, and its config.json is read only from a local path")
    report, skipped = fit.operator_check(parse_spec(minimal_spec(model="/models/tiny")))
    assert skipped == "spec.model /models/tiny: no such directory here"
    (tmp_path / "m" / "config.json").write_text("{}")
    report, skipped = fit.operator_check(parse_spec(minimal_spec(model=str(tmp_path / "m"))))
    assert skipped == f"spec.model {tmp_path / 'm'}: config.json has no hidden_size"
    cpu = minimal_spec(model=str(tmp_path / "m"), learner={"device": "cpu"},
                       rollout={"device": "cpu", "weightSync": {"mode": "filesystem"}})
    assert fit.operator_check(parse_spec(cpu)) == (fit.FitReport([], [], []), "")
