"""One scripted training run of the real trainer, instrumented for stop and stall latency (sections 2 and 3).

`python -m bench.learner_run --kind ours|trl --scenario S --model DIR --out FILE [...]` trains our GRPOLearner or
TRL's unmodified AsyncGRPOTrainer on the tiny model with a ScriptedRolloutWorker, and writes FILE (JSON) with:
- when the trainer pulled the last sample of a needed group (group id < prompts x epochs) from the rollout queue,
  and how many samples it pulled in all;
- per trained micro-batch: its time, the global step before it, whether it held a needed group, its sample count
  and how many of its samples had no reward signal (group ids are recorded where DataCollatorForRollout collates
  them, read back FIFO in training_step);
- micro-batches collated but never trained that held a needed group;
- the outcome, final step, and (ours) the progress report and the consumed group ids.
A watchdog ends the process after --wall-bound seconds with outcome "timeout", the file written first, so a
baseline that never stops still reports what it did. The parent times process exit itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import deque

# The scripted scenarios; `reward_script` gives each its reward per (absolute group position, generation).
SCENARIOS = ("varied", "third_no_signal", "last_pass_no_signal", "last_pass_oversize", "stall_after")
SHORT_COMPLETION, LONG_COMPLETION, PROMPT_TOKENS, TOKEN_BUDGET = 8, 80, 8, 64


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.learner_run")
    parser.add_argument("--kind", choices=("ours", "trl"), required=True)
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--stall-groups", type=int, default=0)
    parser.add_argument("--trained-groups", type=int, default=0, help="stall_after: groups with signal before none")
    parser.add_argument("--wall-bound", type=float, default=60.0)
    return parser.parse_args(argv)


def reward_script(args: argparse.Namespace):
    last_pass = int(args.epochs) - 1
    return {
        "varied": lambda position, k: float(k % 2),
        "third_no_signal": lambda position, k: 0.0 if position % 3 == 0 else float(k % 2),
        "last_pass_no_signal": lambda position, k: 1.0 if position // args.prompts == last_pass else float(k % 2),
        "last_pass_oversize": lambda position, k: float(k % 2),
        "stall_after": lambda position, k: float(k % 2) if position < args.trained_groups else 1.0,
    }[args.scenario]


def build_worker(args: argparse.Namespace, tokenizer):
    from grpo_trainer.testing.scripted_worker import GroupScript, SampleShape, ScriptedRolloutWorker

    class Worker(ScriptedRolloutWorker):
        """last_pass_oversize: from the last pass on, samples exceed the token budget (a completion-length blow-up),
        which both trainers drop. Only the last pass would let TRL end by training the next pass in its place."""

        def group_samples(self, group_id, position):
            oversize = args.scenario == "last_pass_oversize" and position // args.prompts >= int(args.epochs) - 1
            self.completion_tokens = LONG_COMPLETION if oversize else SHORT_COMPLETION
            return super().group_samples(group_id, position)

    return Worker(
        dataset_size=args.prompts, num_generations=args.generations, script=GroupScript(reward=reward_script(args)),
        shape=SampleShape(vocab_size=len(tokenizer), prompt_tokens=PROMPT_TOKENS, completion_tokens=SHORT_COMPLETION,
                          eos_token_id=tokenizer.eos_token_id),
    )


class PullRecorder:
    """The trainer's rollout queue, recording when the last sample of a needed group was pulled."""

    def __init__(self, inner, needed_end: int):
        self.inner = inner
        self.needed_end = needed_end
        self.pulled = 0
        self.pulled_at_last_needed = 0
        self.last_needed_time: float | None = None

    def get(self, timeout=None):
        return self._record(self.inner.get(timeout=timeout))

    def get_nowait(self):
        return self._record(self.inner.get_nowait())

    def _record(self, sample):
        self.pulled += 1
        if int(sample.group_id) < self.needed_end:
            self.pulled_at_last_needed = self.pulled
            self.last_needed_time = time.time()
        return sample

    def qsize(self) -> int:
        return self.inner.qsize()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    started = time.time()
    import math

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

    from grpo_trainer.contract.config import FilterConfig
    from grpo_trainer.learner.cpu import enable_cpu_support
    from grpo_trainer.learner.trainer import GRPOLearner
    from grpo_trainer.progress import STOP_KEY
    from grpo_trainer.testing.scripted_worker import NoWeightTransfer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"p{i}"}] for i in range(args.prompts)]})
    needed_end = math.ceil(args.epochs * args.prompts)
    worker = build_worker(args, tokenizer)
    config = AsyncGRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "checkpoints"), use_cpu=True,
        dtype="float32", report_to=[], logging_steps=1, num_generations=args.generations,
        gradient_accumulation_steps=args.ga, num_train_epochs=args.epochs, token_budget=TOKEN_BUDGET,
        max_staleness=1000, learning_rate=1e-3, disable_tqdm=True, seed=0, save_strategy="no",
    )
    common = dict(args=config, train_dataset=dataset, processing_class=tokenizer, rollout_worker=worker,
                  weight_transfer=NoWeightTransfer())
    if args.kind == "trl":
        enable_cpu_support()
        trainer = AsyncGRPOTrainer(args.model, **common)
    else:
        trainer = GRPOLearner(args.model, **common, stall_groups=args.stall_groups, filter_config=FilterConfig())
    recorder = PullRecorder(trainer.rollout_queue, needed_end)
    trainer.rollout_queue = recorder

    collated: deque[list[int]] = deque()
    original_collate = DataCollatorForRollout.torch_call

    def recording_collate(self, examples):
        samples = [sample for row in examples[0] for sample in row.samples]
        no_signal = sum(1 for sample in samples if not sample["metrics"].get("reward_std", 0.0) > 1e-6)
        collated.append(([int(sample["group_id"]) for sample in samples], no_signal))
        return original_collate(self, examples)

    DataCollatorForRollout.torch_call = recording_collate  # ProgressCollator reaches it through super()
    micro_batches: list[dict] = []
    original_step = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        record = {"t": time.time(), "step_before": trainer.state.global_step}
        if STOP_KEY in inputs:
            record |= {"stop": True, "needed": False, "samples": 0}
        else:
            groups, no_signal = collated.popleft()
            record |= {"stop": False, "needed": any(g < needed_end for g in groups), "samples": len(groups),
                       "max_group": max(groups), "no_signal_samples": no_signal}
        micro_batches.append(record)
        return original_step(model, inputs, num_items_in_batch)

    trainer.training_step = recording_step
    outcome = {"outcome": "running", "message": ""}
    written = threading.Lock()

    def write_result() -> None:
        result = {
            **vars(args),
            **outcome,
            "started": started,
            "ended": time.time(),
            "needed_end": needed_end,
            "global_step": trainer.state.global_step,
            "pulled": recorder.pulled,
            "pulled_at_last_needed": recorder.pulled_at_last_needed,
            "last_needed_time": recorder.last_needed_time,
            "micro_batches": list(micro_batches),
            # Collated (so counted by TRL's epoch stop) but never trained: accelerate's dispatcher reads one ahead.
            "untrained_needed": sum(1 for groups, _ in list(collated) if any(g < needed_end for g in groups)),
            "samples_generated": worker.samples_generated,
            "groups_generated": worker.groups_generated,
        }
        if args.kind == "ours":
            result["progress"] = trainer.progress_report().to_wire()
            result["consumed"] = sorted(trainer.progress.consumed)
        with open(args.out, "w") as f:
            json.dump(result, f)

    def watchdog() -> None:
        with written:
            outcome.update(outcome="timeout", message=f"did not stop within {args.wall_bound:.0f} s")
            write_result()
            sys.stdout.flush()
            os._exit(124)

    timer = threading.Timer(args.wall_bound, watchdog)
    timer.daemon = True
    timer.start()
    try:
        trainer.train()
        outcome["outcome"] = "succeeded"
    except Exception as error:  # noqa: BLE001 - recorded, then turned into the exit code
        outcome.update(outcome=type(error).__name__, message=str(error))
    with written:
        timer.cancel()
        write_result()
    if args.kind == "ours":
        trainer.close()
    return {"succeeded": 0, "StallError": 42}.get(outcome["outcome"], 1)


if __name__ == "__main__":
    sys.exit(main())
