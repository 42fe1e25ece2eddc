"""Section 8: the training step's scoring (`step_scoring.score_step`, CPU).

Two figures: what `score_step` costs per sample (in this process, on TRL-shaped loss terms: 64 samples of 64 trained
tokens, the importance bounds on), and the learner's step time with it (the real GRPOLearner, bounds off and on)
against TRL's own AsyncGRPOTrainer, which scores nothing (tests/support/learner/learner_scenario.py with the scripted
worker, one torch thread). Step time is the median interval between optimizer steps.
"""

from __future__ import annotations

import time
from pathlib import Path

from .report import Context, spread, table
from .scoring import step_seconds

NAME = "step_scoring"
TITLE = "8. The training step's scoring (score_step, CPU)"
SAMPLES, TOKENS, CALLS = 64, 64, 200
ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"TRL's AsyncGRPOTrainer (no step scoring)": ["--baseline"],
            "GRPOLearner, non-finite check only": [],
            "GRPOLearner, importance bounds on too": ["--is-clip-max", "3"]}


def per_sample_seconds(reps: int) -> list[float]:
    import torch

    from grpo_trainer.learner.step_scoring import ImportanceBounds, score_step

    torch.set_num_threads(1)
    segment_id = torch.arange(SAMPLES).repeat_interleave(TOKENS)
    old = torch.randn(len(segment_id)) - 3
    log_probs = old + 0.01 * torch.randn(len(segment_id))
    loss = torch.randn(len(segment_id))
    bounds = ImportanceBounds(clip_min=0.5, clip_max=3.0)
    score_step(log_probs, old, loss, segment_id, SAMPLES, bounds)  # warm-up
    figures = []
    for _ in range(reps):
        started = time.process_time()
        for _ in range(CALLS):
            score_step(log_probs, old, loss, segment_id, SAMPLES, bounds)
        figures.append((time.process_time() - started) / (CALLS * SAMPLES))
    return figures


def run(context: Context) -> str:
    reps = context.reps(5, 1)
    prompts = 8 if context.quick else 24
    cost = per_sample_seconds(context.reps(7, 2))
    steps: dict[str, list[float]] = {label: [] for label in VARIANTS}
    for rep in range(reps):  # interleaved, so the machine's load falls on every variant alike
        for index, (label, extra) in enumerate(VARIANTS.items()):
            steps[label].append(step_seconds(context, context.scratch / f"step-scoring-{index}-{rep}", extra, prompts))
    baseline = steps[next(iter(VARIANTS))]
    rows = [["score_step per sample (64 x 64 trained tokens, bounds on)", spread([s * 1e6 for s in cost], unit=" µs")]]
    for label, figures in steps.items():
        rows.append([f"learner step, {label}", spread(figures, unit=" s")])
    for label, figures in list(steps.items())[1:]:
        ratio = [ours / trl for ours, trl in zip(figures, baseline, strict=True)]
        rows.append([f"step time ratio ({label} / TRL)", spread(ratio, fmt="{:.2f}")])
    return (f"## {TITLE}\n\n{__doc__.split(chr(10), 1)[1].strip()} {reps} repetition(s), {prompts} prompts of 4 "
            "completions, one group per step. The step-time ratio also carries the rest of GRPOLearner's pipeline "
            "(section 1 measures it alone) and its one gather per micro-batch (one process here: no "
            "communication).\n\n" + table(["measure", "value"], rows))
