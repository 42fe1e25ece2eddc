"""The CUDA learner environment: vLLM in the learner for TRL's NCCL weight sync, with the learner's transformers.

`make setup-learner-cuda` builds `.venv-learner-cuda` the way the trainer image's cuda variant builds /opt/learner
(PyPI's CUDA torch, the learner extra with trainer_image/requirements/learner-cuda.txt, vllm without its
dependencies). The slow tests build it on first use (`make setup` builds it too; ~330 MB the first time, a second
after) and run our learner's own construction path in it on this GPU-less machine: TRL's NCCL WeightTransferClient
is built and gets as far as its first CUDA call.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grpo_trainer.contract.config import RunConfig
from grpo_trainer.learner.attention import FA3_REPO
from grpo_trainer.learner.errors import ConfigError
from grpo_trainer.learner.main import http_only_rollout_worker
from tests.chart.test_images import TRAINER_DOCKERFILE, _instructions
from tests.support.paths import REPO, make_variable

LEARNER_CUDA_VENV = REPO / make_variable("LEARNER_CUDA_VENV")
LEARNER_CUDA_REQUIREMENTS = make_variable("LEARNER_CUDA_REQUIREMENTS")
VLLM_VERSION = make_variable("VLLM_VERSION")
LEARNER_PINS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["learner"]
BUILD_TIMEOUT_S = 900
PROBE_TIMEOUT_S = 300
# vllm's requirements the list leaves out on purpose (its header says why): the learner's transformers, the torch
# family, and the serving-only GPU kernels and media libraries.
LEFT_OUT = {
    "transformers", "torch", "torchvision", "torchaudio", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor",
    "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}
# openenv-core is installed without its requirements (the Makefile, the Dockerfile): those the learner's OpenEnv client
# never imports stay out, its web UI's gradio (whose pins clash with vllm's) and its CLI's TOML readers.
OPENENV_LEFT_OUT = {"gradio", "tomli", "tomli-w"}
# xgrammar (which vllm needs) brings its own apache-tvm-ffi, newer than the one vllm pins for its kernels.
NOT_LISTED = LEFT_OUT - {"apache-tvm-ffi"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _pins() -> dict[str, str]:
    lines = [line for line in (REPO / LEARNER_CUDA_REQUIREMENTS).read_text().splitlines()
             if line and not line.startswith("#")]
    assert all(line.count("==") == 1 for line in lines), "every requirement is pinned with =="
    return {_name(line): line.split("==")[1] for line in lines}


def test_the_cuda_image_and_make_install_the_same_learner_list():
    runs = [args for instruction, args in _instructions(TRAINER_DOCKERFILE) if instruction == "RUN"]
    learner = next(args for args in runs if "python -m venv --system-site-packages /opt/learner" in args)
    cuda_branch = learner.split('if [ "${VARIANT}" = cuda ]; then', 1)[1].split("else", 1)[0]
    assert f"/opt/learner/bin/pip install -r learner-requirements.txt -r {LEARNER_CUDA_REQUIREMENTS}" in cuda_branch
    assert '/opt/learner/bin/pip install --no-deps "${VLLM_WHEEL:-vllm==${VLLM_VERSION}}"' in cuda_branch
    assert re.search(r"^ARG VLLM_VERSION=(\S+)$", TRAINER_DOCKERFILE.read_text(), re.M)[1] == VLLM_VERSION

    plan = subprocess.run(["make", "-n", "-B", "setup-learner-cuda"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    python = f"--python {make_variable('LEARNER_CUDA_VENV')}/bin/python"
    assert f"{python} torch=={make_variable('TORCH_VERSION')}" in plan  # PyPI's, the CUDA build, as the image's
    assert f"{python} -e '.[learner]' -r {LEARNER_CUDA_REQUIREMENTS}" in plan
    assert f"{python} --no-deps vllm=={VLLM_VERSION}" in plan


def test_the_list_keeps_the_learners_transformers_and_torch_and_brings_kernels():
    pins = _pins()
    assert "kernels" in pins
    assert not {name for name in pins if name in NOT_LISTED or name.startswith(("nvidia-", "cuda-", "triton"))}
    assert "vllm" not in pins  # installed on its own, without its transformers pin


def test_a_learner_without_vllm_refuses_nccl_sync_in_one_line(monkeypatch):
    from trl.experimental.async_grpo import async_rollout_worker

    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda: False)
    config = RunConfig.model_validate({"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "r"}],
                                       "rollout": {"weightSync": {"mode": "nccl"}}})
    refused = pytest.raises(ConfigError, match=r"^rollout.weightSync.mode 'nccl' needs vLLM in the learner")
    with refused as raised, http_only_rollout_worker(config):
        pass
    assert "\n" not in str(raised.value) and "cuda trainer image" in str(raised.value)


def test_filesystem_sync_lets_trl_build_its_worker_without_vllm_and_restores_the_check(monkeypatch):
    from trl.experimental.async_grpo import async_rollout_worker

    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda: False)
    config = RunConfig.model_validate({"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "r"}],
                                       "rollout": {"weightSync": {"mode": "filesystem", "directory": "/w"}}})
    with http_only_rollout_worker(config):
        assert async_rollout_worker.is_vllm_available()  # what TRL's worker constructor asks
    assert not async_rollout_worker.is_vllm_available()
    with pytest.raises(RuntimeError, match="boom"), http_only_rollout_worker(config):
        raise RuntimeError("boom")
    assert not async_rollout_worker.is_vllm_available()


@pytest.fixture(scope="module")
def cuda_learner_python() -> Path:
    """`.venv-learner-cuda`'s python, built by `make setup-learner-cuda` on first use (up to date: no work)."""
    if not (LEARNER_CUDA_VENV / ".installed").exists():
        print(f"\nbuilding {LEARNER_CUDA_VENV.name} on first use (make setup-learner-cuda; downloads vllm's "
              "~330 MB wheel once)", file=sys.stderr)
    done = subprocess.run(["make", "--no-print-directory", "setup-learner-cuda"], cwd=REPO, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"make setup-learner-cuda failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return LEARNER_CUDA_VENV / "bin" / "python"


class _VllmServerFront(BaseHTTPRequestHandler):
    """What TRL's VLLMClient asks a GPU vLLM server before the NCCL rendezvous, answered as one would (bfloat16, one
    worker); the rendezvous request itself is accepted, so the learner's own side is what decides the outcome."""

    answers = {
        "/health": {},
        "/server_info": {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}},
        "/get_world_size": {"world_size": 1},
        "/v1/models": {"data": [{"id": "m", "max_model_len": 128}]},
    }
    seen: list[str] = []

    def _answer(self) -> None:
        path = self.path.split("?", 1)[0]
        self.seen.append(f"{self.command} {path}")
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps(self.answers.get(path, {})).encode()
        self.send_response(200 if path in self.answers or self.command == "POST" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server_front() -> Iterator[tuple[str, list[str]]]:
    _VllmServerFront.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _VllmServerFront)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _VllmServerFront.seen
    finally:
        server.shutdown()
        server.server_close()


# Runs in the CUDA learner environment: our learner's construction path (build_learner: make_weight_transfer leaves NCCL
# to TRL, http_only_rollout_worker, GRPOLearner), then TRL's client's set-up, which ends at the first CUDA call. TRL's
# trainer asks CUDA for the device's name (its MFU figures) before it builds the sync; on this GPU-less machine the CPU
# learner's answer for a CPU device (no peak FLOPs; grpo_trainer.learner.cpu) stands in, so the sync's is the CUDA call
# left.
PROBE = """
import json, sys, traceback
from grpo_trainer.contract.config import load_run_config
from grpo_trainer.learner.cpu import enable_cpu_support
from grpo_trainer.learner.main import build_learner

enable_cpu_support()

learner = build_learner(load_run_config(open(sys.argv[1]).read()))
transfer = learner.weight_transfer
outcome = {"transfer": f"{type(transfer).__module__}.{type(transfer).__qualname__}"}
try:
    transfer.init_weight_transfer()
except Exception as error:
    cause = error.__cause__
    outcome.update(error=f"{type(error).__name__}: {error}", cause=f"{type(cause).__name__}: {cause}",
                   frames=[f"{frame.filename}:{frame.name}" for frame in traceback.extract_tb(cause.__traceback__)])
print("PROBE " + json.dumps(outcome))
"""


@pytest.mark.slow
def test_the_cuda_learner_builds_trls_nccl_client_and_stops_only_at_the_gpu(
        cuda_learner_python, tiny_model_dir, server_front, tmp_path):
    url, seen = server_front
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"say {word}"}) + "\n" for word in ("a", "b")))
    config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": str(dataset)}, "rewards": [{"name": "letter_a_fraction"}],
        "rollout": {"urls": [url], "weightSync": {"mode": "nccl"}},
        "learner": {"httpPort": 0}, "outputDir": str(tmp_path / "out"),
        # TRL's bf16 default is refused where no GPU answers; everything else is the GPU learner's path.
        "training": {"extraArgs": {"bf16": False}},
    })
    assert config.learner.device == "cuda" and config.rollout.weight_sync.mode == "nccl"
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(config.to_wire()))
    done = subprocess.run([str(cuda_learner_python), "-c", PROBE, str(config_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TRL_EXPERIMENTAL_SILENCE": "1",
                               "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    line = next((line for line in done.stdout.splitlines() if line.startswith("PROBE ")), None)
    assert line, f"the probe ended without an outcome ({done.returncode}):\n{done.stderr[-4000:]}"
    outcome = json.loads(line.removeprefix("PROBE "))
    # TRL built its own NCCL client: past its `vllm` import check.
    assert outcome["transfer"] == "trl.experimental.async_grpo.weight_transfer.WeightTransferClient"
    # It asked the server what a real one answers, and failed only where the trainer side opens its NCCL group on the
    # current CUDA device: vLLM's trainer_init, at torch's first CUDA call, which this machine cannot answer.
    assert {"GET /health", "GET /server_info", "GET /get_world_size"} <= set(seen)
    assert outcome["error"].startswith("RuntimeError: Failed to set up the NCCL weight-transfer group")
    assert outcome["cause"] == (
        "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and "
        "installed a driver from http://www.nvidia.com/Download/index.aspx"
    ), outcome
    assert any(frame.endswith("vllm/distributed/weight_transfer/nccl_common.py:trainer_init")
               for frame in outcome["frames"]), outcome["frames"]


@pytest.mark.slow
def test_vllms_requirements_hold_in_the_cuda_learner_but_those_left_out(cuda_learner_python):
    """Each of vllm's own requirements (its wheel's metadata) is met, but those the list leaves out on purpose; every
    other package's are all met (what `pip check` checks)."""
    probe = """
import importlib.metadata as m, json
from packaging.requirements import Requirement

def unmet(distribution):
    for text in distribution.requires or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = m.version(requirement.name)
        except m.PackageNotFoundError:
            yield requirement.name
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            yield requirement.name

others = {d.metadata["Name"]: list(unmet(d)) for d in m.distributions() if d.metadata["Name"] != "vllm"}
print(json.dumps({"vllm": m.version("vllm"), "transformers": m.version("transformers"),
                  "unmet": list(unmet(m.distribution("vllm"))), "others": {k: v for k, v in others.items() if v}}))
"""
    done = subprocess.run([str(cuda_learner_python), "-c", probe], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["vllm"] == VLLM_VERSION
    assert f"transformers=={found['transformers']}" in LEARNER_PINS  # the learner's, not vllm's <5.20
    assert {_name(name) for name in found["unmet"]} <= LEFT_OUT
    others = found["others"]
    assert {_name(name) for name in others.pop("openenv-core", [])} <= OPENENV_LEFT_OUT
    assert others == {}


@pytest.mark.slow
def test_the_cuda_learner_is_hardlinked_from_uvs_cache(cuda_learner_python):
    """Cheap on disk: torch's CUDA libraries and vllm's kernels are the cache's files, not copies."""
    site = next((LEARNER_CUDA_VENV / "lib").glob("python*/site-packages"))
    for library in (site / "torch" / "lib" / "libtorch_cuda.so", site / "vllm" / "_C_stable_libtorch.abi3.so"):
        assert library.stat().st_nlink >= 2, library


# Runs in the CUDA learner environment, which has the real `kernels` package: the tree-attention rule's GPU branches
# import, pick fa3 on a Hopper with the image's lock file present, and `kernels.load_kernel` reads that lock file
# (written by the package itself, as `kernels lock` does) and the local cache only: a kernel that is not there is an
# error, never a download.
KERNEL_PROBE = """
import json, os, sys
import torch
from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion
from grpo_trainer.learner import attention
from grpo_trainer.learner.attention import DeviceFacts, choose_kernel, torch_varlen_attention

lock = sys.argv[1]
dependency = KernelDependency(attention.FA3_REPO, KernelVersion.Version(1))
with open(lock, "w") as f:
    f.write(KernelLocks({dependency: KernelLock("0" * 40)}).to_json())  # a revision no cache here holds
os.environ[attention.FA3_LOCKFILE_ENV] = lock
hopper = DeviceFacts("cuda", capability=(9, 0), fa3_kernel_present=attention.fa3_kernel_present())
outcome = {"hopper": choose_kernel("auto", hopper).kernel.value,
           "ampere": choose_kernel("auto", DeviceFacts("cuda", capability=(8, 0))).kernel.value}
q = torch.empty(8, 4, 64, dtype=torch.bfloat16, device="meta")
k = torch.empty(8, 2, 64, dtype=torch.bfloat16, device="meta")
cu = torch.tensor([0, 3, 8], dtype=torch.int32)
outcome["varlen_shape"] = list(torch_varlen_attention(q, k, k, cu, cu, 5, 5).shape)
try:
    attention.load_fa3_kernel()
    outcome["load"] = "loaded"
except Exception as error:
    outcome["load"] = f"{type(error).__name__}: {error}"
print("PROBE " + json.dumps(outcome))
"""


@pytest.mark.slow
def test_the_attention_rules_gpu_branches_run_with_the_real_kernels_package(cuda_learner_python, tmp_path):
    lock = tmp_path / "kernels.lock"
    # No HF_HUB_OFFLINE: the loader must stay off the network by itself (a pod may not set it).
    done = subprocess.run([str(cuda_learner_python), "-c", KERNEL_PROBE, str(lock)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "KERNELS_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""})
    line = next((line for line in done.stdout.splitlines() if line.startswith("PROBE ")), None)
    assert line, f"the probe ended without an outcome ({done.returncode}):\n{done.stderr[-4000:]}"
    outcome = json.loads(line.removeprefix("PROBE "))
    assert (outcome["hopper"], outcome["ampere"], outcome["varlen_shape"]) == ("fa3", "varlen", [8, 4, 64])
    assert outcome["load"].startswith(f"FileNotFoundError: Cannot find a local snapshot for {FA3_REPO} "), outcome
    assert not (tmp_path / "cache").exists()  # nothing was fetched
