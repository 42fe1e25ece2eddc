"""Section 2: how fast a run ends at its epoch bound, our GRPOLearner against TRL's unmodified AsyncGRPOTrainer.

Each run is bench.learner_run in its own process (real trainer, CPU, tiny model, ScriptedRolloutWorker, token
budget 64, gradient accumulation 2). The "last needed group" is the last sample of a group inside the bound
(id < prompts x epochs) the trainer pulled from its rollout queue; everything after it is overflow.
"""

from __future__ import annotations

from .report import Context, spread, table
from .runs import learner_run

NAME = "stop"
TITLE = "2. Stop latency at the epoch bound (real trainer, CPU, tiny model)"
PROMPTS, EPOCHS, GENERATIONS, GA = 6, 3, 4, 2
WALL_BOUND_S = 20.0

# label, learner_run scenario, what TRL does with it
SCENARIOS = (
    ("no drops", "varied"),
    ("a third of groups without signal", "third_no_signal"),
    ("every group of the last pass without signal", "last_pass_no_signal"),
    ("every group from the last pass on over the token budget", "last_pass_oversize"),
)


def summarize(run: dict) -> dict:
    micro_batches = run["micro_batches"]
    needed = [i for i, record in enumerate(micro_batches) if record["needed"]]
    last = needed[-1] if needed else -1
    overflow = [record for record in micro_batches[last + 1:] if not record["stop"]]
    needed_step = micro_batches[last]["step_before"] + 1 if needed else 0
    stopped = run["outcome"] != "timeout"
    return {
        "outcome": run["outcome"],
        "stopped": stopped,
        "overflow_micro_batches": len(overflow),
        "overflow_samples": sum(record["samples"] for record in overflow),
        "pulled_after": run["pulled"] - run["pulled_at_last_needed"],
        "steps_after": run["global_step"] - needed_step,
        "untrained_needed": run["untrained_needed"],
        "exit_latency": run["exit_time"] - run["last_needed_time"] if run["last_needed_time"] else None,
        "return_latency": run["ended"] - run["last_needed_time"] if run["last_needed_time"] and stopped else None,
        "wall": run["exit_time"] - run["started"],
        "global_step": run["global_step"],
        "no_signal_samples": sum(record.get("no_signal_samples", 0) for record in micro_batches),
    }


def run(context: Context) -> str:
    reps = context.reps(3, 1)
    model = context.model_dir
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(reps):
        for _label, scenario in SCENARIOS:
            for kind in (("ours", "trl") if rep % 2 == 0 else ("trl", "ours")):
                record = learner_run(
                    context.scratch / "stop", f"{scenario}-{kind}-{rep}", kind=kind, scenario=scenario, model=model,
                    wall_bound=WALL_BOUND_S, prompts=PROMPTS, epochs=EPOCHS, generations=GENERATIONS, ga=GA,
                    stall_groups=PROMPTS + 1,
                )
                results.setdefault((scenario, kind), []).append(summarize(record))
    rows, sentences = [], []
    for label, scenario in SCENARIOS:
        for kind, name in (("ours", "GRPOLearner"), ("trl", "AsyncGRPOTrainer")):
            runs = results[(scenario, kind)]
            stopped = [r for r in runs if r["stopped"]]
            outcome = ", ".join(sorted({r["outcome"] for r in runs}))
            if len(stopped) < len(runs):
                outcome = f"did not stop within {WALL_BOUND_S:.0f} s ({len(runs) - len(stopped)}/{len(runs)})"
            rows.append([
                label if kind == "ours" else "", name, outcome,
                spread([r["overflow_micro_batches"] for r in runs], "{:.0f}"),
                spread([r["overflow_samples"] for r in runs], "{:.0f}"),
                spread([r["pulled_after"] for r in runs], "{:.0f}"),
                spread([r["steps_after"] for r in runs], "{:.0f}"),
                spread([r["untrained_needed"] for r in runs], "{:.0f}"),
                spread([r["no_signal_samples"] for r in runs], "{:.0f}"),
                spread([r["return_latency"] for r in stopped if r["return_latency"] is not None], "{:.2f}")
                if stopped else f"> {WALL_BOUND_S:.0f}",
                spread([r["exit_latency"] for r in stopped if r["exit_latency"] is not None], "{:.2f}")
                if stopped else f"> {WALL_BOUND_S:.0f}",
            ])
        ours, trl = results[(scenario, "ours")], results[(scenario, "trl")]
        sentences.append(_compare(label, ours, trl))
    return "\n".join([
        f"## {TITLE}",
        "",
        f"{PROMPTS} prompts × {EPOCHS} epochs = {PROMPTS * EPOCHS} needed groups of {GENERATIONS}, token budget 64, "
        f"gradient accumulation {GA}, stall limit {PROMPTS + 1} groups (more than a pass, so the no-signal pass ends "
        f"at the bound, not as a stall). {reps} repetitions per row, alternating which trainer runs first; the "
        f"baseline is stopped after {WALL_BOUND_S:.0f} s. Each run is a fresh process (`python -m bench.learner_run`) "
        "with one intra-op thread. \"Last needed group\" = the last sample of a group inside the bound pulled from "
        "the rollout queue; overflow = groups of the next pass.",
        "",
        table(["scenario", "trainer", "outcome", "overflow micro-batches trained", "overflow samples trained",
               "samples pulled after the last needed one", "optimizer steps after the last needed micro-batch",
               "needed micro-batches collated, never trained", "samples without signal trained",
               "s from last needed group to `train()` return", "s from last needed group to process exit"], rows),
        "",
        *_notes(results),
        "",
        *[f"- {sentence}" for sentence in sentences],
    ])


def _notes(results: dict[tuple[str, str], list[dict]]) -> list[str]:
    """What the columns show, said only where the measured runs show it."""
    notes = []
    ours = [r for (_, kind), runs in results.items() if kind == "ours" for r in runs]
    trl = [r for (_, kind), runs in results.items() if kind == "trl" for r in runs]
    if all(r["return_latency"] is not None and r["return_latency"] < 0.2 for r in ours + trl if r["stopped"]):
        notes.append("The time to `train()` return is the same for both trainers and mostly the scripted worker's "
                     "own stop: `train()` ends by joining its thread, which wakes every 0.1 s; the rest to process "
                     "exit is interpreter teardown, noisy on shared cores.")
    if any(r["steps_after"] for r in ours):
        notes.append("Where ours shows an optimizer step after the last needed micro-batch, it is the one the stop "
                     "micro-batch closes: its gradients are zeroed on every rank first, so it changes no parameter.")
    if any(r["untrained_needed"] for r in trl):
        notes.append("TRL counts a group as trained when it is collated, and accelerate's dispatcher collates one "
                     "micro-batch ahead, so TRL's epoch stop fires before that micro-batch trains: the last needed "
                     "groups' samples are collated and never trained. Ours stops in the stream, after the last "
                     "needed micro-batch, so it trains them.")
    if any(r["no_signal_samples"] for r in trl) and not any(r["no_signal_samples"] for r in ours):
        notes.append("TRL trains groups without reward signal (zero advantage: compute that moves nothing but the "
                     "token normaliser); ours drops them before the batcher and counts them as consumed.")
    return [" ".join(notes)] if notes else []


def _compare(label: str, ours: list[dict], trl: list[dict]) -> str:
    import statistics

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    ours_stopped = [r for r in ours if r["stopped"]]
    trl_stopped = [r for r in trl if r["stopped"]]
    if not ours_stopped:
        return f"{label}: our trainer did not stop within {WALL_BOUND_S:.0f} s (a regression)."
    ours_text = (f"ours returns from `train()` {median(ours_stopped, 'return_latency'):.2f} s after the last needed "
                 f"group and its process exits after {median(ours_stopped, 'exit_latency'):.2f} s")
    if len(trl_stopped) < len(trl):
        return (f"{label}: {ours_text}; TRL did not stop within {WALL_BOUND_S:.0f} s and pulled a median "
                f"{median(trl, 'pulled_after'):.0f} samples past the bound (the scripted worker generates at no "
                "cost; with vLLM it would be the server's whole output), training none of them.")
    ratio = median(ours_stopped, "return_latency") / median(trl_stopped, "return_latency")
    return (f"{label}: {ours_text}; TRL {median(trl_stopped, 'return_latency'):.2f} s and "
            f"{median(trl_stopped, 'exit_latency'):.2f} s (ours/TRL to `train()` return: {ratio:.2f}).")
