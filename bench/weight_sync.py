"""Section 7: weight-sync time (filesystem sync, the real vLLM CPU server), the figures the sync deadline comes from.

Three figures: the tiny model's whole sync as the learner times it (`SyncTimer` around pause, write, reload, resume,
the same `FilesystemWeightTransfer` the learner uses, against a vLLM CPU server started through the rollout
entrypoint); the same sync's two parts (writing the safetensors version directory, the server's `reload_weights`);
and the write throughput on a larger synthetic checkpoint, from which the write of a large model is extrapolated.
The server's reload of a large model cannot be measured here (no GPU, no large model).
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo_trainer.contract.config import WEIGHT_SYNC_DEADLINE_SECONDS

from .report import Context, SectionUnavailable, spread, table

NAME = "sync"
TITLE = "7. Weight-sync time (filesystem sync, vLLM CPU server, tiny model)"
ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC_MB = 256
#: A 8B-parameter model in bfloat16, what the extrapolated write is for.
LARGE_MODEL_BYTES = 8e9 * 2


def tiny_syncs(context: Context, model_dir: str, url: str, reps: int) -> dict[str, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_trainer.rollout import weight_sync
    from grpo_trainer.rollout.sync_watchdog import SyncTimer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    transfer = weight_sync.FilesystemWeightTransfer(
        [url], context.scratch / "sync-weights", aliases=weight_sync.TIED_EMBEDDING_ALIASES if tied else None)
    transfer.init_weight_transfer()
    figures: dict[str, list[float]] = {"sync": [], "write": [], "reload": [], "bytes": []}
    original_write = weight_sync.write_checkpoint

    def timed_write(*args, **kwargs):
        started = time.perf_counter()
        written = original_write(*args, **kwargs)
        figures["write"].append(time.perf_counter() - started)
        return written

    weight_sync.write_checkpoint = timed_write
    try:
        timer = SyncTimer(deadline_s=None)

        def sync() -> None:
            transfer.pause()
            transfer.send_weights(iter(list(model.named_parameters())))
            transfer.resume()

        for _ in range(reps + 1):  # the first sync warms the server's reload path up
            timer.run(sync)
            figures["sync"].append(timer.last_s)
            figures["bytes"].append(transfer.bytes_written)
    finally:
        weight_sync.write_checkpoint = original_write
    for key in figures:
        figures[key] = figures[key][1:]
    figures["reload"] = [s - w for s, w in zip(transfer.sync_seconds[1:], figures["write"], strict=True)]
    return figures


def write_throughput(context: Context, reps: int) -> list[float]:
    """MB/s writing a SYNTHETIC_MB checkpoint of 16 MB tensors into a fresh version directory."""
    import shutil

    import torch

    from grpo_trainer.rollout.weight_sync import write_checkpoint

    tensors = [(f"layer.{i}.weight", torch.randn(2048, 2048)) for i in range(SYNTHETIC_MB // 16)]
    rates = []
    for rep in range(reps):
        directory = context.scratch / f"synthetic-{rep}"
        started = time.perf_counter()
        written = write_checkpoint(tensors, directory)
        rates.append(written / 1e6 / (time.perf_counter() - started))
        shutil.rmtree(directory)
    return rates


def run(context: Context) -> str:
    if not (ROOT / ".venv-rollout" / "bin" / "python").exists():
        raise SectionUnavailable(".venv-rollout (vLLM CPU) is missing; `make setup-rollout` builds it")
    from tests.support.servers.vllm_server import running_vllm_server

    reps = context.reps(10, 3)
    model_dir = context.model_dir
    workdir = context.scratch / "sync-server"
    workdir.mkdir()
    with running_vllm_server(model_dir, workdir) as server:
        figures = tiny_syncs(context, model_dir, server.server.url, reps)
    rates = write_throughput(context, context.reps(5, 2))
    megabytes = figures["bytes"][0] / 1e6
    large_write = LARGE_MODEL_BYTES / 1e6 / min(rates)
    rows = [
        ["tiny model: whole sync (pause, write, reload, resume)", f"{megabytes:.2f} MB",
         spread(figures["sync"], "{:.3f}", " s")],
        ["tiny model: write the version directory", f"{megabytes:.2f} MB", spread(figures["write"], "{:.3f}", " s")],
        ["tiny model: the server's reload_weights and the other calls", "", spread(figures["reload"], "{:.3f}", " s")],
        [f"write throughput, {SYNTHETIC_MB} MB synthetic checkpoint", f"{SYNTHETIC_MB} MB",
         spread(rates, "{:.0f}", " MB/s")],
        ["8B bf16 model's write at the slowest rate above (extrapolated)", f"{LARGE_MODEL_BYTES / 1e9:.0f} GB",
         f"{large_write:.0f} s"],
    ]
    return (f"## {TITLE}\n\n{__doc__.split(chr(10), 1)[1].strip()}\n\n"
            + table(["what", "size", "time"], rows)
            + f"\n\n{reps} syncs after one warm-up sync. The default `rollout.weightSync.deadlineSeconds` "
            f"({WEIGHT_SYNC_DEADLINE_SECONDS} s) is {WEIGHT_SYNC_DEADLINE_SECONDS / large_write:.0f}x the extrapolated "
            "write of an 8B model on this disk, and thousands of times the tiny model's whole sync: a sync that "
            "reaches it is hung, not slow (docs/learner.md, \"Weight sync: timing, deadline and several ranks\").")
