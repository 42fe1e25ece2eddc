"""Section 9: the learner's wait for samples with 1, 2 and 1→2→1 rollout servers, and TRL 1.16 on the same server.

Two real vLLM CPU servers are started once, through the rollout entrypoint, from the run's own config: the tiny demo
(examples/tiny.yaml) with fewer epochs and vLLM's own `--max-num-seqs` cap per server, so that one server generates
more slowly than the learner trains and a second one adds generation capacity (the section's text says why that is
honest on shared cores and what it does not show). Runs, one after the other, on those two servers:

- ours, 1 server and 2 servers: the learner entrypoint (bench.traced_learner) to the epoch bound;
- ours, 1→2→1: starts on one server; the bench rewrites `rollout.urls` in the run config to add the second server
  once a quarter of the groups are consumed and to remove it again at two thirds; phases come from the learner's
  `/progress` (the second server serving, then gone). That file is what the operator and `grporun local scale`
  rewrite; `grporun local scale` would also start the second server then, which takes minutes on this machine (the
  start-up below), so both servers run before the first run and what is measured is the learner's side;
- TRL's unmodified AsyncGRPOTrainer on the first server with the same config, stopped after as long as our
  1-server run trained: the groups it trains before our run ends.

Each row is run three times (`--quick`: once); a repetition runs ours' 1-server run and TRL's (which its time
bounds) together, and the rows' order rotates from one repetition to the next, so that a drift in the machine's
speed falls on every row.

Figures per window of optimizer steps (all but the first step, whose wait includes start-up):
wait share = Σ `perf/rollout_wait_s` / Σ step intervals; samples trained per s = Σ `batch/samples_per_step` / Σ
step intervals. Both are TRL's own per-step figures, which both trainers log.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import Context, SectionUnavailable, spread, table

NAME = "scaling"
TITLE = "9. Rollout scaling: learner wait with 1, 2 and 1→2→1 servers, and TRL 1.16 on the same server"
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "examples" / "tiny.yaml"
#: vLLM's `--max-num-seqs` on each server: sequences one engine step decodes at once.
MAX_NUM_SEQS = 2
EPOCHS = 6
#: 1→2→1: the second server is added when this share of the groups is consumed, and removed at the second.
SCALE_UP_AT, SCALE_DOWN_AT = 0.25, 2 / 3
#: A learner's start-up alone (imports, model) took over 4 min at load average 20.
RUN_TIMEOUT_S = 1200.0
#: Two servers starting together on two loaded cores: one alone took 573 s at load average 20.
SERVER_START_TIMEOUT_S = 1500.0
POLL_S = 0.5
#: Runs of each row: a median and a spread, not one run's luck on shared cores.
REPS, QUICK_REPS = 3, 1
#: The rows in a repetition's order before rotation; ours' 1-server run bounds TRL's time, so the two stay together.
ROW_UNITS: tuple[tuple[str, ...], ...] = (("1", "trl"), ("2",), ("121",))


# ------------------------------------------------------------------------------------------------ figures (pure)
@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as bench.traced_learner logged it."""

    t: float
    step: int
    wait_s: float
    samples: float
    groups: float = 0.0
    cpu_s: float | None = None  # the learner process tree's CPU seconds so far
    #: TRL's own timings of the step's parts (`perf/fwd_bwd_s`, `perf/optimizer_s`, `perf/weight_sync_s`), where
    #: logged: what each part of the step's wall time went to.
    fwd_bwd_s: float | None = None
    optimizer_s: float | None = None
    weight_sync_s: float | None = None
    #: With `--thread-cpu`: CPU seconds so far of each thread by name (and each child process).
    threads: dict[str, float] | None = None
    #: Samples without reward signal (their group's reward std 0 or NaN) the trainer took into its batches so far.
    no_signal: float = 0.0
    #: With `--thread-cpu`: CPU seconds so far in each of the trainer's timed parts (bench.traced_learner.PARTS).
    parts: dict[str, float] | None = None
    #: The completion tokens the rollout worker received per s over the step's log window (where logged).
    generated_tok_s: float | None = None

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        data = json.loads(line)
        cpu_s = data.get("cpu_s")
        perf = data.get("perf") if isinstance(data.get("perf"), dict) else {}
        threads, parts = (_seconds_by_name(data.get(key)) for key in ("threads", "parts"))
        return cls(float(data["t"]), int(data["step"]), float(data["wait_s"]), float(data["samples"]),
                   float(data.get("groups", 0.0)), None if cpu_s is None else float(cpu_s),
                   *(_finite(perf.get(f"perf/{part}")) for part in ("fwd_bwd_s", "optimizer_s", "weight_sync_s")),
                   threads, float(data.get("no_signal", 0.0)), parts, _finite(data.get("generated_tok_s")))


def _seconds_by_name(value: Any) -> dict[str, float] | None:
    """A logged {name: seconds} map without the entries that are no number; None where none was logged."""
    if not isinstance(value, dict):
        return None
    return {name: seconds for name, item in value.items() if (seconds := _finite(item)) is not None}


def _finite(value: Any) -> float | None:
    """A logged figure, or None where it is missing or no finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class WindowFigures:
    steps: int
    seconds: float
    wait_s: float
    samples: float

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.seconds if self.seconds > 0 else math.nan

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan


def window_figures(records: Sequence[StepRecord], start: float = -math.inf, end: float = math.inf) -> WindowFigures:
    """The steps whose whole interval (previous step's log time to its own) lies in [start, end].

    The first step has no interval (its wait holds the start-up and the first weight sync) and is never counted.
    """
    ordered = sorted(records, key=lambda record: record.t)
    steps, seconds, wait_s, samples = 0, 0.0, 0.0, 0.0
    for previous, record in zip(ordered, ordered[1:], strict=False):
        if previous.t >= start and record.t <= end:
            steps += 1
            seconds += record.t - previous.t
            wait_s += record.wait_s
            samples += record.samples
    return WindowFigures(steps, seconds, wait_s, samples)


@dataclass(frozen=True)
class ServerSeen:
    """One server in one `/progress` poll."""

    state: str
    ready: bool
    samples: int


@dataclass(frozen=True)
class Poll:
    t: float
    groups_consumed: int
    servers: dict[str, ServerSeen]


@dataclass(frozen=True)
class ScalePhases:
    """1→2→1 as the learner reported it: when the second server was asked for, served, was asked to leave, left."""

    added: float
    serving: float | None
    removed: float
    gone: float | None
    samples_while_there: int


def scale_phases(polls: Sequence[Poll], second_url: str, added: float, removed: float) -> ScalePhases:
    """`serving`: the first poll after `added` with the second server ready and serving; `gone`: the first poll after
    `removed` without it; `samples_while_there`: the most completions any poll credited it with."""
    serving = next((p.t for p in polls if p.t >= added and (s := p.servers.get(second_url)) is not None
                    and s.ready and s.state == "serving"), None)
    gone = next((p.t for p in polls if p.t >= removed and second_url not in p.servers), None)
    samples = max((p.servers[second_url].samples for p in polls if second_url in p.servers), default=0)
    return ScalePhases(added, serving, removed, gone, samples)


def phase_windows(phases: ScalePhases, first: float, last: float) -> list[tuple[str, float, float]]:
    """(label, start, end) of the three steady phases; the admission and the drain between them are left out."""
    windows = [("1 server, before", first, phases.added)]
    if phases.serving is not None:
        windows.append(("2 servers", phases.serving, phases.removed))
    if phases.gone is not None:
        windows.append(("1 server, after", phases.gone, last))
    return windows


# ------------------------------------------------------------------------------------------------------------ I/O
def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group `pgid` (a server and its engine)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...; utime stime at 11, 12
                total += (int(fields[11]) + int(fields[12])) / tick
    return total


def base_config(scratch: Path, epochs: int = EPOCHS, max_num_seqs: int | None = MAX_NUM_SEQS):
    """examples/tiny.yaml resolved as `grporun local` resolves it, `epochs` long, with the per-server cap (None:
    vLLM's own default)."""
    from grpo_operator.local.plan import localize_spec
    from grpo_operator.manifest import read_grporun
    from grpo_operator.resolve import RunPlacement, resolve_run_config

    run = read_grporun(MANIFEST)
    spec = localize_spec(run.spec, MANIFEST.parent)
    spec.training.epochs = epochs
    if max_num_seqs is not None:
        spec.rollout.vllm.extra_args = [*spec.rollout.vllm.extra_args, "--max-num-seqs", str(max_num_seqs)]
    return resolve_run_config(run.name, run.namespace, spec, RunPlacement(
        rollout_urls=["http://127.0.0.1:0"], output_dir=str(scratch / "output"),
        checkpoint_dir=None, weight_sync_dir=str(scratch / "weights"),
        termination_message_path=str(scratch / "termination-log"),
    ))


def write_config(path: Path, config) -> None:
    """Whole or not at all (a learner watching the file must never read half of it)."""
    staging = path.with_suffix(".partial")
    staging.write_text(config.model_dump_json(by_alias=True, indent=2))
    os.replace(staging, path)


@dataclass
class RunResult:
    label: str
    records: list[StepRecord]
    polls: list[Poll] = field(default_factory=list)
    final: object | None = None  # contract.report.ProgressReport (ours)
    server_cpu_s: dict[str, float] = field(default_factory=dict)  # from the first step to the learner's exit
    wall_s: float = 0.0
    training_started: float = 0.0
    training_wall_s: float = 0.0
    added: float | None = None
    removed: float | None = None
    returncode: int | None = None


@dataclass(frozen=True)
class ScalePlan:
    """1→2→1: the URL list after the first and after the second step, and the consumed shares that trigger them."""

    second_url: str
    up_at: float = SCALE_UP_AT
    down_at: float = SCALE_DOWN_AT


def as_poll(report) -> Poll:
    servers = {r.url: ServerSeen(r.state.value, r.ready, r.samples) for r in report.rollout}
    return Poll(time.time(), report.groups_consumed, servers)


@dataclass
class TracedRun:
    """A bench.traced_learner run laid out in its own folder: its config (written), command and environment."""

    config: Any
    config_path: Path
    records_path: Path
    command: list[str]
    env: dict[str, str]


def lay_out_traced_run(directory: Path, kind: str, config) -> TracedRun:
    """`config` for a learner of `kind` writing everything under `directory` (created), on a port of its own."""
    from grpo_operator.local.processes import free_port

    directory.mkdir(parents=True)
    config = config.model_copy(deep=True, update={
        "output_dir": str(directory / "output"),
        "termination_message_path": str(directory / "termination-log"),
        "learner": config.learner.model_copy(update={"http_port": free_port()}),
    })
    config.rollout.weight_sync.directory = str(directory / "weights")
    config_path, records_path = directory / "run.json", directory / "steps.jsonl"
    write_config(config_path, config)
    command = [sys.executable, "-m", "bench.traced_learner", "--kind", kind, "--config", str(config_path),
               "--records", str(records_path)]
    # One OpenMP thread, as `grporun local` gives a CPU learner beside its servers on two cores; the same for both.
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return TracedRun(config, config_path, records_path, command, env)


def learner_run(scratch: Path, label: str, kind: str, config, servers: dict[str, int], *,
                scale: ScalePlan | None = None, wall_bound_s: float | None = None) -> RunResult:
    from grpo_operator.local.processes import read_progress_blocking
    from grpo_trainer.contract.report import parse_progress

    directory = scratch / label
    urls = list(config.rollout.urls)
    traced = lay_out_traced_run(directory, kind, config)
    config, config_path, records_path, command, env = (traced.config, traced.config_path, traced.records_path,
                                                       traced.command, traced.env)
    if wall_bound_s is not None:
        command += ["--wall-bound", f"{wall_bound_s:.1f}"]
    result = RunResult(label, [])
    cpu_before: dict[str, float] = {}  # at the first step: the servers idle while the learner starts
    started = time.time()
    progress_url = f"http://127.0.0.1:{config.learner.http_port}"
    with open(directory / "log.txt", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            while process.poll() is None:
                if time.time() - started > RUN_TIMEOUT_S:
                    raise RuntimeError(f"{label}: no end within {RUN_TIMEOUT_S:.0f} s; log: {directory / 'log.txt'}")
                if not cpu_before and records_path.exists():
                    cpu_before = {url: group_cpu_seconds(pgid) for url, pgid in servers.items()}
                    result.training_started = time.time()
                report = read_progress_blocking(progress_url) if kind == "ours" else None
                if report is not None:
                    result.polls.append(as_poll(report))
                    if scale is not None:
                        done = report.groups_consumed / max(report.groups_total, 1)
                        if result.added is None and done >= scale.up_at:
                            config.rollout.urls = [*urls, scale.second_url]
                            write_config(config_path, config)
                            result.added = time.time()
                        elif result.added is not None and result.removed is None and done >= scale.down_at:
                            config.rollout.urls = urls
                            write_config(config_path, config)
                            result.removed = time.time()
                time.sleep(POLL_S)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                process.wait(30)
    print(f"[bench] scaling: {label} exited {process.returncode} after {time.time() - started:.0f} s",
          file=sys.stderr, flush=True)
    result.returncode = process.returncode
    result.wall_s = time.time() - started
    if cpu_before:
        result.server_cpu_s = {url: group_cpu_seconds(pgid) - cpu_before[url] for url, pgid in servers.items()}
        result.training_wall_s = time.time() - result.training_started
    if records_path.exists():
        result.records = [StepRecord.from_json(line) for line in records_path.read_text().splitlines() if line]
    termination = directory / "termination-log"
    if termination.exists() and termination.read_text().strip():
        result.final = parse_progress(termination.read_text())
    if len(result.records) < 3:
        tail = (directory / "log.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{label}: {len(result.records)} steps recorded (exit {process.returncode}):\n{tail}")
    return result


@contextlib.contextmanager
def two_servers(config, workdir: Path):
    """Both servers started at once (each costs minutes of start-up here), stopped whatever happens."""
    import pytest

    from tests.support.servers.vllm_server import ServerStart, running_vllm_servers

    wire = json.loads(config.model_dump_json(by_alias=True))
    cores = os.cpu_count() or 1
    starts = []
    for index in range(2):
        (workdir / f"server-{index}").mkdir(parents=True)
        # vLLM's CPU backend pins every server's worker to core 0 by default; one core each, as `grporun local` does.
        starts.append(ServerStart(workdir / f"server-{index}", {"VLLM_CPU_OMP_THREADS_BIND": str(index % cores)},
                                  wire))
    try:
        with running_vllm_servers(config.model, starts, SERVER_START_TIMEOUT_S) as servers:
            yield servers
    except pytest.fail.Exception as failed:  # the helper is the tests' too; its failure is no Exception
        raise RuntimeError(f"a vLLM server did not start: {failed}") from None


def require_rollout_assets() -> None:
    """What the sections that start vLLM CPU servers need: .venv-rollout (SectionUnavailable without it) and the
    example's tiny model (built here once)."""
    if not (ROOT / ".venv-rollout" / "bin" / "python").exists():
        raise SectionUnavailable(".venv-rollout (vLLM CPU) is missing; `make setup-rollout` builds it")
    model = ROOT / "examples" / "tiny-assets" / "model"
    if not (model / "config.json").exists():
        from grpo_trainer.testing.tiny_assets import build_tiny_model

        build_tiny_model(model)


def rotation(rep: int) -> list[str]:
    """The rows in repetition `rep`: ROW_UNITS rotated by `rep`, each unit's rows in their order."""
    shift = rep % len(ROW_UNITS)
    return [key for unit in ROW_UNITS[shift:] + ROW_UNITS[:shift] for key in unit]


def run(context: Context) -> str:
    require_rollout_assets()
    scratch = context.scratch / "scaling"
    config = base_config(scratch)
    reps = context.reps(REPS, QUICK_REPS)
    load_at_start = os.getloadavg()[0]
    results: dict[str, list[RunResult]] = {key: [] for unit in ROW_UNITS for key in unit}
    servers_started = time.time()
    with two_servers(config, scratch / "servers") as (first, second):
        start_s = time.time() - servers_started
        print(f"[bench] scaling: both servers ready in {start_s:.0f} s", file=sys.stderr, flush=True)
        a, b = first.server.url, second.server.url
        groups = {a: first.process.pid, b: second.process.pid}
        one = config.model_copy(deep=True)
        one.rollout.urls = [a]
        both = config.model_copy(deep=True)
        both.rollout.urls = [a, b]
        for rep in range(reps):
            for key in rotation(rep):
                label = f"rep-{rep + 1}-{key}"
                if key == "1":
                    result = learner_run(scratch, f"{label}-ours", "ours", one, groups)
                elif key == "2":
                    result = learner_run(scratch, f"{label}-ours", "ours", both, groups)
                elif key == "trl":
                    ours = results["1"][-1].records
                    result = learner_run(scratch, label, "trl", one, groups,
                                         wall_bound_s=ours[-1].t - ours[0].t)
                else:
                    result = learner_run(scratch, f"{label}-ours", "ours", one, groups, scale=ScalePlan(b))
                results[key].append(result)
    load_at_end = os.getloadavg()[0]
    return render(config, results, a, b, start_s, (load_at_start, load_at_end))


# --------------------------------------------------------------------------------------------------------- report
HONESTY = [
    "Why the cap, and why it is honest: on GPUs each rollout server brings its own device, so a second server adds "
    "generation capacity. Here the servers and the learner share two cores: an uncapped server batches as many "
    "sequences as it is sent and one server already has all the compute a second one could use (section 5: two "
    "replicas split the requests and went no faster). vLLM's own `--max-num-seqs` (its scheduler's limit on the "
    "sequences one engine step decodes) caps what one server can generate: the engine step's cost on the tiny model "
    "is mostly fixed per step, so a server capped at a few sequences generates more slowly than the learner trains, "
    "on at most one core (each is bound to its own; the CPU column, read from /proc from each run's first step to its "
    "end, shows what each server used), and the second server's capacity is real work on the second core, not a "
    "sleep or a stand-in. "
    "Nothing in the learner or its router knows about the cap: they see a slow server, as they would see a busy "
    "GPU server.",
    "",
    "What it does not show: how much a second server speeds up a real run. The gain here is bounded by the second "
    "core, which the learner and other jobs on this machine also use (the load average is beside the figures); on "
    "GPUs the cap is the device's own batch limit and the gain is the second device's. It does not show start-up "
    "cost (both servers start before the runs; a server's start-up took minutes here, section 5), more than two "
    "servers, or a model whose per-token cost dominates the engine step. Shared cores: compare rows of this table with "
    "each other, not with other sections.",
    "",
    "TRL's row: TRL's own AsyncGRPOTrainer and rollout worker straight to server A, with the filesystem weight sync "
    "(TRL's own transfer needs NCCL), stopped at its own epoch end or after as long as our 1-server run trained, "
    "whichever came first. TRL trains groups without "
    "reward signal that ours drops (`filter.dropNoSignal`), so its samples trained per s counts samples ours would "
    f"not train. Reproduce: `.venv/bin/python -m bench scaling` ({REPS} runs of each row, `--quick` one; needs "
    ".venv-rollout).",
]


def _figure_cells(figures: Sequence[WindowFigures]) -> list[str]:
    return [spread([f.steps for f in figures], "{:.0f}"), spread([f.seconds for f in figures], "{:.1f}"),
            spread([100 * f.wait_share for f in figures], "{:.0f}", " %"),
            spread([f.samples_per_s for f in figures], "{:.1f}")]


def _distinct(values: Iterable[str], separator: str = ", ") -> str:
    """The values in their order, each once."""
    return separator.join(dict.fromkeys(values)) or "n/a"


def _counts(final) -> str:
    if final is None:
        return "n/a"
    return (f"{final.groups_consumed}/{final.groups_total} / {final.groups_trained} / {final.dropped_total}")


def _split(final, urls: Iterable[str]) -> str:
    if final is None:
        return "n/a"
    by_url = {replica.url: replica.samples for replica in final.rollout}
    return " / ".join(str(by_url.get(url, "left")) for url in urls)


def _cpu(results: Sequence[RunResult], urls: Sequence[str]) -> str:
    measured = [result for result in results if result.server_cpu_s and result.training_wall_s > 0]
    if not measured:
        return "n/a"
    return " / ".join(spread([r.server_cpu_s[url] / r.training_wall_s for r in measured], "{:.2f}") for url in urls)


def render(config, results: dict[str, list[RunResult]], a: str, b: str, start_s: float,
           loads: tuple[float, float]) -> str:
    generations = config.training.num_generations
    rows = []
    for key, label, urls in (("1", "ours, 1 server", [a]), ("2", "ours, 2 servers", [a, b]),
                             ("121", "ours, 1→2→1 (whole run)", [a, b])):
        runs = results[key]
        rows.append([label, len(runs), *_figure_cells([window_figures(r.records) for r in runs]),
                     _distinct(_counts(r.final) for r in runs), _distinct((_split(r.final, urls) for r in runs), "; "),
                     _cpu(runs, [a, b])])
    trl = results["trl"]
    trained = _distinct(f"{sum(record.groups for record in r.records):.0f}" for r in trl)
    rows.append(["TRL AsyncGRPOTrainer, 1 server", len(trl), *_figure_cells([window_figures(r.records) for r in trl]),
                 f"— / {trained} / — (its own count)", "—", _cpu(trl, [a, b])])
    totals = _distinct(str(r.final.groups_total) for r in results["1"] if r.final) or "?"
    text = [
        f"## {TITLE}",
        "",
        __doc__.split("\n", 1)[1].strip(),
        "",
        f"Config: examples/tiny.yaml (groups of {generations}, completions ≤ "
        f"{config.training.max_completion_length} tokens, token budget {config.training.token_budget}, "
        f"`max_inflight_tasks` {config.training.extra_args.get('max_inflight_tasks')}), {EPOCHS} epochs "
        f"({totals} groups), vLLM "
        f"`--max-num-seqs {MAX_NUM_SEQS}` per server, one core bound per server, one OpenMP thread for the learner. "
        f"Both servers started together in {start_s:.0f} s. Load average (1 min) {loads[0]:.1f} at the start of the "
        f"section, {loads[1]:.1f} at its end, on 2 cores.",
        "",
        "Each row's runs: median (min–max) over them; the counts and the completions per server, each run's (the same "
        "value once).",
        "",
        table(["run", "runs", "steps counted", "training s", "learner wait share", "samples trained per s",
               "groups consumed / trained / dropped",
               "completions per server (A / B, the learner's final count; left: drained, gone from it)",
               "server CPU, cores (A / B, first step to exit)"], rows),
    ]
    text += ["", *HONESTY]
    text += ["", *_scaled_phases(results["121"], b)]
    return "\n".join(text)


def _scaled_phases(runs: Sequence[RunResult], b: str) -> list[str]:
    """The 1→2→1 runs by phase: each phase's figures over the runs that scaled twice."""
    scaled = [run for run in runs if run.added is not None and run.removed is not None]
    if not scaled:
        return ["1→2→1: no run ended after the bench scaled it twice."]
    by_phase: dict[str, list[WindowFigures]] = {}
    admissions, drains, served = [], [], []
    for run in scaled:
        phases = scale_phases(run.polls, b, run.added, run.removed)
        for label, start, end in phase_windows(phases, run.records[0].t, run.records[-1].t):
            by_phase.setdefault(label, []).append(window_figures(run.records, start, end))
        if phases.serving is not None:
            admissions.append(phases.serving - phases.added)
        if phases.gone is not None:
            drains.append(phases.gone - phases.removed)
        served.append(phases.samples_while_there)
    admit = f"{spread(admissions, '{:.1f}')} s" if admissions else "never (within the runs)"
    drain = f"{spread(drains, '{:.1f}')} s" if drains else "not before the runs ended"
    unscaled = len(runs) - len(scaled)
    return [
        f"1→2→1 by phase, over the {len(scaled)} run{'' if len(scaled) == 1 else 's'} scaled twice"
        f"{f' ({unscaled} ended before the second change)' if unscaled else ''} (steps wholly inside each phase; "
        f"the admission and the drain are left out): second server added to `rollout.urls` → serving: {admit}; "
        f"removed → gone from the learner's report: {drain}; completions it served while it was there: "
        f"{spread(served, '{:.0f}')}.",
        "",
        table(["phase", "runs", "steps counted", "training s", "learner wait share", "samples trained per s"],
              [[label, len(figures), *_figure_cells(figures)] for label, figures in by_phase.items()]),
    ]
