"""`grporun validate MANIFEST...`: `OK PATH` on stdout per good manifest; on stderr one line per problem naming the
file and field, and warnings for what a cluster run would not do as meant (`--strict` makes them errors); exit 4 on
any problem and never a traceback; in-process and as the installed command. Its fit check fetches a hub model's
config.json from the stand-in hub (tests/support/servers/hub_server.py) that HF_ENDPOINT names here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_operator import cli
from grpo_operator.exit_codes import ExitCode
from grpo_operator.manifest import load_manifest
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES
from tests.support.paths import REPO
from tests.support.ports import LOOPBACK, free_port
from tests.support.servers.hub_server import GATED_TOKEN, QWEN25_7B, HubServer

GOOD_FIXTURES = sorted(FIXTURES.glob("*.yaml"))
GPU_EXAMPLE = REPO / "examples" / "gpu.yaml"


@pytest.fixture(autouse=True)
def _stand_in_hub(hub: HubServer) -> HubServer:
    """Every manifest here names its model on the stand-in hub: nothing goes to huggingface.co."""
    return hub


def good() -> dict:
    return load_manifest(FIXTURES / "full-gpu.yaml")


def write(tmp_path: Path, manifest: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture
def bad_manifest(tmp_path) -> Path:
    manifest = good()
    manifest["spec"]["trainning"] = manifest["spec"].pop("training")
    manifest["spec"]["rollout"]["vllm"]["maxModelLen"] = 512
    return write(tmp_path, manifest, "bad.yaml")


def test_validate_ok(capsys):
    paths = [str(path) for path in GOOD_FIXTURES]
    assert cli.main(["validate", *paths]) == ExitCode.OK
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out if line.startswith("OK ")] == [f"OK {path}" for path in paths]
    # Their models are hub ids: the fit check fetched their config.json and says its estimates under each OK.
    assert all(": fit: spec." in line for line in out if not line.startswith("OK ")), out
    assert {line.split(": fit: ")[0] for line in out if ": fit: spec.learner: the learner needs ~" in line} == {
        str(path) for path in GOOD_FIXTURES if "device: cpu" not in path.read_text()}


def test_validate_reports_each_problem_on_stderr_and_exits_4(capsys, bad_manifest, tmp_path):
    missing = tmp_path / "missing.yaml"
    good_path = str(FIXTURES / "full-gpu.yaml")
    assert cli.main(["validate", str(bad_manifest), str(missing), good_path]) == ExitCode.INVALID
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)",
        f"{bad_manifest}: spec.rollout.vllm.maxModelLen: must be greater than training.maxCompletionLength "
        "(the prompt needs room in the context too)",
        f"cannot read {missing}: No such file or directory",
    ]
    assert out.out.splitlines()[0] == f"OK {good_path}"
    assert "Traceback" not in out.err


def test_validate_refuses_an_unknown_reward_name_like_local(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["rewards"] = [{"name": "nope"}]
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: spec.rewards[0].name: unknown reward 'nope'; built-in rewards: accuracy, constant, letter_a_fraction"]


def test_validate_warns_of_a_missing_checkpoint_volume_and_paths_on_this_machine(capsys):
    tiny = str(REPO / "examples" / "tiny.yaml")
    assert cli.main(["validate", tiny]) == ExitCode.OK
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"OK {tiny} (4 warnings)"]
    assert out.err.splitlines() == [
        f"{tiny}: warning: spec.checkpoint.volume: not set: checkpoints live as long as the learner pod, so a "
        "restarted learner starts over",
        f"{tiny}: warning: spec.output: not set, and no checkpoint is on a persistent volume: the trained model is "
        "lost with the learner pod (set spec.output.volume or spec.output.uri to keep it)",
        f"{tiny}: warning: spec.model: ./tiny-assets/model is a path on this machine: only grporun local resolves it; "
        "a cluster's pods need a hub id or a path on a volume they mount",
        f"{tiny}: warning: spec.dataset.path: ./tiny-prompts.jsonl is a path on this machine: only grporun local "
        "resolves it; a cluster's pods need a hub id or a path on a volume they mount",
    ]
    assert cli.main(["validate", "--strict", tiny]) == ExitCode.INVALID
    gpu = str(REPO / "examples" / "gpu.yaml")  # a checkpoint PVC and a hub model: nothing to warn of
    assert cli.main(["validate", "--strict", gpu]) == ExitCode.OK
    assert capsys.readouterr().err.count("warning") == 4


@pytest.mark.parametrize(("checkpoint", "output", "warned"), [
    # The model is kept somewhere: nothing to say of it.
    (None, {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}, ["spec.checkpoint.volume: not set"]),
    ({"persistentVolumeClaim": {"claimName": "ckpt"}}, None, []),
    # Staged in an emptyDir, then uploaded: kept in the object store.
    ({"persistentVolumeClaim": {"claimName": "ckpt"}}, {"volume": {"emptyDir": {}}, "uri": "s3://models/run"}, []),
    ({"emptyDir": {}}, {"uri": "s3://models/run"}, ["spec.checkpoint.volume: an emptyDir"]),
    # Work that would be lost.
    ({"emptyDir": {}}, None, ["spec.checkpoint.volume: an emptyDir", "spec.output: not set"]),
    ({"persistentVolumeClaim": {"claimName": "ckpt"}}, {"volume": {"emptyDir": {}}},
     ["spec.output.volume: an emptyDir"]),
])
def test_validate_warns_when_the_trained_model_would_be_lost(capsys, tmp_path, checkpoint, output, warned):
    manifest = good()
    manifest["spec"]["checkpoint"].pop("volume", None)
    if checkpoint is not None:
        manifest["spec"]["checkpoint"]["volume"] = checkpoint
    if output is not None:
        manifest["spec"]["output"] = output
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.OK
    found = [line.removeprefix(f"{path}: warning: ") for line in capsys.readouterr().err.splitlines()]
    assert len(found) == len(warned), found
    assert all(line.startswith(start) for line, start in zip(found, warned, strict=True)), found


def test_validate_as_a_subprocess(bad_manifest):
    grporun = Path(sys.executable).parent / "grporun"
    good_path = FIXTURES / "full-gpu.yaml"
    ok = subprocess.run([grporun, "validate", good_path], capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stderr) == (0, "")
    assert ok.stdout.startswith(f"OK {good_path}\n{good_path}: fit: spec.learner: the learner needs ~")
    bad = subprocess.run([grporun, "validate", bad_manifest], capture_output=True, text=True, timeout=120)
    assert bad.returncode == ExitCode.INVALID and bad.stdout == ""
    assert bad.stderr.splitlines()[0] == f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)"


def test_validate_refuses_an_object_store_uri_naming_the_field(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["output"] = {"uri": "s3://models/runs/../other"}
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: spec.output.uri: 's3://models/runs/../other' is not an object store URI: the prefix has an empty, "
        "'.' or '..' segment"]


def test_validate_refuses_nccl_weight_sync_from_several_learner_ranks(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["rollout"]["weightSync"] = {"mode": "nccl"}  # the learner has 2 nodes x 8 processes
    path = tmp_path / "nccl.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: spec.rollout.weightSync.mode: must be filesystem when the learner has more "
                           "than one process (learner.nodes x learner.processesPerNode)")


def one_gpu_run(model: str, product: str | None = "NVIDIA-H100-80GB-HBM3") -> dict:
    manifest = load_manifest(GPU_EXAMPLE)
    manifest["spec"]["model"] = model
    manifest["spec"]["rollout"]["vllm"]["maxModelLen"] = 4096  # one 4096-token row per training step
    learner = manifest["spec"].setdefault("learner", {})
    learner.update(nodes=1, processesPerNode=1, resources={"limits": {"nvidia.com/gpu": 1}})
    if product:
        learner["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return manifest


def test_grporun_validate_examples_gpu_yaml_fetches_the_hub_models_config_and_prints_the_estimate(hub):
    """The example names Qwen/Qwen3-0.6B: its config.json alone comes from the hub HF_ENDPOINT names."""
    grporun = Path(sys.executable).parent / "grporun"
    done = subprocess.run([grporun, "validate", str(GPU_EXAMPLE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_ENDPOINT": hub.url})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        f"OK {GPU_EXAMPLE}",
        f"{GPU_EXAMPLE}: fit: spec.learner: the learner needs ~13 GiB per GPU under ddp (596M parameters: 8.9 GiB "
        "fp32 weights, gradients and Adam states + 3.2 GiB activations of a 2048-token row + 1.0 GiB CUDA context)",
        f"{GPU_EXAMPLE}: fit: spec.learner.resources: the learner pod of rank 0 needs ~5.2 GiB of CPU memory (2.2 GiB "
        "fp32 weights as its process loads them + 3.0 GiB for its process's own memory)",
        f"{GPU_EXAMPLE}: fit: spec.rollout.vllm: a rollout server needs 1.1 GiB of weights per GPU "
        "(tensorParallelSize 1) and 0.2 GiB of KV cache per 2048-token sequence",
    ]
    assert {(method, path) for method, path, _ in hub.requests} == {
        ("HEAD", "/Qwen/Qwen3-0.6B/resolve/main/config.json"), ("GET", "/Qwen/Qwen3-0.6B/resolve/main/config.json")}


@pytest.mark.timeout(120)
def test_validate_skips_the_fit_check_with_the_reason_when_the_hub_cannot_be_reached():
    grporun = Path(sys.executable).parent / "grporun"
    unreachable = f"http://{LOOPBACK}:{free_port()}"
    done = subprocess.run([grporun, "validate", str(GPU_EXAMPLE)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HF_ENDPOINT": unreachable})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        f"OK {GPU_EXAMPLE}",
        f"{GPU_EXAMPLE}: fit: check skipped: spec.model Qwen/Qwen3-0.6B: the hub cannot be reached (ConnectError: "
        "[Errno 111] Connection refused)"]


def test_validate_reads_a_gated_models_config_with_hf_token(capsys, tmp_path, monkeypatch):
    path = write(tmp_path, one_gpu_run("meta-llama/Gated-7B"))
    for token in (None, "hf_wrong"):
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        assert cli.main(["validate", str(path)]) == ExitCode.OK
        assert capsys.readouterr().out.endswith(f"{path}: fit: check skipped: spec.model meta-llama/Gated-7B is "
                                                "gated, and the hub refused its config.json without a token that may "
                                                "read it (HF_TOKEN)\n")
    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID  # read: a 7B learner on one H100 is refused
    assert capsys.readouterr().err.startswith(f"{path}: spec.learner: the learner needs ~122 GiB per GPU under ddp")


def test_validate_refuses_a_7b_ddp_learner_on_one_80gb_gpu_with_the_estimate_and_the_way_out(capsys, tmp_path):
    path = write(tmp_path, one_gpu_run("Qwen/Qwen2.5-7B"))
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    out = capsys.readouterr()
    (line,) = out.err.splitlines()
    assert line.startswith(f"{path}: spec.learner: the learner needs ~122 GiB per GPU under ddp (7.6B parameters")
    assert "more than the 80 GiB of its GPU (nodeSelector nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)" in line
    assert line.endswith("ways out, each estimated the same way: learner.strategy fsdp2 over 2 GPUs (learner.nodes 2) "
                         "(~71 GiB per GPU) or learner.strategy fsdp2 with learner.fsdp.cpuOffload on its 1 GPU (~15 "
                         "GiB per GPU, ~145 GiB of the pod's CPU memory) or LoRA adapters (training.lora, rank 16) "
                         "under learner.strategy ddp (~38 GiB per GPU)")
    assert not out.out.startswith("OK")


def test_fit_check_warn_lets_the_same_run_through_with_a_warning(capsys, tmp_path):
    manifest = one_gpu_run("Qwen/Qwen2.5-7B")
    manifest["spec"]["fitCheck"] = "warn"
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.OK
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: warning: spec.learner: the learner needs ~122 GiB per GPU under ddp")
    assert cli.main(["validate", "--strict", str(path)]) == ExitCode.INVALID


@pytest.mark.parametrize(("learner", "training", "estimate"), [
    ({"strategy": "fsdp2", "nodes": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}, {},
     "~71 GiB per GPU under fsdp2"),
    ({"strategy": "fsdp2", "fsdp": {"cpuOffload": True}}, {}, "~15 GiB per GPU under fsdp2"),
    ({}, {"lora": {"r": 16}}, "~38 GiB per GPU under ddp"),
])
def test_validate_estimates_the_7b_learner_the_spec_asks_for_and_passes_it(capsys, tmp_path, learner, training,
                                                                          estimate):
    # Each way out the refusal names, taken: the check must estimate the learner the spec runs, not a DDP one.
    manifest = one_gpu_run("Qwen/Qwen2.5-7B")
    manifest["spec"]["learner"].update(learner)
    manifest["spec"]["training"].update(training)
    manifest["spec"]["rollout"]["weightSync"] = {"mode": "filesystem"}  # NCCL sync is refused from several ranks
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"{path}: fit: spec.learner: the learner needs {estimate}")
    assert out[1].endswith("within the 80 GiB of its GPU (nodeSelector nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)")


def test_validate_warns_of_a_7b_learner_on_an_unnamed_gpu(capsys, tmp_path):
    path = write(tmp_path, one_gpu_run("Qwen/Qwen2.5-7B", product=None))
    assert cli.main(["validate", str(path)]) == ExitCode.OK
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: warning: spec.learner: the learner needs ~122 GiB per GPU under ddp")
    assert cli.main(["validate", "--strict", str(path)]) == ExitCode.INVALID


def test_validate_reads_a_local_model_directory_relative_to_the_manifest(capsys, tmp_path):
    (tmp_path / "qwen7b").mkdir()
    (tmp_path / "qwen7b" / "config.json").write_text(json.dumps(QWEN25_7B))
    path = write(tmp_path, one_gpu_run("./qwen7b"))
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    assert "the learner needs ~122 GiB per GPU under ddp" in capsys.readouterr().err


def test_validate_says_the_estimate_of_a_model_that_fits(capsys, tmp_path, tiny_model_dir):
    path = write(tmp_path, one_gpu_run(tiny_model_dir, product="NVIDIA-L4"))
    assert cli.main(["validate", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"OK {path}"
    assert out[1].startswith(f"{path}: fit: spec.learner: the learner needs ~")
    assert out[1].endswith("within the 24 GiB of its GPU (nodeSelector nvidia.com/gpu.product=NVIDIA-L4)")
    assert out[2].startswith(f"{path}: fit: spec.learner.resources: the learner pod of rank 0 needs ~")
    assert out[3].startswith(f"{path}: fit: spec.rollout.vllm: a rollout server needs ")


def test_validate_refuses_a_lora_adapter_on_the_head_in_one_line(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["training"]["lora"] = {"r": 8, "targetModules": ["q_proj", "lm_head"]}
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"{path}: spec.training.lora.targetModules: must not name lm_head or embed_tokens: the learner "
                    "scores log-probabilities with the output embedding's base weight, so an adapter there would "
                    "never be scored")


def test_validate_refuses_a_tool_or_factory_that_is_no_import_path_in_one_line(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["training"]["tools"] = ["mypkg.tools:search", "search the web"]
    manifest["spec"]["training"]["environmentFactory"] = "mypkg.envs"
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: spec.training.tools[1]: must be an import path like 'mypkg.tools:search'",
        f"{path}: spec.training.environmentFactory: must be an import path like 'mypkg.envs:make_environment'",
    ]
