"""bench/device_bare.py on CPU: the dry run's plan for the lent machine, the plan on other GPUs, the refusal without
a CUDA device, and the steps that run at tiny size here: attention parity (sdpa, float32) and a learner run to its
epoch bound against the stand-in completions server, syncing its weights through the filesystem."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import device_bare as db
from bench import device_wheels
from bench.attention_parity import Parity
from bench.device_check import EXIT_CANNOT_RUN, TREE_PATH, Budget, Figures, Processes, build_model
from bench.peak_memory import PeakMemory
from grpo_trainer.learner.attention import DeviceFacts
from tests.support.paths import REPO

GIB = 1024**3


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {size: db.model_config(size) for size in db.SIZES}


def test_the_dry_run_plans_the_lent_machine_and_measures_the_carried_set():
    done = subprocess.run([sys.executable, "-m", "bench.device_check", "--bare", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    carried = device_wheels.carried_set()
    built = bool(carried.wheels) and not carried.missing
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert text.startswith("bare device check, planned for NVIDIA H100 80GB HBM3 (compute capability 9.0, 80 GiB)")
    steps = [line.split(". ", 1)[1] for line in text.splitlines() if line[:5].strip().rstrip(".").isdigit()]
    assert steps[0].startswith("install: the carried set")
    assert steps[1].startswith("attention parity: varlen 64, varlen 128, varlen 256, sdpa 64, sdpa 128, sdpa 256")
    assert [step.split(":")[0] for step in steps[2:]] == [
        "model 0.6b", "run 0.6b ddp varlen", "run 0.6b ddp sdpa", "run 0.6b fsdp2 varlen",
        "model 1.7b", "run 1.7b ddp varlen", "run 1.7b fsdp2 varlen"]
    assert "left out: fa3: the kernel is not in this image" in text
    assert ("wheels " in text and "of the device tool's 64 MiB" in text) if built else "not built" in text
    print(text)


def test_the_plan_follows_the_rule_and_the_fit_check_on_other_gpus(configs):
    options = db.Options()
    a2 = db.Gpu("NVIDIA A2", (8, 6), 16 * GIB)
    planned = db.plan(a2, DeviceFacts("cuda", capability=a2.capability), options, configs)
    parity = planned.steps[0]
    assert ("varlen", 256) not in parity.cases and ("sdpa", 256) in parity.cases and ("varlen", 128) in parity.cases
    assert any(line.startswith("varlen at head dim 256: its backward has no kernel") for line in planned.left_out)
    assert any(line.startswith("1.7b: the fit check estimates") and "more than the 16 GiB of NVIDIA A2" in line
               for line in planned.left_out)
    assert {step.size for step in planned.steps if step.kind == "run"} == {"0.6b"}
    t4 = db.Gpu("Tesla T4", (7, 5), 16 * GIB)
    planned = db.plan(t4, DeviceFacts("cuda", capability=t4.capability), options, configs)
    assert {kernel for kernel, _ in planned.steps[0].cases} == {"sdpa"}
    assert [(step.strategy, step.kernel) for step in planned.steps if step.kind == "run"] == [("ddp", "sdpa"),
                                                                                              ("fsdp2", "sdpa")]


def test_the_fit_estimate_is_the_fit_checks_for_the_rows_tokens(configs):
    ddp = db.fit_estimate(configs["0.6b"], "ddp", db.Options().token_budget)
    fsdp2 = db.fit_estimate(configs["0.6b"], "fsdp2", db.Options().token_budget)
    assert ddp.tokens == 8 * 256 + 128 and 0.4e9 < ddp.parameters < 0.5e9
    assert (ddp.state_bytes, ddp.bucket_bytes) == (16 * ddp.parameters, 0)  # one rank: no DDP buckets
    assert fsdp2.state_bytes == ddp.state_bytes and fsdp2.gathered_bytes > 0  # one rank shards nothing


def test_without_a_cuda_device_it_says_so_and_exits_without_a_traceback():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.device_check", "--bare", "--budget", "5"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_CANNOT_RUN, done.stderr
    assert "device check cannot run here" in done.stderr and "no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_parity_step_runs_the_kernels_in_a_process_of_their_own(tmp_path):
    processes = Processes(tmp_path, TREE_PATH)
    step = db.Step("parity", "parity", cases=(("sdpa", 32), ("sdpa", 64)))
    try:
        results = db.step_parity(processes, tmp_path, step, db.Options(device="cpu"), 300, tiny=True)
    finally:
        processes.stop_all()
    assert [(r.kernel, r.head_dim, r.dtype, r.passed) for r in results] == [("sdpa", 32, "float32", True),
                                                                            ("sdpa", 64, "float32", True)]


def test_a_step_that_fails_is_reported_and_the_next_one_runs(tmp_path):
    """On CPU the model's build (on CUDA) fails, and so does a parity case of a kernel that does not exist: both
    are recorded, the model's runs are reported as not run, and the check does not pass."""
    processes = Processes(tmp_path, TREE_PATH)
    planned = db.Plan([db.Step("parity", "", cases=(("nope", 32),)), db.Step("model", "", size="tiny"),
                       db.Step("run", "", size="tiny", kernel="sdpa")])
    try:
        results = db.run_steps(processes, tmp_path, planned, db.Options(device="cpu"), Budget(600))
    finally:
        processes.stop_all()
    assert [line.split(":")[:2] for line in results.failures] == [["failed", " parity"], ["failed", " model"]]
    assert results.parity == [] and not results.passed
    (run,) = results.runs
    assert run.figures is None and run.note == "its model was not built"
    skipped = db.run_steps(processes, tmp_path, db.Plan(planned.steps[1:]), db.Options(device="cpu"), Budget(0))
    assert skipped.failures == [] and skipped.runs[0].note == f"less than {db.MIN_RUN_S} s of the --budget left"


def test_the_report_names_the_machine_each_verdict_and_what_was_left_out():
    machine = {"gpu": {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}, "torch": "2.11.0+cu130",
               "carried": ["transformers 5.24.0", "trl 1.16.0"]}
    fields = {"out": 1e-3, "dq": 2e-3, "dk": 3e-3, "dv": 4e-3}
    parity = [Parity("varlen", 128, "bfloat16", fields, fields),
              Parity("varlen", 256, "bfloat16", {}, fields, error="RuntimeError: no kernel")]
    options = db.Options()
    estimate = db.fit_estimate(db.model_config("0.6b"), "ddp", options.token_budget)
    figures = Figures(steps=16, step_seconds=0.25, train_step_seconds=0.2, syncs=5, sync_seconds_mean=1.5,
                      sync_seconds_last=1.2)
    ran = db.RunResult(db.Step("run", "", size="0.6b", kernel="varlen"), figures,
                       [PeakMemory(0, 8 * GIB, 9 * GIB, 20 * GIB)], 5, estimate)
    skipped = db.RunResult(db.Step("run", "", size="1.7b", strategy="fsdp2", kernel="varlen"), note="budget")
    text = db.report(machine, options, db.Plan([], ["fa3: not here"]), parity, [ran, skipped], ["a note"])
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in text and "torch 2.11.0+cu130" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1].endswith("| pass |") and "RuntimeError: no kernel" in rows[2] and rows[2].endswith("| FAIL |")
    assert rows[4].startswith("| 0.6b | ddp | varlen | 16 | 0.250 s (0.200 s training) | 5 (5 read by the server) | "
                              "1.50 / 1.20 s | 8.00 GiB / 9.00 GiB |")
    assert f"| {(estimate.total_bytes - GIB) / (8 * GIB):.2f} |" in rows[4]
    assert "| 1.7b | fsdp2 | varlen | not run: budget |" in rows[5]
    assert "- fa3: not here" in text and "- a note" in text


def test_a_report_from_the_gpu_machine_is_spliced_into_its_section(tmp_path, monkeypatch):
    from bench import device_check
    from bench.report import section_body

    results = tmp_path / "BENCHMARKS.md"
    results.write_text((REPO / "BENCHMARKS.md").read_text())
    report = tmp_path / "device-bare.md"
    report.write_text("## Device check, bare\n\nH100 figures\n")
    monkeypatch.setattr(device_check, "RESULTS", results)
    assert device_check.main(["--bare", "--splice", str(report)]) == 0
    written = results.read_text()
    assert section_body(written, db.SECTION) == "## Device check, bare\n\nH100 figures"
    assert section_body(written, device_check.SECTION) == section_body((REPO / "BENCHMARKS.md").read_text(),
                                                                       device_check.SECTION)


@pytest.mark.slow
def test_a_learner_run_reaches_its_epoch_bound_syncing_every_checkpoint_to_the_stand_in(tmp_path):
    """What each run of the check does, at tiny size on CPU: the real learner (`bench.peak_memory` around its
    entrypoint) against the stand-in completions server, which reads every checkpoint a sync tells it to reload."""
    model = tmp_path / "model"
    build_model(model, "tiny", "cpu")
    processes = Processes(tmp_path, TREE_PATH)
    options = db.Options(device="cpu", completion_tokens=16, weight_sync_steps=2)
    step = db.Step("run", "run tiny ddp sdpa", size="tiny", kernel="sdpa")
    try:
        result = db.step_run(processes, tmp_path, model, step, options, 600)
    finally:
        processes.stop_all()
    assert processes.running == []
    figures = result.figures
    assert figures.steps >= 1 and figures.attention_kernel == "sdpa"
    assert figures.syncs >= 2 and result.reloads == figures.syncs  # the first sync and every 2 steps, all read
    (peak,) = result.peaks
    assert peak.rank == 0 and peak.cuda_allocated is None and peak.max_rss > 0
    assert result.estimate.strategy == "ddp" and result.estimate.tokens == options.token_budget
    (row,) = db.run_rows([result])
    assert row[:4] == ["tiny", "ddp", "sdpa", str(figures.steps)]
