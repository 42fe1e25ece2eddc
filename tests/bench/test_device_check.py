"""bench/device_check.py on CPU: the model it builds, the run config it writes, the figures it reads from the
learner's /progress and the server's /metrics, and its refusal on a machine without a CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import device_check as dc
from grpo_trainer.contract.config import load_run_config
from grpo_trainer.contract.report import parse_progress

ROOT = Path(__file__).resolve().parents[2]


def test_builds_a_qwen3_model_that_transformers_loads(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    parameters = dc.build_model(tmp_path, "tiny", "cpu")
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "qwen3"
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (64, 2, 1, 32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("say apple", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_the_device_size_has_qwen3_0_6b_shape():
    from grpo_trainer.testing.tiny_assets import build_tokenizer

    config = dc.qwen3_config(dc.SHAPES["0.6b"], build_tokenizer(), dtype="bfloat16")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1024, 3072, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_every_layout_writes_a_run_config_the_contract_accepts(tmp_path, gpus):
    for layout in dc.plan_layouts(gpus):
        wire = dc.run_config("/models/qwen3", tmp_path, layout, server_url="http://127.0.0.1:8000", http_port=8081,
                             shape=dc.RunShape(epochs=2, completion_tokens=256))
        config = load_run_config(json.dumps(wire))
        assert config.rollout.weight_sync.mode == layout.sync
        assert config.learner.processes_per_node == layout.ranks
        assert config.learner.strategy == layout.strategy
        assert (config.learner.device, config.rollout.device) == ("cuda", "cuda")
        assert config.rollout.max_model_len >= config.training.max_completion_length
        if layout.sync == "filesystem":
            assert config.rollout.weight_sync.directory


def test_layouts_give_nccl_its_own_gpu_and_several_ranks_the_filesystem():
    assert dc.plan_layouts(0) == []
    (alone,) = dc.plan_layouts(1)
    assert (alone.learner_gpus, alone.server_gpu, alone.sync) == ("0", "0", "filesystem")
    assert dc.plan_layouts(1, "nccl")[0].sync == "nccl"
    single, ranks = dc.plan_layouts(2)
    assert (single.ranks, single.sync, single.server_gpu) == (1, "nccl", "1")
    assert (ranks.ranks, ranks.learner_gpus, ranks.sync, ranks.strategy) == (2, "0,1", "filesystem", "fsdp2")
    assert single.strategy == alone.strategy == "ddp"
    assert dc.plan_layouts(3)[1].server_gpu == "2"


def _progress(step: int, syncs: int, sync_seconds: float, last: float | None, kernel: str | None = "varlen",
              waited: float = 0.0) -> str:
    report = {"phase": "Running", "globalStep": step, "weightSyncs": syncs, "weightSyncSeconds": sync_seconds,
              "weightSyncLastSeconds": last, "attentionKernel": kernel, "rolloutWaitSeconds": waited,
              "aFieldOfANewerLearner": 1}
    return json.dumps(report)


def test_figures_from_progress_reports_metrics_and_memory():
    metrics = ('# HELP vllm:generation_tokens_total Number of generation tokens processed.\n'
               '# TYPE vllm:generation_tokens_total counter\n'
               'vllm:generation_tokens_total{{engine="0",model_name="m"}} {}\n'
               'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 99999.0\n')
    looks = [  # time, step, syncs, sync seconds, last sync, waited for samples, generated tokens, MiB (learner, server)
        (0.0, 0, 1, 2.0, 2.0, 0.0, 500.0, [3000], [40000]),
        (1.0, 1, 2, 2.5, 0.5, 0.01, 2000.0, [9000], [40100]),
        (1.5, 1, 2, 2.5, 0.5, 0.02, 3000.0, [9500], [40100]),
        (2.0, 3, 4, 3.5, 0.5, 0.03, 4000.0, [9400], [40000]),
        (3.0, 5, 6, 4.4, 0.4, 0.05, 6000.0, [9200], [40050]),
    ]
    polls = [dc.Poll(time=t, progress=parse_progress(_progress(step, syncs, total, last, waited=waited)),
                     generated_tokens=dc.generated_tokens(metrics.format(tokens)), learner_mib=lm, server_mib=sm)
             for t, step, syncs, total, last, waited, tokens, lm, sm in looks]
    polls.append(dc.Poll(time=3.5))  # the learner had stopped answering
    final = parse_progress(_progress(6, 7, 4.9, 0.5))

    figures = dc.row_figures(polls, final)

    assert figures.steps == 6 and figures.syncs == 7
    assert figures.step_seconds == pytest.approx((3.0 - 1.0) / (5 - 1))
    assert figures.train_step_seconds == pytest.approx((3.0 - 1.0 - (4.4 - 2.5) - (0.05 - 0.01)) / (5 - 1))
    assert figures.tokens_per_second == pytest.approx((6000 - 2000) / (3.0 - 1.0))
    assert figures.sync_seconds_mean == pytest.approx(4.9 / 7)
    assert figures.sync_seconds_last == pytest.approx(0.5)
    assert (figures.learner_peak_mib, figures.server_peak_mib) == (9500, 40100)
    assert figures.attention_kernel == "varlen"
    row = dc.table_row(dc.plan_layouts(1)[0], figures)
    assert row[3] == "0.500 s" and row[4] == "2,000 tokens/s" and row[-1] == "varlen"


def test_figures_say_nothing_they_did_not_see():
    figures = dc.row_figures([dc.Poll(time=0.0), dc.Poll(time=1.0, generated_tokens=10.0)])
    assert figures == dc.Figures()
    assert "n/a" in dc.table_row(dc.plan_layouts(1)[0], figures)[3]
    assert dc.generated_tokens("# nothing here\n") is None


def test_compute_apps_reads_nvidia_smi_csv():
    assert dc.compute_apps("123, 4567\n 89, 10\n[Not Supported], 5\n\n") == {123: 4567, 89: 10}


def test_without_a_cuda_device_it_says_so_and_exits_without_a_traceback():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GRPO_ROLLOUT_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-m", "bench.device_check", "--budget", "5"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == dc.EXIT_CANNOT_RUN, done.stderr
    assert "device check cannot run here" in done.stderr
    assert "no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_report_names_the_machine_and_a_row_the_budget_left_out():
    import argparse

    machine = {"gpus": ["NVIDIA H200"], "learner": {"torch": "2.13.0", "trl": "1.16.0"}, "rollout": {"vllm": "0.32.0"}}
    single, ranks = dc.plan_layouts(2)
    args = argparse.Namespace(epochs=2.0, completion_tokens=256)
    text = dc.report(machine, "0.6b", 440_000_000, [(single, dc.Figures(steps=3)), (ranks, None)], args)
    assert "NVIDIA H200" in text and "torch 2.13.0" in text and "vLLM 0.32.0" in text and "0.44B" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(lines) == 3 and all(line.count("|") == len(dc.HEADER) + 1 for line in lines)
    assert "not run: the --budget ran out" in lines[2]


def test_a_whole_bench_run_keeps_the_device_section(tmp_path, monkeypatch):
    """The GPU figures come from another machine: `python -m bench` on CPU must not drop them."""
    import bench.__main__ as bench_main
    from bench.report import section_body, splice

    monkeypatch.setattr(bench_main, "run_section", lambda name, _context: f"## {name}\n\nfigures")
    monkeypatch.setattr(bench_main, "machine", lambda _root: "a CPU machine")
    output = tmp_path / "BENCHMARKS.md"
    output.write_text(splice(bench_main.HEADER, dc.SECTION, "## Device check\n\nH200 figures"))

    assert bench_main.main(["--output", str(output)]) == 0

    written = output.read_text()
    assert section_body(written, dc.SECTION) == "## Device check\n\nH200 figures"
    assert section_body(written, "pipeline") == "## pipeline\n\nfigures"
    assert written.index("bench:scaling") < written.index(f"bench:{dc.SECTION}")


def _machine(gpus: int, missing: list[str]) -> dict:
    return {"missing": missing, "versions": {"torch": "2.13.0"},
            "cuda": {"count": gpus, "build": "13.0", "names": ["NVIDIA H200"] * gpus}}


@pytest.mark.parametrize(("gpus", "sync", "needs_vllm"), [
    (1, "auto", False), (2, "auto", True), (1, "nccl", True), (2, "filesystem", False),
])
def test_the_learner_needs_vllm_only_where_a_row_syncs_over_nccl(monkeypatch, gpus, sync, needs_vllm):
    monkeypatch.setattr(dc, "probe", lambda python, modules: _machine(gpus, ["vllm"] if python == sys.executable
                                                                      else []))
    if needs_vllm:
        with pytest.raises(dc.CannotRun, match="cannot import vllm, which NCCL weight sync needs"):
            dc.preflight("/opt/rollout/bin/python", sync)
    else:
        assert dc.preflight("/opt/rollout/bin/python", sync)["gpus"] == ["NVIDIA H200"] * gpus


def test_every_missing_thing_is_named_at_once(monkeypatch):
    def probe(python, modules):
        if python == sys.executable:
            return _machine(0, ["trl", "pydantic", "vllm"])
        raise dc.CannotRun(f"{python} could not be run to look at its packages: no such file")

    monkeypatch.setattr(dc, "probe", probe)
    with pytest.raises(dc.CannotRun) as raised:
        dc.preflight("/nowhere/python", "auto")
    lines = str(raised.value).splitlines()
    assert len(lines) == 4
    assert "cannot import: trl, pydantic" in lines[0] and "no CUDA device" in lines[1]
    assert "vllm" in lines[2] and "/nowhere/python" in lines[3]


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_rank_in_its_own_session_is_counted_and_ended_with_its_launcher(tmp_path):
    """torch's launcher starts each learner rank in a new session: it is the learner's all the same."""
    processes = dc.Processes(tmp_path)
    launcher = processes.start("launcher", [sys.executable, "-c", (
        "import subprocess, sys, time; rank = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        "print(rank.pid, flush=True); time.sleep(300)")])
    try:
        for _ in range(100):
            if processes.log_tail("launcher").strip().isdigit():
                break
            time.sleep(0.1)
        rank = int(processes.log_tail("launcher"))
        assert os.getsid(rank) != os.getsid(launcher.pid)
        assert rank in dc.descendants(launcher.pid)
        assert dc.owner(rank, {"learner": launcher.pid, "server": os.getpid() + 10**7}) == "learner"
        assert dc.owner(os.getpid(), {"learner": launcher.pid}) is None
    finally:
        processes.stop_all()
    assert launcher.returncode is not None and processes.running == []
    assert _state(rank) in (None, "Z")  # ended (a zombie only until its new parent reaps it)
