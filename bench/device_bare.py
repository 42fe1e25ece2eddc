"""The bare device check: `python -m bench.device_check --bare [--dry-run] [--budget 480] [--report FILE]`.

For a lent GPU machine that has torch (2.11) and transformers (5.17) but no vLLM, no TRL and no package registry:
it carries the wheels `make device-wheels` puts in `.device/wheels` (bench.device_wheels: TRL, the learner's
transformers, ours and a few small packages) and installs them into its working folder, and stands the scripted
completions server (tests/support/servers/completions_server.py) where vLLM would be. On random Qwen3 models built
from a config (Qwen3-0.6B's shape, and Qwen3-1.7B's where the fit check says it fits the GPU), in this order, each
step within what is left of `--budget`:

1. install: the carried set into the working folder, each wheel's requirements read against the set and the
   machine's packages, our wheel's modules against this tree's (a wheel built from another tree is refused), and
   the learner's modules imported.
2. parity: every kernel the attention rule (grpo_trainer.learner.attention) can choose on this GPU, for head dims
   64, 128 and 256 where the rule allows it, against dense attention on packed segments in bf16 with GQA and
   bottom-right causal alignment, forward and backward (bench.attention_parity).
3. per model, learner runs to the epoch bound (`python -m grpo_trainer learner`, one rank, filesystem weight sync
   to the stand-in, which reads every checkpoint it is told to reload): one per kernel the rule can choose (the
   first model; later ones the rule's own choice) for the learner's step time, and one under fsdp2. Each rank's
   peak `torch.cuda.max_memory_allocated` (bench.peak_memory) is set against the fit check's estimate
   (grpo_operator.fit) for that strategy, the same row's tokens and one GPU.

`--dry-run` prints the plan for the lent machine (one H100) and the carried set's size on any machine, starting
nothing. Exit codes as the full check's: 2 it cannot run here (all that is missing named), 1 a step failed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import device_wheels
from .device_check import (
    EXIT_CANNOT_RUN,
    EXIT_FAILED,
    GENERATIONS,
    PROMPT_TOKENS,
    PROMPTS,
    RESULTS,
    ROOT,
    SHAPES,
    Budget,
    CannotRun,
    Figures,
    Layout,
    PhaseFailed,
    Processes,
    RunShape,
    Server,
    free_port,
    http_get,
    learner_launch,
    phase_build_model,
    phase_learner,
    probe_json,
    row_figures,
    run_config,
    say,
)
from .peak_memory import PeakMemory, read_peaks

SECTION = "device_bare"
SIZES = ("0.6b", "1.7b")
HEAD_DIMS = (64, 128, 256)
GIB = 1024**3
COMPLETIONS_SERVER = ROOT / "tests" / "support" / "servers" / "completions_server.py"
STAND_IN_TIMEOUT_S = 30
INSTALL_TIMEOUT_S = 240
PARITY_TIMEOUT_S = 240
MODEL_TIMEOUT_S = 240
LEARNER_TIMEOUT_S = 300
#: A learner run started with less of the budget left would not reach its epoch bound (start, load, 16 steps).
MIN_RUN_S = 75


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_bytes: int


#: What the dry run plans for: the lent machine's GPU (its CUDA image bakes in no FA3 kernel).
LENT_GPU = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 81559 * 1024**2)


@dataclass(frozen=True)
class Options:
    budget_s: float = 480
    epochs: float = 1
    completion_tokens: int = 256
    weight_sync_steps: int = 4
    device: str = "cuda"
    sizes: tuple[str, ...] = SIZES

    @property
    def token_budget(self) -> int:
        """Tokens per row: one group (a prompt and its completions) fits one row, as the fit check's row does."""
        return GENERATIONS * self.completion_tokens + PROMPT_TOKENS


@dataclass(frozen=True)
class Step:
    kind: str  # "parity", "model" or "run"
    text: str
    size: str | None = None
    strategy: str = "ddp"
    kernel: str | None = None
    cases: tuple[tuple[str, int], ...] = ()  # parity: (kernel, head dim)


@dataclass
class Plan:
    steps: list[Step]
    left_out: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------- plan
def model_config(size: str) -> dict:
    """The config.json of the model `size` builds (bench.device_check.qwen3_config with the tiny tokenizer)."""
    from grpo_trainer.testing.tiny_assets import build_tokenizer

    from .device_check import qwen3_config

    return qwen3_config(SHAPES[size], build_tokenizer(), dtype="bfloat16").to_dict()


def fit_estimate(config: dict, strategy: str, tokens: int):
    """The fit check's per-GPU estimate for one learner rank on one GPU (grpo_operator.fit)."""
    from grpo_operator.fit import LearnerFit, learner_estimate, model_shape

    return learner_estimate(model_shape(config), LearnerFit(device="cuda", tokens=tokens, strategy=strategy))


def plan(gpu: Gpu, facts, options: Options, configs: dict[str, dict]) -> Plan:
    """The steps for `gpu` (`facts`: grpo_trainer.learner.attention.DeviceFacts), given each size's config."""
    from grpo_operator.fit import model_shape
    from grpo_trainer.contract.codes import AttentionKernel
    from grpo_trainer.learner.attention import AUTO, AttentionUnavailable, choose_kernel

    left_out: list[str] = []
    kernels = []
    for kernel in AttentionKernel:
        try:
            choose_kernel(kernel.value, facts)
            kernels.append(kernel.value)
        except AttentionUnavailable as refused:
            why = str(refused).split(": ", 2)[-1]
            if kernel is AttentionKernel.FA3:
                why += " (this check carries no FA3 kernel: it comes from the hub, which the lent machine cannot reach)"
            left_out.append(f"{kernel.value}: {why}")
    cases = []
    for kernel in kernels:
        for head_dim in HEAD_DIMS:
            try:
                choose_kernel(kernel, facts, head_dim=head_dim)
                cases.append((kernel, head_dim))
            except AttentionUnavailable as refused:
                left_out.append(f"{kernel} at head dim {head_dim}: {str(refused).split(': ', 2)[-1]}")
    steps = [Step("parity", f"attention parity: {', '.join(f'{k} {d}' for k, d in cases)} (kernel, head dim); "
                            f"bf16, GQA, packed segments, forward and backward, against dense attention",
                  cases=tuple(cases))]
    for index, size in enumerate(options.sizes):
        config = configs[size]
        ddp = fit_estimate(config, "ddp", options.token_budget)
        if ddp.total_bytes > gpu.memory_bytes:
            left_out.append(f"{size}: the fit check estimates {ddp.total_bytes / GIB:.1f} GiB per GPU under ddp, "
                            f"more than the {gpu.memory_bytes / GIB:.0f} GiB of {gpu.name}")
            continue
        head_dim = model_shape(config).head_dim
        auto = choose_kernel(AUTO, facts, head_dim=head_dim).kernel.value
        steps.append(Step("model", f"model {size}: random Qwen3 weights ({ddp.parameters / 1e9:.2f}B parameters, "
                                   f"head dim {head_dim}), bf16, built on the GPU", size=size))
        run_kernels = [k for k in kernels if (k, head_dim) in cases] if index == 0 else [auto]
        for kernel in run_kernels:
            steps.append(Step("run", f"run {size} ddp {kernel}: learner to the epoch bound; step time, weight "
                                     f"syncs, peak memory against the fit check (ddp)",
                              size=size, kernel=kernel))
        steps.append(Step("run", f"run {size} fsdp2 {auto}: learner to the epoch bound under fsdp2 on one GPU; "
                                 f"peak memory against the fit check (fsdp2)",
                          size=size, strategy="fsdp2", kernel=auto))
    return Plan(steps, left_out)


def plan_text(gpu: Gpu, options: Options, planned: Plan, carried: device_wheels.CarriedSet) -> str:
    lines = [f"bare device check, planned for {gpu.name} (compute capability {gpu.capability[0]}.{gpu.capability[1]}, "
             f"{gpu.memory_bytes / GIB:.0f} GiB) within {options.budget_s:.0f} s:",
             "  1. install: the carried set into the working folder (pip --no-index --no-deps), each wheel's "
             "requirements against the machine's packages, our wheel against this tree, the learner's modules "
             "imported"]
    for number, step in enumerate(planned.steps, start=2):
        lines.append(f"  {number}. {step.text}")
    lines += [f"  left out: {line}" for line in planned.left_out]
    lines.append(f"  each run: {options.epochs:g} epoch(s) of {len(prompts())} prompts x {GENERATIONS} completions "
                 f"of {options.completion_tokens} tokens from the stand-in server, {options.token_budget} tokens per "
                 f"row, a filesystem weight sync every {options.weight_sync_steps} steps")
    lines.append(f"carried set ({device_wheels.DIRECTORY.relative_to(ROOT)}):")
    lines += carried.lines() if carried.wheels else ["  not built: run `make device-wheels`"]
    if carried.wheels and carried.missing:
        lines.append(f"  missing: {', '.join(carried.missing)} (run `make device-wheels`)")
    return "\n".join(lines)


def prompts() -> list[str]:
    return [line for line in PROMPTS.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------------- steps
GPU_PROBE = """
import json, torch
count = torch.cuda.device_count()
if count:
    props = torch.cuda.get_device_properties(0)
    gpu = {"name": props.name, "capability": [props.major, props.minor], "memory_bytes": props.total_memory}
else:
    gpu = None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip, "gpu": gpu}))
"""


def probe_gpu() -> dict:
    """The machine's torch and its first GPU, from a process of the machine's own Python (nothing carried)."""
    return probe_json([sys.executable, "-c", GPU_PROBE], "its GPU")


def preflight(directory: Path) -> tuple[dict, device_wheels.CarriedSet]:
    """The machine's GPU and the carried set, or CannotRun naming all that is missing."""
    problems = []
    carried = device_wheels.carried_set(directory)
    if not carried.wheels:
        problems.append(f"no carried set in {directory}: run `make device-wheels` and carry "
                        f"{directory.relative_to(ROOT) if directory.is_relative_to(ROOT) else directory}")
    elif carried.missing:
        problems.append(f"the carried set in {directory} lacks {', '.join(carried.missing)}: run `make device-wheels`")
    machine = None
    try:
        machine = probe_gpu()
    except CannotRun as why:
        problems.append(str(why))
    if machine is not None and machine["gpu"] is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        build = f"CUDA {machine['cuda']}" if machine["cuda"] else "a CPU-only build"
        problems.append(f"no CUDA device: torch {machine['torch']} ({build}) sees none"
                        + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    if problems:
        raise CannotRun("\n".join(problems))
    return machine, carried


LEARNER_IMPORTS = ("grpo_trainer.learner.main", "grpo_trainer.learner.trainer",
                   "trl.experimental.async_grpo.async_grpo_trainer", "bench.peak_memory", "grpo_operator.fit")


def step_install(processes: Processes, carried: device_wheels.CarriedSet, site: Path, timeout_s: float) -> list[str]:
    """Install the carried set into `site`; the requirements that do not match what the machine has (a note for
    the report), or PhaseFailed naming what cannot work."""
    ours = next(wheel for wheel in carried.wheels if wheel.name == device_wheels.normalized(device_wheels.OURS))
    stale = device_wheels.stale_modules(ours)
    if stale:
        raise PhaseFailed(f"install: the carried wheel {ours.path.name} was not built from this tree ({len(stale)} "
                          f"modules differ, {', '.join(stale[:3])}...): run `make device-wheels`")
    say(f"install: {len(carried.wheels)} wheels into {site}")
    run_to_end(processes, "install", device_wheels.install_argv(carried.wheels, site), timeout_s)
    problems = device_wheels.requirement_problems(carried.wheels)
    if problems.missing:
        raise PhaseFailed("install: the carried set needs what this machine lacks:\n" + "\n".join(problems.missing))
    imports = ", ".join(LEARNER_IMPORTS)
    run_to_end(processes, "imports", [sys.executable, "-c", f"import {imports}"], timeout_s)
    return problems.mismatched


def run_to_end(processes: Processes, name: str, argv: list[str], timeout_s: float, **env: str) -> None:
    process = processes.start(name, argv, **env)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        processes.stop(process)
        raise PhaseFailed(f"{name}: waited {timeout_s:.0f} s\n{processes.log_tail(name)}") from None
    if process.returncode != 0:
        raise PhaseFailed(f"{name}: exited {process.returncode}\n{processes.log_tail(name)}")


def step_parity(processes: Processes, workdir: Path, step: Step, options: Options, timeout_s: float,
                tiny: bool = False) -> list:
    """Each (kernel, head dim) of `step` against dense attention, in a process of its own (bench.attention_parity):
    bf16 on a GPU, float32 on CPU."""
    from .attention_parity import Parity

    out = workdir / "parity.json"
    dtype = "bfloat16" if options.device == "cuda" else "float32"
    say(f"parity: {len(step.cases)} cases in {dtype} on {options.device} (at most {timeout_s:.0f} s)")
    argv = [sys.executable, "-m", "bench.attention_parity", str(out), "--device", options.device, "--dtype", dtype,
            "--cases", ",".join(f"{kernel}:{head_dim}" for kernel, head_dim in step.cases), *(["--tiny"] * tiny)]
    run_to_end(processes, "parity", argv, timeout_s, CUDA_VISIBLE_DEVICES="0" if options.device == "cuda" else "")
    return [Parity(**record) for record in json.loads(out.read_text())]


def start_stand_in(processes: Processes, name: str, vocabulary: int) -> Server:
    """The scripted completions server: random non-special tokens of the model's vocabulary, each with a random
    model's logprob, and every reload read."""
    from grpo_trainer.testing.tiny_assets import SPECIAL_TOKENS

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(COMPLETIONS_SERVER), "stand-in", str(port), "--random-tokens",
            f"{len(SPECIAL_TOKENS)}:{vocabulary}", "--logprob", f"{-math.log(vocabulary):.4f}", "--verify-reload"]
    process = processes.start(name, argv)
    deadline = time.monotonic() + STAND_IN_TIMEOUT_S
    while http_get(f"{url}/health") is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise PhaseFailed(f"{name}: the stand-in server did not answer {url}/health\n{processes.log_tail(name)}")
        time.sleep(0.2)
    return Server(process, url, name)


@dataclass
class RunResult:
    step: Step
    figures: Figures | None = None
    peaks: list[PeakMemory] = field(default_factory=list)
    reloads: int = 0
    estimate: object | None = None  # grpo_operator.fit.LearnerEstimate
    note: str = ""  # why it did not run


def step_run(processes: Processes, workdir: Path, model: Path, step: Step, options: Options,
             timeout_s: float) -> RunResult:
    """One learner run to the epoch bound against the stand-in server, its peak memory recorded per rank."""
    name = f"run-{step.size}-{step.strategy}-{step.kernel}"
    rowdir = workdir / name
    rowdir.mkdir()
    config = json.loads((model / "config.json").read_text())
    server = start_stand_in(processes, f"{name}-server", config["vocab_size"])
    layout = Layout(name, "0" if options.device == "cuda" else "", "", 1, "filesystem", strategy=step.strategy)
    shape = RunShape(options.epochs, options.completion_tokens, device=options.device, attention=step.kernel,
                     token_budget=options.token_budget, weight_sync_steps=options.weight_sync_steps)
    http_port = free_port()
    config_path = rowdir / "run.json"
    config_path.write_text(json.dumps(run_config(str(model), rowdir, layout, server_url=server.url,
                                                 http_port=http_port, shape=shape)))
    peaks = rowdir / "peaks"
    argv = learner_launch(config_path, layout, entry=("-m", "bench.peak_memory", str(peaks), "learner", "--config",
                                                      str(config_path)))
    try:
        polls, final = phase_learner(processes, f"{name}-learner", config_path, argv, layout, http_port, server,
                                     timeout_s)
    finally:
        processes.stop(server.process)
    reloads = sum(line.startswith("reloaded ") for line in processes.log_tail(server.log_name, 10**6).splitlines())
    return RunResult(step, row_figures(polls, final), read_peaks(peaks), reloads,
                     fit_estimate(config, step.strategy, options.token_budget))


# -------------------------------------------------------------------------------------------------------- report
def _gib(size: float | None) -> str:
    return "n/a" if size is None else f"{size / GIB:.2f} GiB"


def parity_rows(results: Sequence) -> list[list[str]]:
    from .attention_parity import FIELDS

    rows = []
    for result in results:
        errors = (f"{result.error}" if result.error else
                  " / ".join(f"{result.errors[name]:.2e}" for name in FIELDS))
        baseline = " / ".join(f"{result.baseline[name]:.2e}" for name in FIELDS)
        rows.append([result.kernel, str(result.head_dim), result.dtype, errors, baseline,
                     "pass" if result.passed else "FAIL"])
    return rows


def run_rows(results: Sequence[RunResult]) -> list[list[str]]:
    from grpo_operator.fit import CUDA_CONTEXT_BYTES

    rows = []
    for result in results:
        step = result.step
        label = [step.size, step.strategy, step.kernel]
        if result.figures is None:
            rows.append([*label, f"not run: {result.note}", *[""] * (len(RUN_HEADER) - 4)])
            continue
        figures = result.figures
        allocated = max((p.cuda_allocated for p in result.peaks if p.cuda_allocated is not None), default=None)
        reserved = max((p.cuda_reserved for p in result.peaks if p.cuda_reserved is not None), default=None)
        estimate = result.estimate.total_bytes - CUDA_CONTEXT_BYTES if result.estimate is not None else None
        ratio = f"{estimate / allocated:.2f}" if estimate and allocated else "n/a"
        rows.append([*label, str(figures.steps),
                     "n/a" if figures.step_seconds is None else
                     f"{figures.step_seconds:.3f} s ({figures.train_step_seconds:.3f} s training)",
                     f"{figures.syncs} ({result.reloads} read by the server)",
                     "n/a" if figures.sync_seconds_mean is None else
                     f"{figures.sync_seconds_mean:.2f} / {figures.sync_seconds_last or 0:.2f} s",
                     f"{_gib(allocated)} / {_gib(reserved)}", _gib(estimate), ratio])
    return rows


PARITY_HEADER = ["kernel", "head dim", "dtype", "largest error: out / dq / dk / dv",
                 "dense attention in the same dtype", "verdict"]
RUN_HEADER = ["model", "strategy", "kernel", "steps", "step time (less syncs and waits for samples)", "weight syncs",
              "sync time (mean / last)",
              "peak allocated / reserved", "fit check's estimate (less its 1 GiB CUDA context)",
              "estimate / peak allocated"]


def report(machine: dict, options: Options, planned: Plan, parity: Sequence, runs: Sequence[RunResult],
           notes: Sequence[str]) -> str:
    from .attention_parity import FLOOR, HEADS, KV_HEADS, SEGMENTS
    from .report import table

    gpu = machine["gpu"]
    lines = [
        "## Device check, bare: the learner's kernels, steps, memory and weight sync on a lent GPU "
        "(`python -m bench.device_check --bare`)",
        "",
        f"GPU: {gpu['name']} (compute capability {gpu['capability'][0]}.{gpu['capability'][1]}). torch "
        f"{machine['torch']} (the machine's); {', '.join(machine['carried'])} (carried). Generated "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"Attention parity: each kernel as TRL's tree attention calls it, {len(SEGMENTS)} packed segments "
        f"({sum(q for q, _ in SEGMENTS)} queries, {sum(k for _, k in SEGMENTS)} keys, bottom-right causal), {HEADS} "
        f"query and {KV_HEADS} K/V heads, against one dense masked attention in float32; a kernel passes within "
        f"twice the error of dense attention in its own dtype (plus {FLOOR:g}).",
        "",
        table(PARITY_HEADER, parity_rows(parity)) if parity else "Not run.",
        "",
        f"Learner runs: {options.epochs:g} epoch(s) of {len(prompts())} prompts x {GENERATIONS} completions of "
        f"{options.completion_tokens} random tokens from the stand-in server, {options.token_budget} tokens per "
        f"row, one rank, filesystem weight sync every {options.weight_sync_steps} steps (plus the first).",
        "",
        table(RUN_HEADER, run_rows(runs)) if runs else "Not run.",
    ]
    left = [*planned.left_out, *notes]
    if left:
        lines += ["", "Left out or noted:", "", *(f"- {line}" for line in left)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- main
def dry_run(options: Options) -> int:
    from grpo_trainer.learner.attention import DeviceFacts

    facts = DeviceFacts("cuda", capability=LENT_GPU.capability)
    configs = {size: model_config(size) for size in options.sizes}
    carried = device_wheels.carried_set()
    print(plan_text(LENT_GPU, options, plan(LENT_GPU, facts, options, configs), carried))
    ours = [wheel for wheel in carried.wheels if wheel.name == device_wheels.normalized(device_wheels.OURS)]
    stale = device_wheels.stale_modules(ours[0]) if ours else []
    if stale:
        print(f"  our wheel was not built from this tree ({len(stale)} modules differ; the check refuses it): run "
              "`make device-wheels`")
    if carried.total_bytes > device_wheels.LIMIT_BYTES:
        print(f"past the device tool's {device_wheels.LIMIT_BYTES / GIB * 1024:.0f} MiB: carry less")
        return EXIT_FAILED
    return 0


@dataclass
class Results:
    parity: list = field(default_factory=list)  # bench.attention_parity.Parity
    runs: list[RunResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # a step that failed: its first line

    @property
    def passed(self) -> bool:
        return not self.failures and all(result.passed for result in self.parity)


def run(options: Options, workdir: Path | None = None) -> tuple[int, str | None]:
    """The check on this machine's GPU: (exit code, the report or None). A step that fails is reported and the
    next one runs; the exit code is 1 when any failed or any kernel missed its parity."""
    try:
        machine, carried = preflight(device_wheels.DIRECTORY)
    except CannotRun as why:
        print("device check cannot run here:", file=sys.stderr)
        for line in str(why).splitlines():
            print(f"  - {line}", file=sys.stderr)
        return EXIT_CANNOT_RUN, None
    budget = Budget(options.budget_s)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="device-bare-"))
    site = workdir / "site"
    processes = Processes(workdir, pythonpath=(site, ROOT))
    try:
        notes = step_install(processes, carried, site, budget.cap(INSTALL_TIMEOUT_S))
        sys.path[:0] = [str(site), str(ROOT)]
        from grpo_trainer.learner.attention import DeviceFacts, fa3_kernel_present

        gpu = Gpu(machine["gpu"]["name"], tuple(machine["gpu"]["capability"]), machine["gpu"]["memory_bytes"])
        facts = DeviceFacts("cuda", capability=gpu.capability, rocm=bool(machine["hip"]),
                            fa3_kernel_present=fa3_kernel_present())
        machine["carried"] = [f"{wheel.name} {wheel.version}" for wheel in carried.wheels
                              if wheel.name in ("trl", "transformers")]
        planned = plan(gpu, facts, options, {size: model_config(size) for size in options.sizes})
        for line in plan_text(gpu, options, planned, carried).splitlines():
            say(line)
        results = run_steps(processes, workdir, planned, options, budget)
    except PhaseFailed as failed:
        say(f"FAILED in {failed}")
        say(f"logs: {workdir}")
        return EXIT_FAILED, None
    finally:
        processes.stop_all()
    if results.failures:
        say(f"logs: {workdir}")
    text = report(machine, options, planned, results.parity, results.runs, [*notes, *results.failures])
    return (0 if results.passed else EXIT_FAILED), text


def run_steps(processes: Processes, workdir: Path, planned: Plan, options: Options, budget: Budget) -> Results:
    """Each planned step in turn, within `budget`; a step that fails is recorded (and said with its log's tail)."""
    results = Results()
    models: dict[str, Path] = {}
    for step in planned.steps:
        try:
            if step.kind == "parity":
                results.parity = step_parity(processes, workdir, step, options, budget.cap(PARITY_TIMEOUT_S))
            elif step.kind == "model":
                if budget.cap(float("inf")) >= MIN_RUN_S:
                    phase_build_model(processes, workdir / f"model-{step.size}", step.size,
                                      budget.cap(MODEL_TIMEOUT_S))
                    models[step.size] = workdir / f"model-{step.size}"
            elif step.size not in models:
                why = "its model was not built" if budget.cap(float("inf")) >= MIN_RUN_S else ""
                results.runs.append(RunResult(step, note=why or f"less than {MIN_RUN_S} s of the --budget left"))
            elif budget.cap(float("inf")) < MIN_RUN_S:
                results.runs.append(RunResult(step, note=f"less than {MIN_RUN_S} s of the --budget left"))
            else:
                results.runs.append(step_run(processes, workdir, models[step.size], step, options,
                                             budget.cap(LEARNER_TIMEOUT_S)))
        except PhaseFailed as failed:
            say(f"FAILED in {failed}")
            first = str(failed).splitlines()[0]
            results.failures.append(f"failed: {first}")
            if step.kind == "run":
                results.runs.append(RunResult(step, note=f"failed ({first.split(': ', 1)[-1]})"))
    return results


def main(options: Options, *, dry: bool, report_path: Path | None, write: bool) -> int:
    if dry:
        return dry_run(options)
    code, text = run(options)
    if text is None:
        return code
    print(text)
    if report_path is not None:
        report_path.write_text(text + "\n")
        say(f"wrote {report_path}")
    if write:
        from .report import splice

        RESULTS.write_text(splice(RESULTS.read_text(), SECTION, text).rstrip() + "\n")
        say(f"wrote {RESULTS}")
    return code

