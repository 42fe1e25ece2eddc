"""Section 13: what the rollout balancer's hop costs end to end: ours with it, ours without it, and TRL, on one server.

Ours sends every generation request through the balancer in the learner's process (docs/rollout.md); TRL's worker
talks to the server itself. The variant in between is ours with TRL's worker pointed straight at the server
(bench.traced_learner's `ours-direct`): the balancer still runs and the weight sync is ours, but no request passes
through it. Ours against ours-direct is what the hop costs; ours-direct against TRL, what the rest of ours costs.

Per layout, one vLLM CPU server (the learner-bound row of section 11: examples/tiny.yaml, uncapped) is started once;
on it, repetitions of the three variants, each to its epoch bound, the order rotated from one repetition to the next,
the server given the model's own weights again before every run. Layouts:
- shared cores: as section 11, the server's OpenMP worker bound to core 0, the learner wherever the scheduler puts it;
- own cores: every process of the server on core 0, the learner on the other cores, so neither waits for the other's
  core (the learner's own threads, the balancer among them, still share its cores).
Each learner records every thread's CPU seconds per step (bench.traced_learner `--thread-cpu`), both sides alike.
Figures per run are section 11's (bench.e2e_vs_trl.run_figures) plus the balancer thread's CPU seconds over the same
steps.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_trainer.rollout.balancer import THREAD_NAME

from .e2e_vs_trl import (
    EPOCHS,
    Layout,
    Placement,
    RunFigures,
    bound_to,
    figure_spread,
    layouts,
    ms_spread,
    run_figures,
    start_row_server,
    traced_run,
    wait_share_spread,
)
from .report import Context, spread, table
from .rollout_scaling import base_config, require_rollout_assets

NAME = "balancer_hop"
TITLE = "13. The balancer's hop, end to end: ours with it and without it, and TRL, on one server"
#: (traced_learner kind, label) in the order of the first repetition.
VARIANTS: tuple[tuple[str, str], ...] = (
    ("ours", "ours"),
    ("ours-direct", "ours, TRL's worker straight at the server"),
    ("trl", "TRL"),
)
#: A multiple of the variants' count: each goes first, second and third equally often.
REPS, QUICK_REPS = 6, 1


def rotation(rep: int) -> list[str]:
    """The variants' order in repetition `rep`: each goes first, second and third in turn."""
    kinds = [kind for kind, _ in VARIANTS]
    shift = rep % len(kinds)
    return kinds[shift:] + kinds[:shift]


@dataclass(frozen=True)
class HopRun:
    figures: RunFigures
    balancer_cpu_s: float | None  # None: the run has no balancer thread (TRL) or recorded no thread CPU
    requests: float  # generation requests over the same steps: one per sample of each group consumed

    @property
    def balancer_ms_per_request(self) -> float | None:
        if self.balancer_cpu_s is None or self.requests <= 0:
            return None
        return 1000 * self.balancer_cpu_s / self.requests


def balancer_cpu(records: Sequence) -> float | None:
    """The balancer thread's CPU seconds from the first step to the last."""
    ordered = sorted(records, key=lambda record: record.t)
    first, last = ordered[0].threads or {}, ordered[-1].threads or {}
    if THREAD_NAME not in last:
        return None
    return last[THREAD_NAME] - first.get(THREAD_NAME, 0.0)


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    runs: dict[str, list[HopRun]]  # kind -> its runs in repetition order
    load_start: float
    load_end: float


def _median(runs: Sequence[HopRun], name: str) -> float:
    values = [getattr(run.figures, name) for run in runs]
    return statistics.median(values) if values else float("nan")


def render(results: Sequence[LayoutResult], *, epochs: int, groups_total: int | None) -> str:
    rows = []
    for result in results:
        trl = _median(result.runs.get("trl", []), "groups_per_s")
        for kind, label in VARIANTS:
            runs = result.runs.get(kind, [])
            if not runs:
                continue
            figures = [run.figures for run in runs]
            balancer = [run.balancer_cpu_s for run in runs if run.balancer_cpu_s is not None]
            per_request = [run.balancer_ms_per_request for run in runs
                           if kind == "ours" and run.balancer_ms_per_request is not None]
            ratio = _median(runs, "groups_per_s") / trl if trl > 0 else float("nan")
            rows.append([
                result.layout.name, label, len(runs), f"{result.load_start:.1f} → {result.load_end:.1f}",
                figure_spread(figures, "wall_s", "{:.1f}"), figure_spread(figures, "groups_per_s", "{:.2f}"),
                f"{ratio:.2f}", wait_share_spread(figures), ms_spread(figures, "fwd_bwd_s"),
                figure_spread(figures, "cpu_s_per_group", "{:.3f}"),
                spread(balancer, "{:.2f}") if balancer else "—",
                spread(per_request, "{:.2f}") if per_request else "—",
            ])
    groups = f"{groups_total} groups" if groups_total else "its groups"
    text = [
        f"## {TITLE}",
        "",
        (__doc__ or "").split("\n\n", 1)[1].strip(),
        "",
        f"Config: examples/tiny.yaml, {epochs} epochs ({groups}), one OpenMP thread for each learner.",
        "",
        "Median (min–max) over each variant's runs; groups per s against TRL's: the ratio of the medians.",
        "",
        table(["layout", "learner", "runs", "load average, start → end", "wall s, first to last step",
               "groups consumed per s", "groups per s / TRL's", "learner wait share",
               "forward and backward, ms per step",
               "CPU s per group (learner and its children)", "balancer thread CPU s per run",
               "balancer CPU ms per request"], rows),
        "",
        "Balancer CPU ms per request: its thread's CPU seconds over the generation requests, one per sample of each "
        "group consumed (ours only: ours-direct's balancer serves none). Reproduce: "
        "`.venv/bin/python -m bench balancer_hop` (needs .venv-rollout).",
    ]
    return "\n".join(text)


def run_layout(scratch: Path, layout: Layout, reps: int, epochs: int) -> tuple[LayoutResult, int | None]:
    from tests.support.servers.vllm_server import restore_model_weights

    directory = scratch / layout.name.replace(" ", "-")
    config = base_config(directory, epochs=epochs, max_num_seqs=None)
    load_start = os.getloadavg()[0]
    placement = Placement(layout.learner_cores, thread_cpu=True)
    runs: dict[str, list[HopRun]] = {kind: [] for kind, _ in VARIANTS}
    groups_total = None
    with contextlib.ExitStack() as stack:
        started = time.time()
        with bound_to(layout.server_cores):
            running = start_row_server(stack, config, directory)
        print(f"[bench] {NAME}: {layout.name}: server ready in {time.time() - started:.0f} s", file=sys.stderr,
              flush=True)
        config.rollout.urls = [running.server.url]
        for rep in range(reps):
            for kind in rotation(rep):
                label = f"rep-{rep + 1}-{kind}"
                restore_model_weights(running.server, directory / f"model-weights-{label}")
                records, final = traced_run(directory / label, kind, config, placement=placement)
                figures = run_figures(kind, records, final, config.training.num_generations)
                requests = figures.groups * config.training.num_generations
                runs[kind].append(HopRun(figures, balancer_cpu(records), requests))
                if final is not None:
                    groups_total = final.groups_total
    return LayoutResult(layout, runs, load_start, os.getloadavg()[0]), groups_total


def run(context: Context) -> str:
    require_rollout_assets()
    reps = context.reps(REPS, QUICK_REPS)
    results, groups_total = [], None
    for layout in layouts(sorted(os.sched_getaffinity(0))):
        result, groups_total = run_layout(context.scratch / NAME, layout, reps, EPOCHS)
        results.append(result)
    return render(results, epochs=EPOCHS, groups_total=groups_total)
