"""Section 11: our learner against TRL 1.16's AsyncGRPOTrainer, end to end, in interleaved pairs on one server.

Per row, one vLLM CPU server is started once, through the rollout entrypoint (from .venv-rollout), from the run's own
config: examples/tiny.yaml with the bench's epochs. Rows: learner-bound (the server uncapped: it outpaces the
learner) and generation-bound (vLLM's `--max-num-seqs 2`, section 9's cap: the learner waits for samples). On that
server, pairs of runs, each to its epoch bound: ours (the learner entrypoint, `python -m grpo_trainer learner`) and
TRL's unmodified AsyncGRPOTrainer built from the same config, both through bench.traced_learner. The order within a
pair alternates (ours first in the first pair, TRL first in the second, ...) so that a drift in the machine's load
falls on both sides alike, and the server is given the model's own weights again before every run, so that each run
starts from the same policy.
Layouts: shared cores (the default: vLLM binds the server's OpenMP worker to core 0, the learner goes wherever the
scheduler puts it) or own cores (`--layout own-cores`: every process of the server on the first core, the learner on
the others, so neither waits for the other's core; there the uncapped server may no longer outpace the learner).

Both sides are observed the same way: neither is polled while it runs. Every figure comes from what the learner
process recorded itself: one line per optimizer step (its wall time, TRL's own per-step figures, which both trainers
log, and the CPU seconds its process and children had used), and for ours its final report (the termination
message: groups consumed and dropped by reason). TRL keeps no such report; it trains every group it consumes.

Figures per run, over the steps after the first (the first step's wait holds the start-up and the first sync):
wall time = last step's log time − first step's; groups consumed = Σ `batch/groups_per_step` (the groups a step
began to train, counted by TRL's collator on both sides) + ours' groups dropped before the batch; groups consumed per
s = those groups / the time to the last step that began a group; samples trained per s = Σ `batch/samples_per_step` /
wall time; learner wait share = Σ `perf/rollout_wait_s` / wall time; CPU s per group = the process tree's CPU seconds
from the first step to the last / those groups. Ratios are ours / TRL within a pair (above 1: ours faster; for CPU
per group, below 1: ours cheaper).

Both sides begin the epoch's last group with samples of the last groups still in their queue. TRL stops
there; ours trains those samples first (the epoch bound is every sample of the epoch trained), one step
more that begins no group. That step is in ours' wall time, samples and CPU, not in the time its groups per s are
taken over: both sides' groups per s cover the same work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .no_signal import REWARD_FUNCTION, write_prompts
from .report import Context, spread, table
from .rollout_scaling import MAX_NUM_SEQS, StepRecord, base_config, lay_out_traced_run, require_rollout_assets
from .traced_learner import CHILD_PREFIX, PARTS

NAME = "e2e_vs_trl"
TITLE = "11. Ours vs TRL 1.16, end to end: interleaved pairs on one vLLM CPU server"
ROOT = Path(__file__).resolve().parent.parent
@dataclass(frozen=True)
class RowKind:
    """`max_num_seqs`: vLLM's `--max-num-seqs` on the row's server (None: vLLM's default, the server outpaces the
    learner); `no_signal`: the task where a share of the prompts carries no reward signal (bench.no_signal)."""

    max_num_seqs: int | None = None
    no_signal: bool = False


ROWS: dict[str, RowKind] = {"learner-bound": RowKind(), "generation-bound": RowKind(MAX_NUM_SEQS),
                            "no-signal": RowKind(no_signal=True)}
PAIRS, QUICK_PAIRS = 5, 2
EPOCHS = 6
#: A learner's start-up alone (imports, model) took over 4 min at load average 20 (section 9).
RUN_TIMEOUT_S = 1800.0
SERVER_START_TIMEOUT_S = 1500.0


@dataclass(frozen=True)
class Layout:
    """Where a row's server and learners run: `server_cores` every process of the server is bound to (None: its
    OpenMP worker alone, to core 0, by vLLM), `learner_cores` each learner's (None: wherever the scheduler puts it)."""

    name: str
    server_cores: frozenset[int] | None
    learner_cores: frozenset[int] | None


SHARED = Layout("shared cores", None, None)


def layouts(cores: Sequence[int]) -> list[Layout]:
    """Shared cores always; own cores where there is a core beside the server's."""
    if len(cores) < 2:
        return [SHARED]
    first, *rest = sorted(cores)
    return [SHARED, Layout("own cores", frozenset({first}), frozenset(rest))]


#: `--layout`'s values -> the layout's name.
LAYOUT_OPTIONS = {"shared": "shared cores", "own-cores": "own cores"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("e2e_vs_trl")
    group.add_argument("--pairs", type=int, default=None,
                       help=f"interleaved ours/TRL pairs per row (default {PAIRS}; --quick: {QUICK_PAIRS})")
    group.add_argument("--epochs", type=int, default=EPOCHS, help=f"each run's epoch bound (default {EPOCHS})")
    group.add_argument("--rows", default=",".join(ROWS),
                       help=f"comma-separated rows to run, any of {', '.join(ROWS)} (default: all)")
    group.add_argument("--layout", choices=tuple(LAYOUT_OPTIONS), default="shared",
                       help="shared: the server's OpenMP worker on core 0, each learner wherever the scheduler puts "
                            "it (default); own-cores: every process of the server on core 0, each learner on the "
                            "other cores")
    group.add_argument("--profile", type=Path, default=None, metavar="DIR",
                       help="sample every run with py-spy (the learner, its threads and its children) into "
                            "DIR/<row>-pair-<n>-<ours|trl>.txt, folded stacks, and its step records with each "
                            "thread's CPU seconds beside it (.steps.jsonl); the figures then carry their cost")
    group.add_argument("--thread-cpu", action="store_true",
                       help="record each run's CPU by thread, child and part of the trainer, and show where each "
                            "side's CPU went (the recording's own CPU, a few ms per step, is in both sides' figures)")
    group.add_argument("--keep", type=Path, default=None, metavar="DIR",
                       help="copy every run's folder (its step records with TRL's per-step timings, its log, "
                            "its run config and final report) into DIR/<row>/ when it ends")


def options(args: argparse.Namespace) -> dict[str, object]:
    """The section's options from the bench's command line; a wrong one is the parser's error."""
    rows = tuple(name.strip() for name in args.rows.split(",") if name.strip())
    unknown = [name for name in rows if name not in ROWS]
    if unknown or not rows:
        raise ValueError(f"--rows: unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}" if unknown
                         else "--rows: name at least one row")
    if args.pairs is not None and args.pairs < 1:
        raise ValueError("--pairs: must be at least 1")
    if args.epochs < 1:
        raise ValueError("--epochs: must be at least 1")
    cores = sorted(os.sched_getaffinity(0))
    [layout] = [layout for layout in layouts(cores) if layout.name == LAYOUT_OPTIONS[args.layout]] or [None]
    if layout is None:
        raise ValueError(f"--layout {args.layout}: needs a core beside the server's; this process has {len(cores)}")
    if args.profile is not None and not py_spy():
        raise ValueError("--profile: py-spy is not installed (`.venv/bin/uv pip install --python .venv/bin/python "
                         "py-spy`)")
    return {"pairs": args.pairs, "epochs": args.epochs, "rows": rows, "profile": args.profile, "keep": args.keep,
            "layout": layout, "thread_cpu": args.thread_cpu}


def py_spy() -> str | None:
    """py-spy beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


# ------------------------------------------------------------------------------------------------ figures (pure)
@dataclass(frozen=True)
class RunFigures:
    """One run's figures over its steps after the first."""

    kind: str  # "ours" or "trl"
    wall_s: float
    steps: int
    groups: float  # consumed
    samples: float  # trained
    wait_s: float
    cpu_s: float | None
    dropped_groups: int = 0  # ours: the whole run's, every reason; TRL drops none before its batch
    no_signal_groups: int = 0
    dropped_samples: int = 0
    #: The steps' parts, summed over the same steps (None where a step did not log it).
    fwd_bwd_s: float | None = None
    optimizer_s: float | None = None
    weight_sync_s: float | None = None
    #: Seconds from the first step to the last that began a group (None: the wall time), and the steps after it,
    #: which trained samples of groups already begun.
    span_s: float | None = None
    tail_steps: int = 0
    #: Samples trained whose group had no reward signal (TRL trains them; ours drops them before its batch).
    no_signal_samples: float = 0.0
    #: With `--thread-cpu`: the CPU seconds of `cpu_s` by part (CPU_PARTS' keys), over the same steps.
    cpu_by_part: dict[str, float] | None = None
    #: The median over the same steps of the completion tokens the worker received per s (NaN: none logged). Where
    #: the server bounds the run, its own pace: what the runs on one server differ by besides the learners.
    generated_tok_s: float = math.nan

    @property
    def groups_per_s(self) -> float:
        span = self.wall_s if self.span_s is None else self.span_s
        return self.groups / span if span > 0 else math.nan

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def useful_samples_per_s(self) -> float:
        """Samples trained per s that could teach: those of groups with reward signal."""
        return (self.samples - self.no_signal_samples) / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def samples_with_dropped_per_s(self) -> float:
        """Samples per s as if the dropped groups' samples had been trained too."""
        return (self.samples + self.dropped_samples) / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def cpu_s_per_group(self) -> float:
        return self.cpu_s / self.groups if self.cpu_s is not None and self.groups > 0 else math.nan

    @property
    def cpu_ms_per_sample(self) -> float:
        """Per sample trained: a run that trains the samples another leaves in its queue at the end pays for them."""
        return 1000 * self.cpu_s / self.samples if self.cpu_s is not None and self.samples > 0 else math.nan

    def cpu_ms_per_group(self, part: str) -> float:
        """CPU milliseconds per group consumed in `part`: one of CPU_PARTS' keys."""
        if self.cpu_by_part is None or self.groups <= 0:
            return math.nan
        return 1000 * self.cpu_by_part.get(part, 0.0) / self.groups

    def ms_per_step(self, part: str) -> float:
        """Milliseconds per step spent in `part`: one of STEP_PARTS' attributes."""
        if part == "other_s":
            known = (self.wait_s, self.fwd_bwd_s, self.optimizer_s, self.weight_sync_s)
            seconds = None if None in known else self.wall_s - sum(known)
        else:
            seconds = getattr(self, part)
        return 1000 * seconds / self.steps if seconds is not None and self.steps else math.nan


def run_figures(kind: str, records: Sequence, final=None, num_generations: int = 0) -> RunFigures:
    """`records`: the run's StepRecords; `final`: ours' final ProgressReport (its groups dropped).

    Both sides' steps log the groups they began to train, counted by the same collator; ours also consumes groups it
    never trains (dropped before the batch), which only its report counts."""
    if len(records) < 2:
        raise ValueError(f"{kind}: {len(records)} steps recorded; figures need at least two")
    ordered = sorted(records, key=lambda record: record.t)
    first, last, after = ordered[0], ordered[-1], ordered[1:]
    dropped = no_signal = 0
    if final is not None:
        dropped = final.dropped_total
        no_signal = final.dropped.get("no_signal", 0)
    beginning = [index for index, record in enumerate(ordered) if record.groups > 0]
    span_end = max(beginning[-1], 1) if beginning else len(ordered) - 1
    cpu_s = last.cpu_s - first.cpu_s if first.cpu_s is not None and last.cpu_s is not None else None
    parts = [[getattr(record, part) for record in after] for part in ("fwd_bwd_s", "optimizer_s", "weight_sync_s")]
    tokens_per_s = [record.generated_tok_s for record in after if record.generated_tok_s is not None]
    return RunFigures(kind, last.t - first.t, len(after), sum(record.groups for record in after) + dropped,
                      sum(record.samples for record in after), sum(record.wait_s for record in after), cpu_s,
                      dropped, no_signal, dropped * num_generations,
                      *(None if None in values else sum(values) for values in parts),
                      span_s=ordered[span_end].t - first.t, tail_steps=len(ordered) - 1 - span_end,
                      no_signal_samples=last.no_signal - first.no_signal, cpu_by_part=cpu_by_part(first, last, cpu_s),
                      generated_tok_s=statistics.median(tokens_per_s) if tokens_per_s else math.nan)


def cpu_by_part(first, last, cpu_s: float | None) -> dict[str, float] | None:
    """The CPU seconds between two step records (`--thread-cpu`'s) by part: the trainer's timed parts, the child
    processes, and the rest of the learner process (its other threads, ended ones included, and its main thread
    outside the timed parts). None where the records carry no parts."""
    if cpu_s is None or None in (first.parts, last.parts, first.threads, last.threads):
        return None
    seconds = {part: last.parts.get(part, 0.0) - first.parts.get(part, 0.0) for part in PARTS}
    seconds["children"] = sum(value - first.threads.get(name, 0.0) for name, value in last.threads.items()
                              if name.startswith(CHILD_PREFIX))
    seconds["rest"] = cpu_s - sum(seconds.values())
    return seconds


#: (column, cpu_by_part key) of the CPU table: where each side's CPU went.
CPU_PARTS: tuple[tuple[str, str], ...] = (
    ("training step (forward, loss, backward)", "training_step"),
    ("fetching a batch", "get_batch_samples"),
    ("logging", "log"),
    ("weight sync, the trainer's side", "_sync_weight_merged"),
    ("the worker child", "children"),
    ("the rest of the learner process", "rest"),
)


#: (column, RunFigures.ms_per_step part) of the step-time table: where each step's wall time went.
STEP_PARTS: tuple[tuple[str, str], ...] = (
    ("forward and backward", "fwd_bwd_s"),
    ("optimizer", "optimizer_s"),
    ("weight sync", "weight_sync_s"),
    ("rollout wait", "wait_s"),
    ("the rest (batching, logging, callbacks)", "other_s"),
)


#: (column, RunFigures property) of the per-pair ratios ours / TRL.
RATIOS: tuple[tuple[str, str], ...] = (
    ("groups consumed per s", "groups_per_s"),
    ("samples trained per s", "samples_per_s"),
    ("useful samples trained per s", "useful_samples_per_s"),
    ("samples per s, ours' dropped counted as trained", "samples_with_dropped_per_s"),
    ("CPU s per group", "cpu_s_per_group"),
    ("CPU per sample trained", "cpu_ms_per_sample"),
    ("completion tokens generated per s", "generated_tok_s"),
)


def pair_ratios(ours: RunFigures, trl: RunFigures) -> dict[str, float]:
    """Ours / TRL for each of RATIOS (NaN where either side has no figure). TRL drops nothing before its batch, so
    its side of the 'dropped counted' ratio is its samples trained per s."""
    ratios = {}
    for _, name in RATIOS:
        mine, theirs = getattr(ours, name), getattr(trl, "samples_per_s" if name == "samples_with_dropped_per_s"
                                                     else name)
        ratios[name] = mine / theirs if theirs > 0 and not math.isnan(mine) else math.nan
    return ratios


@dataclass(frozen=True)
class Pair:
    ours: RunFigures
    trl: RunFigures
    ours_first: bool


@dataclass(frozen=True)
class RowResult:
    name: str
    kind: RowKind
    pairs: list[Pair]
    load_start: float
    load_end: float
    server_start_s: float


# --------------------------------------------------------------------------------------------------------- report
def figure_spread(runs: Sequence[RunFigures], name: str, fmt: str) -> str:
    return spread([getattr(run, name) for run in runs], fmt)


def wait_share_spread(runs: Sequence[RunFigures]) -> str:
    return spread([100 * run.wait_share for run in runs], "{:.0f}", " %")


def ms_spread(runs: Sequence[RunFigures], part: str) -> str:
    return spread([run.ms_per_step(part) for run in runs], "{:.0f}")


def cpu_part_spread(runs: Sequence[RunFigures], part: str) -> str:
    return spread([run.cpu_ms_per_group(part) for run in runs], "{:.2f}")


def _server(row: RowResult) -> str:
    seqs = row.kind.max_num_seqs
    return "uncapped" if seqs is None else f"`--max-num-seqs {seqs}`"


def _placed(layout: Layout) -> str:
    if layout.server_cores is None:
        return "the server's OpenMP worker bound to core 0, the learner wherever the scheduler puts it"
    return (f"every process of the server on core {_cores(layout.server_cores)}, the learner on core "
            f"{_cores(layout.learner_cores)} ({layout.name})")


def _cores(cores: frozenset[int] | None) -> str:
    return ",".join(map(str, sorted(cores or ())))


def render(rows: Sequence[RowResult], *, epochs: int, groups_total: int | None, generations: int,
           max_completion_length: int, cores: int, layout: Layout = SHARED) -> str:
    side_rows, ratio_rows, pair_rows, step_rows, cpu_rows = [], [], [], [], []
    for row in rows:
        for label, runs in (("ours", [pair.ours for pair in row.pairs]), ("TRL", [pair.trl for pair in row.pairs])):
            dropped = (f"{figure_spread(runs, 'dropped_groups', '{:.0f}')} "
                       f"({figure_spread(runs, 'no_signal_groups', '{:.0f}')})"
                       if label == "ours" else "— (trains all)")
            side_rows.append([row.name, label, len(runs), figure_spread(runs, "wall_s", "{:.1f}"),
                              figure_spread(runs, "groups_per_s", "{:.2f}"),
                              figure_spread(runs, "samples_per_s", "{:.1f}"),
                              figure_spread(runs, "useful_samples_per_s", "{:.1f}"),
                              figure_spread(runs, "no_signal_samples", "{:.0f}"),
                              wait_share_spread(runs), figure_spread(runs, "cpu_s_per_group", "{:.3f}"),
                              figure_spread(runs, "cpu_ms_per_sample", "{:.2f}"), dropped,
                              figure_spread(runs, "generated_tok_s", "{:.0f}")])
            step_rows.append([row.name, label, figure_spread(runs, "steps", "{:.0f}"),
                              figure_spread(runs, "tail_steps", "{:.0f}"), figure_spread(runs, "samples", "{:.0f}"),
                              *(ms_spread(runs, part) for _, part in STEP_PARTS)])
            if all(run.cpu_by_part is not None for run in runs):
                cpu_rows.append([row.name, label, figure_spread(runs, "cpu_s_per_group", "{:.3f}"),
                                 *(cpu_part_spread(runs, part) for _, part in CPU_PARTS)])
        ratios = [pair_ratios(pair.ours, pair.trl) for pair in row.pairs]
        ratio_rows.append([row.name, _server(row), len(row.pairs), f"{row.load_start:.1f} → {row.load_end:.1f}",
                           *(spread([r[name] for r in ratios], "{:.2f}") for _, name in RATIOS)])
        for index, (pair, ratio) in enumerate(zip(row.pairs, ratios, strict=True), start=1):
            pair_rows.append([row.name, index, "ours, TRL" if pair.ours_first else "TRL, ours",
                              f"{pair.ours.wall_s:.1f} / {pair.trl.wall_s:.1f}",
                              *(("n/a" if math.isnan(ratio[name]) else f"{ratio[name]:.2f}") for _, name in RATIOS),
                              f"{pair.ours.dropped_groups} ({pair.ours.no_signal_groups})"])
    starts = ", ".join(f"{row.name} {row.server_start_s:.0f} s" for row in rows)
    total = f"{groups_total} groups" if groups_total else "groups: no report"
    text = [
        f"## {TITLE}",
        "",
        __doc__.split("\n", 1)[1].strip(),
        "",
        f"Config: examples/tiny.yaml (groups of {generations}, completions ≤ {max_completion_length} tokens), "
        f"{epochs} epoch{'' if epochs == 1 else 's'} ({total}), one OpenMP thread for each learner, {_placed(layout)}, "
        f"on {cores} cores shared with other processes; the load average (1 min) at the start and end of each row "
        f"is beside its ratios. Server start-up: {starts}.",
        "",
        "Ratios ours / TRL per pair, median (min–max) over the pairs:",
        "",
        table(["row", "server", "pairs", "load average, start → end", *(column for column, _ in RATIOS)], ratio_rows),
        "",
        "Each side's figures, median (min–max) over its runs:",
        "",
        table(["row", "learner", "runs", "wall s, first to last step", "groups consumed per s",
               "samples trained per s", "useful samples trained per s", "samples trained without signal",
               "learner wait share", "CPU s per group (learner and its children)",
               "CPU ms per sample trained", "groups dropped (of which no signal)",
               "completion tokens generated per s"], side_rows),
        "",
        "Where each side's steps went, in ms per step from TRL's own timings (`perf/fwd_bwd_s`, `perf/optimizer_s`, "
        "`perf/weight_sync_s`, `perf/rollout_wait_s`; the rest is the wall time none of them covers), median "
        "(min–max) over its runs:",
        "",
        table(["row", "learner", "steps", "of them after the last group begun", "samples trained",
               *(column for column, _ in STEP_PARTS)], step_rows),
        "",
        *([
            "Where each side's CPU went (`--thread-cpu`), in ms per group consumed, median (min–max) over its runs: "
            "each part is the CPU of the thread that ran it (ours runs the weight sync on a thread of its own, TRL "
            "on its training thread; both send its HTTP calls from threads of their own, in the rest); the rest is "
            "the learner process's other CPU, its main thread outside the parts included:",
            "",
            table(["row", "learner", "CPU s per group", *(column for column, _ in CPU_PARTS)], cpu_rows),
            "",
        ] if cpu_rows else []),
        "Per pair:",
        "",
        table(["row", "pair", "order", "wall s, ours / TRL", *(column for column, _ in RATIOS),
               "ours' groups dropped (no signal)"], pair_rows),
        "",
        "Ours drops groups without reward signal before the batch (`filter.dropNoSignal`); TRL trains them, so its "
        "samples trained per s counts samples ours would not train: the ratio with ours' dropped samples counted as "
        "trained is beside the one without, and useful samples trained per s counts only the samples of groups with "
        "signal (their group's reward std above `filter.noSignalEpsilon`), counted on both sides as the trainer "
        "takes them into its batches. The no-signal row's task: bench.no_signal (every other prompt of the tiny "
        "example scores 0 for every completion). Groups consumed per s counts the groups both sides take from the "
        "dataset, trained or not, up to the step that began the last of them. Learner wait share: both trainers "
        "log TRL's `perf/rollout_wait_s`, the seconds "
        "the trainer sat on an empty rollout queue. Completion tokens generated per s: the median over the steps of "
        "TRL's `rollout/generated_tok_s`, the tokens the worker received per s of each step's log window; where the "
        "server bounds the run (the generation-bound row) it is the server's own pace, which a run's groups per s "
        "follows. Reproduce: `.venv/bin/python -m bench e2e_vs_trl "
        "[--pairs N] [--epochs N] [--rows learner-bound,generation-bound,no-signal] [--layout shared|own-cores] "
        "[--thread-cpu]` "
        "(needs .venv-rollout).",
    ]
    return "\n".join(text)


# ------------------------------------------------------------------------------------------------------------ I/O
@dataclass(frozen=True)
class Placement:
    """Where a learner runs: `cores` it is bound to (None: wherever the scheduler puts it); `thread_cpu`: it records
    each thread's CPU seconds per step (bench.traced_learner's `--thread-cpu`)."""

    cores: frozenset[int] | None = None
    thread_cpu: bool = False


@contextlib.contextmanager
def bound_to(cores: frozenset[int] | None):
    """This process (and what it starts meanwhile) on `cores`; as before afterwards."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def traced_run(directory: Path, kind: str, config, profile: Path | None = None,
               keep: Path | None = None, placement: Placement = Placement()) -> tuple[list, object | None]:
    """One learner to its epoch bound, not watched while it runs: its step records and (ours) its final report.
    `kind`: bench.traced_learner's; `profile`: a file for py-spy's folded stacks of the run's CPU samples (every
    thread, children included); `keep`: a folder to copy the run's own files into when it ends (not its weights or
    checkpoints); `placement`: the learner's cores and whether it records each thread's CPU."""
    try:
        return _traced_run(directory, kind, config, profile, placement)
    finally:
        if keep is not None and directory.exists():
            shutil.copytree(directory, keep, ignore=shutil.ignore_patterns("weights", "output"), dirs_exist_ok=True)


def _traced_run(directory: Path, kind: str, config, profile: Path | None,
                placement: Placement) -> tuple[list, object | None]:
    from grpo_trainer.contract.report import parse_progress

    traced = lay_out_traced_run(directory, kind, config)
    records_path = traced.records_path
    command = traced.command
    if profile is not None or placement.thread_cpu:
        command = [*command, "--thread-cpu"]
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        command = [py_spy(), "record", "--subprocesses", "--threads", "--nonblocking", "--format", "raw",
                   "--output", str(profile), "--", *command]
    if placement.cores is not None:
        command = ["taskset", "--cpu-list", ",".join(map(str, sorted(placement.cores))), *command]
    started = time.time()
    log_path = directory / "log.txt"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=traced.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{directory.name}: no end within {RUN_TIMEOUT_S:.0f} s; log: {log_path}") from None
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                process.wait(30)
    print(f"[bench] {directory.parent.name}/{directory.name} exited {process.returncode} after "
          f"{time.time() - started:.0f} s", file=sys.stderr, flush=True)
    records = ([StepRecord.from_json(line) for line in records_path.read_text().splitlines() if line]
               if records_path.exists() else [])
    if profile is not None and records_path.exists():  # beside the profile: its per-thread CPU seconds per step
        shutil.copyfile(records_path, profile.with_suffix(".steps.jsonl"))
    termination = directory / "termination-log"
    final = None
    reports = kind != "trl"  # ours ends with its report
    if reports and termination.exists() and termination.read_text().strip():
        final = parse_progress(termination.read_text())
    if process.returncode != 0 or len(records) < 2 or (reports and final is None):
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{directory.name}: exit {process.returncode}, {len(records)} steps recorded, "
                           f"final report {'read' if final else 'missing'}:\n{tail}")
    return records, final


def start_row_server(stack: contextlib.ExitStack, config, directory: Path):
    """The row's vLLM CPU server from its run config, under `directory`/server, stopped with `stack`. vLLM's CPU
    backend binds its worker to a core; core 0, as `grporun local` binds its first server."""
    import pytest

    from tests.support.servers.vllm_server import running_vllm_server

    (directory / "server").mkdir(parents=True)
    wire = json.loads(config.model_dump_json(by_alias=True))
    try:
        return stack.enter_context(running_vllm_server(
            config.model, directory / "server", env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, config=wire,
            start_timeout_s=SERVER_START_TIMEOUT_S))
    except pytest.fail.Exception as failed:  # the helper is the tests' too; its failure is no Exception
        raise RuntimeError(f"the vLLM server did not start: {failed}") from None


@dataclass(frozen=True)
class RowPlan:
    """How each row runs: `pairs` of runs to `epochs`, in `layout`; `profile`/`keep`: folders for py-spy's samples
    and for each run's own files (None: neither); `thread_cpu`: each run records its CPU by thread and part."""

    pairs: int
    epochs: int
    layout: Layout = SHARED
    profile: Path | None = None
    keep: Path | None = None
    thread_cpu: bool = False


def row_config(directory: Path, kind: RowKind, epochs: int):
    """The row's run config: examples/tiny.yaml, `epochs` long, its server capped as the row says; for the no-signal
    row, its prompts (written under `directory`) and reward."""
    from grpo_trainer.contract.config import RewardConfig

    config = base_config(directory, epochs=epochs, max_num_seqs=kind.max_num_seqs)
    if kind.no_signal:
        directory.mkdir(parents=True, exist_ok=True)
        prompts = directory / "no-signal-prompts.jsonl"
        write_prompts(Path(config.dataset.path), prompts)
        config.dataset.path = str(prompts)
        config.rewards = [RewardConfig(function=REWARD_FUNCTION)]
    return config


def run_row(scratch: Path, name: str, row_kind: RowKind, plan: RowPlan) -> tuple[RowResult, object, int | None]:
    """One server started for the row, `plan.pairs` interleaved pairs on it; also the row's run config and groups
    total."""
    from tests.support.servers.vllm_server import restore_model_weights

    directory = scratch / name
    config = row_config(directory, row_kind, plan.epochs)
    placement = Placement(plan.layout.learner_cores, plan.thread_cpu)
    load_start = os.getloadavg()[0]
    started = time.time()
    with contextlib.ExitStack() as stack:
        with bound_to(plan.layout.server_cores):
            running = start_row_server(stack, config, directory)
        server_start_s = time.time() - started
        print(f"[bench] {NAME}: {name} server ready in {server_start_s:.0f} s", file=sys.stderr, flush=True)
        config.rollout.urls = [running.server.url]
        generations = config.training.num_generations
        results, groups_total = [], None
        for index in range(plan.pairs):
            ours_first = index % 2 == 0
            figures = {}
            for kind in ("ours", "trl") if ours_first else ("trl", "ours"):
                restore_model_weights(running.server, directory / f"model-weights-{index}-{kind}")
                label = f"pair-{index + 1}-{kind}"
                records, final = traced_run(directory / label, kind, config,
                                            plan.profile and plan.profile / f"{name}-{label}.txt",
                                            plan.keep and plan.keep / name / label, placement)
                figures[kind] = run_figures(kind, records, final, generations)
                if final is not None:
                    groups_total = final.groups_total
            results.append(Pair(figures["ours"], figures["trl"], ours_first))
    row = RowResult(name, row_kind, results, load_start, os.getloadavg()[0], server_start_s)
    return row, config, groups_total


def run(context: Context) -> str:
    require_rollout_assets()
    chosen = context.options.get(NAME, {})
    plan = RowPlan(chosen.get("pairs") or context.reps(PAIRS, QUICK_PAIRS), chosen.get("epochs", EPOCHS),
                   chosen.get("layout", SHARED), chosen.get("profile"), chosen.get("keep"),
                   chosen.get("thread_cpu", False))
    rows, config, groups_total = [], None, None
    for name in chosen.get("rows", tuple(ROWS)):
        row, config, groups_total = run_row(context.scratch / NAME, name, ROWS[name], plan)
        rows.append(row)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return render(rows, epochs=plan.epochs, groups_total=groups_total, generations=config.training.num_generations,
                  max_completion_length=config.training.max_completion_length, cores=cores, layout=plan.layout)
