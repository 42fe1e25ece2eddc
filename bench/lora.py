"""Section 10: LoRA on CPU: what a weight sync moves (the adapter alone vs merged weights), and the learner's step.

Sync: the learner's own transfer (`FilesystemWeightTransfer`) against a real vLLM CPU server started through the
rollout entrypoint with LoRA served (`--enable-lora`, rank 8), for the tiny model and a larger random-weight Qwen2
(hidden 768, 8 layers, ~56M parameters). "merged" is TRL's merged path as the learner runs it: the adapter merged
into the base weights, every base weight written and reloaded by the server, the adapter unmerged; "adapter" is the
adapter sync: the peft adapter saved into the version directory and loaded on the server under its versioned name,
then the version that left the window unloaded. Both include the pause and the resume.

Step: one optimizer step (forward, backward, AdamW as TRL uses it) on 4 sequences of 128 tokens, float32 on CPU,
each configuration in a fresh process so its peak resident memory is its own: the full model trained, or the frozen
model with a rank-8 adapter on every linear layer but the head. Not TRL's whole step (no packing, no rollout
pipeline): the part LoRA changes. The resident memory includes the libraries (torch, transformers, peft: ~0.7 GB
here) and the model load's own peak; the last column is the steps' peak (the process's peak reset once the model
was loaded) above the memory then resident: gradients, AdamW's moments, activations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .report import Context, SectionUnavailable, spread, table

NAME = "lora"
TITLE = "10. LoRA: adapter vs merged weight sync, and the learner's step (CPU)"
ROOT = Path(__file__).resolve().parent.parent
RANK = 8
LARGER = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
          "num_key_value_heads": 12}


def larger_model(context: Context) -> str:
    """The tiny model's tokenizer over a larger random Qwen2 (the server needs a tokenizer; the weights are noise)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = context.scratch / "larger-model"
    if (out / "config.json").exists():
        return str(out)
    tiny = Qwen2Config.from_pretrained(context.model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(**{**tiny.to_dict(), **LARGER, "layer_types": None})
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(context.model_dir).save_pretrained(out)
    return str(out)


def peft_model(model_dir: str):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_trainer.contract.config import LoraConfig
    from grpo_trainer.learner.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = get_peft_model(model, peft_config(LoraConfig(r=RANK)))
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: lora_B starts at zero
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.01)
    return wrapped


def sync_figures(context: Context, model_dir: str, url: str, reps: int) -> dict[str, list[float]]:
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from grpo_trainer.rollout.weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer

    model = peft_model(model_dir)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    name = Path(model_dir).name
    merged = FilesystemWeightTransfer([url], context.scratch / f"merged-{name}",
                                      aliases=TIED_EMBEDDING_ALIASES if tied else None)
    adapter = FilesystemWeightTransfer([url], context.scratch / f"adapter-{name}", adapter_window=2)
    merged.init_weight_transfer()
    adapter.init_weight_transfer()
    figures: dict[str, list[float]] = {"merged": [], "merged_bytes": [], "adapter": [], "adapter_bytes": []}

    def sync_merged() -> None:
        merged.pause()
        model.merge_adapter()
        try:
            merged.send_weights((n, p.detach()) for n, p in _iter_vllm_named_params(model))
        finally:
            model.unmerge_adapter()
        merged.resume()

    def sync_adapter() -> None:
        adapter.pause()
        destination = adapter.adapter_directory()
        staging = destination.parent / f".{destination.name}.tmp"
        model.save_pretrained(staging)
        staging.rename(destination)
        adapter.publish_adapter()
        adapter.resume()
        adapter.retire_stale_adapter()

    for rep in range(reps + 1):  # the first of each warms the server's path up; interleaved
        for kind, sync, transfer in (("merged", sync_merged, merged), ("adapter", sync_adapter, adapter)):
            started = time.perf_counter()
            sync()
            if rep:
                figures[kind].append(time.perf_counter() - started)
                figures[f"{kind}_bytes"].append(transfer.bytes_written)
    return figures


STEP_SCRIPT = """
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, lora, reps, rank = sys.argv[1], sys.argv[2] == "lora", int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
if lora:
    from peft import get_peft_model
    from grpo_trainer.contract.config import LoraConfig
    from grpo_trainer.learner.lora import peft_config
    model = get_peft_model(model, peft_config(LoraConfig(r=rank)))
def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
def peak_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
loaded_mb = resident_mb()
with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: the steps', not the model load's
    f.write("5")
trainable = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trainable, lr=1e-6)
tokens = torch.randint(0, model.config.vocab_size, (4, 128))
times = []
for step in range(reps + 1):
    started = time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step:
        times.append(time.perf_counter() - started)
print(json.dumps({"step_s": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "loaded_mb": loaded_mb, "steps_peak_mb": peak_mb(),
                  "trainable": sum(p.numel() for p in trainable),
                  "total": sum(p.numel() for p in model.parameters())}))
"""


def step_figures(model_dir: str, lora: bool, reps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, model_dir, "lora" if lora else "full", str(reps),
                          str(RANK)],
                         capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the step benchmark failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB" if value < 1e8 else f"{value / 1e6:.0f} MB"


def run(context: Context) -> str:
    if not (ROOT / ".venv-rollout" / "bin" / "python").exists():
        raise SectionUnavailable(".venv-rollout (vLLM CPU) is missing; `make setup-rollout` builds it")
    from tests.support.servers.vllm_server import running_vllm_server

    reps = context.reps(5, 2)
    loads = [os.getloadavg()[0]]
    models = {"tiny": context.model_dir, "larger (~56M)": larger_model(context)}
    sync_rows, step_rows = [], []
    for label, model_dir in models.items():
        workdir = context.scratch / f"lora-server-{Path(model_dir).name}"
        workdir.mkdir()
        with running_vllm_server(model_dir, workdir) as server:
            figures = sync_figures(context, model_dir, server.server.url, reps)
        loads.append(os.getloadavg()[0])
        ratio = figures["merged_bytes"][0] / figures["adapter_bytes"][0]
        sync_rows.append([f"{label}: merged weights", _mb(figures["merged_bytes"][0]),
                          spread(figures["merged"], "{:.3f}", " s"), ""])
        sync_rows.append([f"{label}: adapter alone", _mb(figures["adapter_bytes"][0]),
                          spread(figures["adapter"], "{:.3f}", " s"), f"{ratio:.0f}x fewer bytes"])
        for lora in (False, True):
            step = step_figures(model_dir, lora, reps)
            step_rows.append([f"{label}: {'LoRA r=' + str(RANK) if lora else 'full fine-tuning'}",
                              f"{step['trainable']:,} of {step['total']:,}", spread(step["step_s"], "{:.3f}", " s"),
                              f"{step['peak_rss_mb']:.0f} MB",
                              f"{step['steps_peak_mb'] - step['loaded_mb']:+.0f} MB"])
        loads.append(os.getloadavg()[0])
    load_note = ", ".join(f"{load:.1f}" for load in loads)
    return (f"## {TITLE}\n\n{__doc__.split(chr(10), 1)[1].strip()}\n\n"
            + table(["sync", "bytes per sync", "time per sync", ""], sync_rows)
            + "\n\n" + table(["learner step", "trainable parameters", "time per step", "peak resident memory",
                                     "added by the steps (their peak − once loaded)"],
                             step_rows)
            + f"\n\n{reps} syncs of each kind (interleaved, after one warm-up each) and {reps} steps after a warm-up "
            f"step. The machine's 1-minute load average at the start, after each model's syncs and after its steps: "
            f"{load_note}. Its 2 cores are shared with other developers' builds and tests: the times carry their "
            "noise; the bytes and the memory do not.")
