"""Section 1: the learner's input pipeline against TRL 1.16's own, per sample, in one process.

Both pipelines are built by the real trainers' own `get_train_dataloader` (TRL's AsyncGRPOTrainer and our
GRPOLearner, each constructed on the tiny model and never trained), so what is timed is exactly what a training run
iterates: RolloutQueueDataset -> batcher -> DataCollatorForRollout, against SampleFilterQueue -> RolloutQueueDataset
-> batcher -> StopAwareDataset -> ProgressCollator, both behind accelerate's DataLoaderDispatcher. The trainers'
rollout queue is pre-filled with the same RolloutSample objects (ScriptedRolloutWorker.group_samples), so no
producer thread competes for the CPU.

Like for like: the run's bound is far beyond the stream, so our stop never fires inside the timed window, and every
group has reward signal, so nothing is dropped. Both loops take the same number of micro-batches; accelerate's
dispatcher fetches one more ahead in both. The bench checks the two loops saw the same micro-batches and samples
and that neither pipeline dropped any, and refuses to report a ratio otherwise.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

from .report import Context, spread, table

NAME = "pipeline"
TITLE = "1. Learner input-pipeline overhead (ours vs TRL 1.16, same process)"
TARGET_RATIO = 1.02


@dataclass(frozen=True)
class Shape:
    label: str
    prompt_tokens: int
    completion_tokens: int
    generations: int
    groups: int  # groups put in the queue per repetition
    token_budget: int  # 0: FixedCountBatcher with `batch` samples per micro-batch
    batch: int = 16


def shapes(quick: bool) -> list[Shape]:
    groups_large = 12 if quick else 40
    groups_small = 40 if quick else 400
    return [
        Shape("realistic, token budget 16384", 200, 1000, 8, groups_large, 16384),
        Shape("realistic, fixed count 16", 200, 1000, 8, groups_large, 0, 16),
        Shape("small (16+32 tokens), token budget 512", 16, 32, 8, groups_small, 512),
        Shape("small (16+32 tokens), fixed count 16", 16, 32, 8, groups_small, 0, 16),
    ]


# Rewards per (absolute group position, generation): every group with signal, or a third without.
def varied(position: int, generation: int) -> float:
    return float(generation % 2)


def third_without_signal(position: int, generation: int) -> float:
    return 0.0 if position % 3 == 0 else float(generation % 2)


class Bench:
    """Builds a fresh trainer per repetition (cheap: ~0.04 s on the tiny model) around a pre-filled queue."""

    def __init__(self, model_dir: str, scratch: str):
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from datasets import Dataset
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.scratch = scratch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Far beyond any stream below: the bound (and so our stop) is never reached inside the timed window.
        self.dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"p{i}"}] for i in range(100_000)]})

    def samples(self, shape: Shape, reward) -> list:
        worker = self._worker(shape, reward)
        return [sample for group in range(shape.groups) for sample in worker.group_samples(group, group)]

    def _worker(self, shape: Shape, reward):
        from grpo_trainer.testing.scripted_worker import GroupScript, SampleShape, ScriptedRolloutWorker

        return ScriptedRolloutWorker(
            dataset_size=len(self.dataset), num_generations=shape.generations, script=GroupScript(reward=reward),
            shape=SampleShape(vocab_size=len(self.tokenizer), prompt_tokens=shape.prompt_tokens,
                              completion_tokens=shape.completion_tokens, eos_token_id=self.tokenizer.eos_token_id),
            queue_maxsize=0,
        )

    def trainer(self, kind: str, shape: Shape):
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

        from grpo_trainer.learner.cpu import enable_cpu_support
        from grpo_trainer.learner.trainer import GRPOLearner
        from grpo_trainer.testing.scripted_worker import NoWeightTransfer

        config = AsyncGRPOConfig(
            output_dir=os.path.join(self.scratch, kind), use_cpu=True, dtype="float32", report_to=[],
            num_generations=shape.generations, per_device_train_batch_size=shape.batch,
            token_budget=shape.token_budget, max_staleness=1000, disable_tqdm=True,
        )
        common = dict(args=config, train_dataset=self.dataset, processing_class=self.tokenizer,
                      rollout_worker=self._worker(shape, varied), weight_transfer=NoWeightTransfer())
        if kind == "trl":
            enable_cpu_support()
            return AsyncGRPOTrainer(self.model_dir, **common)
        return GRPOLearner(self.model_dir, **common)

    def run(self, kind: str, shape: Shape, samples: list, reserve_groups: int, *, drops: bool = False,
            collect: bool = True) -> dict:
        """Time one pass: micro-batches until all but `reserve_groups` groups' samples are collated (with `drops`:
        until no more than those groups' samples are left in the queue)."""
        from grpo_trainer.progress import STOP_KEY

        trainer = self.trainer(kind, shape)
        source = trainer.rollout_queue
        for sample in samples:
            source.put_nowait(sample)
        queued = source.qsize()
        reserve = reserve_groups * shape.generations
        target = len(samples) - reserve
        loader = trainer.get_train_dataloader()
        gc.collect()
        # The set-up heap (model, tokenizer, the trainers, ~476k objects) is frozen for the loop on both sides, as
        # GRPOLearner.train does: on a realistic stream (~1,500 collections a repetition) about 5 full collections
        # walked it inside the timed window, 0.27 s each, 1.6 of the 2.3 s measured on either side.
        gc.freeze()
        if not collect:
            gc.disable()
        micro_batches = collated = 0
        collections = [0]

        def count_collections(phase: str, _info: dict) -> None:
            collections[0] += phase == "start"

        gc.callbacks.append(count_collections)
        start, cpu_start = time.perf_counter(), time.thread_time()
        for batch in loader:
            if STOP_KEY in batch:
                raise AssertionError("the stream stopped inside the timed window; the bound should be out of reach")
            micro_batches += 1
            collated += round(float(batch["global_n_forward_tokens"][0] / batch["mean_seq_len"][0]))
            if (source.qsize() <= reserve) if drops else (collated >= target):
                break
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        gc.callbacks.remove(count_collections)
        gc.enable()
        gc.unfreeze()
        pulled = queued - source.qsize()
        metrics = trainer._metrics["train"]
        result = {
            "seconds": elapsed,
            "cpu_seconds": cpu,
            "collections": collections[0],  # garbage collections inside the timed loop (any generation)
            "micro_batches": micro_batches,
            "collated": collated,
            "pulled": pulled,
            "trl_dropped": len(metrics.get("sample/dropped_stale_total", [])) + len(
                metrics.get("batch/dropped_oversize_total", [])
            ),
            "our_dropped": sum(trainer.progress.dropped.values()) if kind == "ours" else 0,
        }
        del loader, trainer
        return result


def reserve_for(shape: Shape) -> int:
    """Groups left in the queue for the batcher's closing sample and the dispatcher's one-ahead fetch."""
    # A row's trained tokens are capped by the budget too, so it holds at most budget / completion samples.
    per_micro_batch = shape.token_budget // shape.completion_tokens + 1 if shape.token_budget else shape.batch
    return 2 + -(-per_micro_batch // shape.generations)


def measure(bench: Bench, shape: Shape, reps: int, *, collect: bool = True, dropping: bool = True) -> dict:
    samples = bench.samples(shape, varied)
    reserve = reserve_for(shape)
    runs: dict[str, list[dict]] = {"trl": [], "ours": []}
    ratios, wall_ratios = [], []
    bench.run("trl", shape, samples, reserve)  # warm-up: first-touch costs (imports, allocator) go to neither side
    for rep in range(reps):
        order = ("trl", "ours") if rep % 2 == 0 else ("ours", "trl")
        pair = {kind: bench.run(kind, shape, samples, reserve, collect=collect) for kind in order}
        trl, ours = pair["trl"], pair["ours"]
        same = (trl["micro_batches"], trl["collated"], trl["pulled"]) == (
            ours["micro_batches"], ours["collated"], ours["pulled"])
        if not same or trl["trl_dropped"] or ours["trl_dropped"] or ours["our_dropped"]:
            raise AssertionError(f"pipelines did not see the same stream: trl={trl} ours={ours}")
        for kind in pair:
            runs[kind].append(pair[kind])
        ratios.append(ours["cpu_seconds"] / trl["cpu_seconds"])
        wall_ratios.append(ours["seconds"] / trl["seconds"])
    result = {"runs": runs, "ratios": ratios, "wall_ratios": wall_ratios}
    if dropping:
        filtered = bench.samples(shape, third_without_signal)
        result["dropping"] = [bench.run("ours", shape, filtered, reserve, drops=True) for _ in range(max(2, reps // 2))]
    return result


def interleaved(bench: Bench, shape: Shape, reps: int) -> list[float]:
    """ours/TRL CPU time with both loops advanced in turn, one micro-batch each (the order swapped every
    micro-batch), the collector off: a burst of load from other processes lands on both sides alike, which whole
    repetitions in turn (seconds apart) do not give. Pipeline work only; the collector's part is the collection
    counts of the per-repetition runs."""
    from grpo_trainer.progress import STOP_KEY

    samples = bench.samples(shape, varied)
    target = len(samples) - reserve_for(shape) * shape.generations
    ratios = []
    for _ in range(reps):
        trainers = {kind: bench.trainer(kind, shape) for kind in ("trl", "ours")}
        for trainer in trainers.values():
            for sample in samples:
                trainer.rollout_queue.put_nowait(sample)
        loaders = {kind: iter(trainer.get_train_dataloader()) for kind, trainer in trainers.items()}
        cpu = dict.fromkeys(loaders, 0.0)
        collated = dict.fromkeys(loaders, 0)
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            for step in itertools.count():
                if min(collated.values()) >= target:
                    break
                for kind in ("trl", "ours") if step % 2 == 0 else ("ours", "trl"):
                    if collated[kind] >= target:
                        continue
                    start = time.thread_time()
                    batch = next(loaders[kind])
                    cpu[kind] += time.thread_time() - start
                    if STOP_KEY in batch:
                        raise AssertionError("the stream stopped inside the timed window")
                    collated[kind] += round(float(batch["global_n_forward_tokens"][0] / batch["mean_seq_len"][0]))
                    del batch
        finally:
            gc.enable()
            gc.unfreeze()
        if collated["trl"] != collated["ours"]:
            raise AssertionError(f"the interleaved loops collated different samples: {collated}")
        ratios.append(cpu["ours"] / cpu["trl"])
        del loaders, trainers
    return ratios


def per_sample_us(runs: list[dict], per: str = "pulled") -> list[float]:
    return [run["cpu_seconds"] / run[per] * 1e6 for run in runs]


def run(context: Context) -> str:
    reps = context.reps(7, 3)
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=context.scratch) as scratch:
        bench = Bench(context.model_dir, scratch)
        results = {shape: measure(bench, shape, reps) for shape in shapes(context.quick)}
        for shape, result in results.items():
            result["interleaved"] = interleaved(bench, shape, reps)
        missed = [shape for shape, result in results.items() if statistics.median(result["ratios"]) > TARGET_RATIO]
        # Where the target is missed, the same comparison with the garbage collector off during the loop says how
        # much of the excess is collector time (it was most of it while this bench was written).
        without_gc = {shape: measure(bench, shape, reps, collect=False, dropping=False) for shape in missed}
    rows, drop_rows, misses = [], [], []
    for shape, result in results.items():
        trl, ours = result["runs"]["trl"], result["runs"]["ours"]
        ratio = sorted(result["ratios"])
        median_ratio = ratio[len(ratio) // 2]
        if median_ratio > TARGET_RATIO:
            misses.append((shape, median_ratio))
        rows.append([
            shape.label, trl[0]["pulled"], trl[0]["micro_batches"],
            spread(per_sample_us(trl), "{:.1f}"), spread(per_sample_us(ours), "{:.1f}"),
            spread([o - t for o, t in zip(per_sample_us(ours), per_sample_us(trl))], "{:+.1f}"),
            f"**{spread(result['ratios'], '{:.3f}')}**", spread(result["wall_ratios"], "{:.3f}"),
            " / ".join(spread([r["collections"] for r in runs], "{:.0f}") for runs in (trl, ours)),
            f"**{spread(result['interleaved'], '{:.3f}')}**",
        ])
        dropping = result["dropping"]
        trained = [run["collated"] for run in dropping]
        drop_rows.append([
            shape.label, dropping[0]["pulled"], spread(trained, "{:.0f}"),
            spread(per_sample_us(dropping), "{:.1f}"),
            spread(per_sample_us(dropping, "collated"), "{:.1f}"),
        ])
    text = [
        f"## {TITLE}",
        "",
        "The same pre-built stream of scored `RolloutSample`s (groups of 8) through the dataloader each trainer's own "
        "`get_train_dataloader` builds (TRL's `AsyncGRPOTrainer` and our `GRPOLearner`, constructed on the tiny "
        "model, never trained), consumed by a plain loop, no model. Repetitions alternate the order. Nothing is "
        "dropped in either pipeline and both loops see the same micro-batches (checked). "
        "µs per sample = CPU time of the consuming thread (the whole pipeline runs in it: `num_workers=0`) / "
        "samples pulled from the queue; CPU time rather than wall time because the cores are shared with other "
        "processes, which inflate wall time at random (the wall-time ratio is shown too). Ratio = ours / TRL per "
        f"repetition, {reps} repetitions; target ≤ {TARGET_RATIO}. Collections = garbage collections (any "
        "generation) inside the timed loop, per repetition: unlike time, a count the machine's load does not move. "
        "Our stream held each micro-batch while the batcher built the next, so two micro-batches' young objects "
        "(TRL's packing tries) were alive at once and the collector ran inside every micro-batch (205 collections "
        "against TRL's 11 on the small fixed-count stream); it now lets go first. The set-up heap (~476k objects) "
        "is frozen during the loop on both sides, as `GRPOLearner.train` does: unfrozen, about 5 full collections "
        "of it, 0.27 s each, landed in a realistic stream's repetition (1.6 of 2.3 s CPU, on either side).",
        "",
        table(["stream", "samples", "micro-batches", "TRL µs/sample", "ours µs/sample", "ours − TRL µs/sample",
               "ours/TRL (CPU)", "ours/TRL (wall)", "collections TRL / ours",
               "ours/TRL (CPU, interleaved per micro-batch, collector off)"], rows),
        "",
        "With a third of the groups without reward signal (ours only; TRL would train them): the filter drops them, "
        "so fewer samples are collated for the same input.",
        "",
        table(["stream", "samples in", "samples trained", "µs per sample in", "µs per sample trained"], drop_rows),
    ]
    differences = {shape: statistics.median(o - t for o, t in zip(per_sample_us(r["runs"]["ours"]),
                                                                   per_sample_us(r["runs"]["trl"])))
                   for shape, r in results.items()}
    fine_missed = [shape.label for shape, r in results.items() if statistics.median(r["interleaved"]) > TARGET_RATIO]
    text += ["", f"Load average (1 min) at this section's start and end: {load_at_start:.2f} and "
             f"{os.getloadavg()[0]:.2f}, on {os.cpu_count()} cores. Interleaved per micro-batch, ours/TRL is "
             + (f"above {TARGET_RATIO} on: {', '.join(fine_missed)}." if fine_missed
                else f"≤ {TARGET_RATIO} on every stream.")]
    for shape, median_ratio in misses:
        text += ["", f"**Missed target** ({shape.label}: {median_ratio:.3f} > {TARGET_RATIO} over whole "
                 "repetitions). " + _miss_note(differences, without_gc[shape], results[shape]["ratios"])]
    return "\n".join(text)


def _miss_note(differences: dict[Shape, float], without_gc: dict, with_gc: list[float]) -> str:
    spread_text = "; ".join(f"{shape.label}: {value:+.1f}" for shape, value in differences.items())
    no_gc = spread(without_gc["ratios"], "{:.3f}")
    text = (
        f"Median ours − TRL, µs/sample: {spread_text}. With the garbage collector off during the loop (same stream, "
        f"{len(without_gc['ratios'])} repetitions in turn) the ratio is {no_gc}"
    )
    with_gc_ratio = statistics.median(with_gc)
    share = (with_gc_ratio - statistics.median(without_gc["ratios"])) / (with_gc_ratio - 1)
    text += f" (the collector's share of the excess: about {max(share, 0):.0%}). "
    return text + (
        "Where ours runs more collections than TRL, something of ours keeps young objects alive across "
        "micro-batches; where the counts are equal, compare the excess with the min–max spread of the same row and "
        "with the interleaved column, which load moves far less."
    )
