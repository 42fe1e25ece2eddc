"""One learner process against real rollout servers, recording every optimizer step (bench sections 9 and 11).

`python -m bench.traced_learner --kind ours|trl --config run.json --records steps.jsonl [--wall-bound S]`

- ours: the learner entrypoint itself (`python -m grpo_trainer learner`, what the learner pod runs: the rollout
  supervision and routing, weight sync, progress), with one callback added to the learner it builds;
- trl: TRL 1.16's unmodified AsyncGRPOTrainer built from the same run config (the same TRL arguments, dataset,
  rewards and tokenizer), its own AsyncRolloutWorker talking straight to the first server in `rollout.urls`. TRL's
  weight transfer needs NCCL and a GPU; it gets the filesystem sync our learner uses, the only one a CPU server has.

Each step appends one JSON line: the wall time it was logged at, the global step, TRL's own per-step figures
(`perf/rollout_wait_s`: seconds the trainer sat blocked on an empty rollout queue since the previous step;
`batch/samples_per_step`, `batch/groups_per_step`, `perf/step_s`), `cpu_s`: the user + system CPU seconds the
learner process and its children (both trainers' rollout worker is a child process) have used so far, and
`no_signal`: the samples without reward signal the trainer has taken into its batches so far.
`--thread-cpu` adds `threads`: the CPU seconds each thread of the learner process (by its Python name; threads
Python did not start, such as torch's, under "native") and each child process has used so far, and `parts`: the CPU
seconds of the calling thread in each of the trainer's parts that both trainers share (`PARTS`), so far. A thread
that has ended (ours runs each weight sync on a thread of its own) is in the process's `cpu_s` and in `parts`, no
longer in `threads`.
`--wall-bound S` stops training at the first step logged S seconds or more after the first one (TRL has no bound of
its own short of its epochs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

#: TRL's per-step log keys the bench reads (TRL owns the names; trl/experimental/async_grpo/async_grpo_trainer.py).
WAIT_KEY, SAMPLES_KEY, GROUPS_KEY, STEP_KEY = (
    "perf/rollout_wait_s", "batch/samples_per_step", "batch/groups_per_step", "perf/step_s")
#: The completion tokens TRL's worker received per s over the step's log window (async_rollout_worker.py): where the
#: server bounds the run, the server's own pace.
GENERATED_KEY = "rollout/generated_tok_s"


class ProcessTreeCpu:
    """CPU seconds used so far by this process and the children it had when first asked (the rollout worker is
    started before the first step); found once, so that a step does not pay for a scan of every process."""

    def __init__(self) -> None:
        self.processes: list | None = None

    def __call__(self) -> float:
        import psutil

        if self.processes is None:
            me = psutil.Process()
            self.processes = [me, *me.children(recursive=True)]
        total = 0.0
        for process in self.processes:
            with contextlib.suppress(psutil.Error):  # a child gone: its time is no longer the run's to count
                times = process.cpu_times()
                total += times.user + times.system
        return total


#: How `cpu_by_thread` names a child process's CPU seconds (followed by its pid).
CHILD_PREFIX = "child "


def cpu_by_thread() -> dict[str, float]:
    """CPU seconds so far of each thread of this process by Python thread name, and of each child process."""
    import threading

    import psutil

    me = psutil.Process()
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    totals: dict[str, float] = {}
    for thread in me.threads():
        name = names.get(thread.id, "native")
        totals[name] = totals.get(name, 0.0) + thread.user_time + thread.system_time
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            totals[f"{CHILD_PREFIX}{child.pid}"] = times.user + times.system
    return totals


class NoSignalSamples:
    """Counts the samples without reward signal (their group's reward std at most ours' `filter.noSignalEpsilon`, or
    NaN) that TRL's queue dataset hands on to the batcher: what a learner trains of them. Both learners read their
    samples through that dataset (ours after its filter, TRL straight from the worker's queue)."""

    def __init__(self) -> None:
        from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

        from grpo_trainer.contract.config import FilterConfig

        epsilon = FilterConfig().no_signal_epsilon
        self.samples = 0
        original = RolloutQueueDataset.__iter__

        def counted(dataset):
            for item in original(dataset):
                std = item["metrics"].get("reward_std", math.nan)
                if math.isnan(std) or std <= epsilon:
                    self.samples += 1
                yield item

        RolloutQueueDataset.__iter__ = counted


#: The trainer's methods whose CPU `--thread-cpu` times, on both trainers (each names TRL's method, which ours
#: overrides or calls): the forward and backward, fetching a batch, logging, and the weight sync's own thread-side work
#: (on the training thread in TRL, on a thread of its own in ours; its HTTP calls run on threads of their own).
PARTS = ("training_step", "get_batch_samples", "log", "_sync_weight_merged")


def time_parts(trainer) -> dict[str, float]:
    """Wrap `trainer`'s `PARTS` so that each adds its calling thread's CPU seconds to the returned dict."""
    seconds = dict.fromkeys(PARTS, 0.0)
    for name in PARTS:
        method = getattr(trainer, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            started = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_name] += time.thread_time() - started

        setattr(trainer, name, timed)
    return seconds


def step_recorder(path: str, wall_bound_s: float | None, thread_cpu: bool = False,
                  parts: dict[str, float] | None = None):
    from transformers import TrainerCallback

    cpu_seconds = ProcessTreeCpu()
    no_signal = NoSignalSamples()

    class StepRecorder(TrainerCallback):
        deadline: float | None = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or WAIT_KEY not in logs:
                return
            record = {"t": time.time(), "step": state.global_step, "wait_s": logs[WAIT_KEY],
                      "samples": logs.get(SAMPLES_KEY, 0.0), "groups": logs.get(GROUPS_KEY, 0.0),
                      "step_s": logs.get(STEP_KEY), "cpu_s": cpu_seconds(), "no_signal": no_signal.samples,
                      "generated_tok_s": logs.get(GENERATED_KEY),
                      "perf": {key: value for key, value in logs.items() if key.startswith("perf/")}}
            if thread_cpu:
                record["threads"] = cpu_by_thread()
            if parts is not None:
                record["parts"] = dict(parts)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if wall_bound_s and self.deadline is None:
                self.deadline = record["t"] + wall_bound_s
            if self.deadline is not None and record["t"] >= self.deadline:
                control.should_training_stop = True

    return StepRecorder()


def run_ours(config_path: str, records: str, wall_bound_s: float | None, thread_cpu: bool = False) -> int:
    from grpo_trainer.__main__ import main
    from grpo_trainer.learner import main as learner_main

    build = learner_main.build_learner

    def build_traced(*args, **kwargs):
        learner = build(*args, **kwargs)
        parts = time_parts(learner) if thread_cpu else None
        learner.add_callback(step_recorder(records, wall_bound_s, thread_cpu, parts))
        return learner

    learner_main.build_learner = build_traced
    return main(["learner", "--config", config_path])


def run_trl(config_path: str, records: str, wall_bound_s: float | None, thread_cpu: bool = False) -> int:
    from transformers import AutoConfig, AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from grpo_trainer.__main__ import read_config
    from grpo_trainer.learner.cpu import enable_cpu_support
    from grpo_trainer.learner.datasets import load_prompts
    from grpo_trainer.learner.main import http_only_rollout_worker, trainer_arguments
    from grpo_trainer.learner.rewards import load_rewards
    from grpo_trainer.rollout.weight_sync import TIED_EMBEDDING_ALIASES, FilesystemWeightTransfer

    config = read_config(config_path)
    args = AsyncGRPOConfig(**trainer_arguments(config))
    args.vllm_server_base_url = config.rollout.urls[0]
    tied = bool(getattr(AutoConfig.from_pretrained(config.model).get_text_config(), "tie_word_embeddings", False))
    transfer = FilesystemWeightTransfer(config.rollout.urls[:1], config.rollout.weight_sync.directory,
                                        aliases=TIED_EMBEDDING_ALIASES if tied else None)
    enable_cpu_support()
    with http_only_rollout_worker(config):
        trainer = AsyncGRPOTrainer(
            model=config.model, reward_funcs=load_rewards(config.rewards), args=args,
            train_dataset=load_prompts(config.dataset), processing_class=AutoTokenizer.from_pretrained(config.model),
            weight_transfer=transfer,
        )
    parts = time_parts(trainer) if thread_cpu else None
    trainer.add_callback(step_recorder(records, wall_bound_s, thread_cpu, parts))
    trainer.train()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.traced_learner", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("ours", "trl"), required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--records", required=True)
    parser.add_argument("--wall-bound", type=float, default=None, help="stop S seconds after the first step")
    parser.add_argument("--thread-cpu", action="store_true", help="record each thread's and child's CPU seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.kind == "trl":
        code = run_trl(args.config, args.records, args.wall_bound, args.thread_cpu)
    else:
        code = run_ours(args.config, args.records, args.wall_bound, args.thread_cpu)
    sys.stdout.flush()
    sys.stderr.flush()
    # TRL's rollout worker thread can outlive train(); the records are written, so do not wait on it.
    os._exit(code)


if __name__ == "__main__":
    main()
