"""Section 6: reward-model scoring on the learner (the tiny reward model, CPU).

Two figures: what the tiny reward model costs per scored sample (`RewardModel.score` in this process, groups of 8
completions of the tiny example's length, one forward per group), and the learner's step time with and without it
(tests/support/learner/learner_scenario.py, the real GRPOLearner with the scripted worker: one group of 4 per step, so
the scoring of each group sits on the step's path). Step time is the median interval between optimizer steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .report import Context, spread, table

NAME = "scoring"
TITLE = "6. Reward-model scoring on the learner (tiny reward model, CPU)"
GROUP, GROUPS = 8, 16
ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "support" / "learner" / "learner_scenario.py"


def reward_model_dir() -> str:
    """The tiny reward model, from the tests' cache of tiny models (built there once per recipe)."""
    from tests.support import tiny_models

    return str(tiny_models.cached(tiny_models.REWARD))


def per_sample_seconds(model_dir: str, reps: int) -> list[float]:
    import torch

    from grpo_trainer.contract.config import RewardConfig
    from grpo_trainer.learner.scoring import RewardModel

    torch.set_num_threads(1)  # as the step-time runs below: on a shared 2-core box more threads only add spin-waits
    model = RewardModel.load(RewardConfig(model=model_dir), "cpu")
    prompts = [[{"role": "user", "content": f"say apple and banana {i}"}] for i in range(GROUP)]
    completions = [[{"role": "assistant", "content": "a banana " * (1 + i % 4)}] for i in range(GROUP)]
    model.score(prompts, completions)  # warm-up
    figures = []
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(GROUPS):
            model.score(prompts, completions)
        figures.append((time.perf_counter() - started) / (GROUPS * GROUP))
    return figures


def step_seconds(context: Context, out: Path, extra: list[str], prompts: int) -> float:
    """The median time between the learner's steps in one scenario run with `extra` arguments."""
    args = [sys.executable, str(SCENARIO), "--scenario", "varied", "--prompts", str(prompts),
            "--model", context.model_dir, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(args, capture_output=True, text=True, timeout=900, check=True, env=env)
    timeline = json.loads((out / "rank0.json").read_text())["timeline"]
    times = [point["t"] for point in timeline]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def run(context: Context) -> str:
    reps = context.reps(5, 1)
    prompts = 8 if context.quick else 24
    model_dir = reward_model_dir()
    scoring = per_sample_seconds(model_dir, reps)
    without, with_model = [], []
    for rep in range(reps):  # interleaved, so the machine's load falls on both alike
        without.append(step_seconds(context, context.scratch / f"scoring-off-{rep}", [], prompts))
        with_model.append(step_seconds(context, context.scratch / f"scoring-on-{rep}", ["--reward-model", model_dir],
                                       prompts))
    ratio = [b / a for a, b in zip(without, with_model, strict=True)]
    rows = [
        ["scoring, per sample (groups of 8, one forward each)", spread([s * 1e3 for s in scoring], unit=" ms")],
        ["learner step, no reward model", spread(without, unit=" s")],
        ["learner step, tiny reward model on rank 0", spread(with_model, unit=" s")],
        ["step time ratio (with / without)", spread(ratio, fmt="{:.2f}")],
    ]
    return (f"## {TITLE}\n\nScoring: `RewardModel.score` in the bench process, float32, groups of {GROUP}. Step "
            f"time: the real GRPOLearner with the scripted worker ({prompts} prompts, 4 completions each, one group "
            f"per step), median interval between optimizer steps, runs interleaved; one torch thread throughout (with "
            f"the machine's other load, two threads made the figures swing 50x); {reps} repetition(s).\n\n"
            + table(["measure", "value"], rows))
