"""One scripted run of the real GRPOLearner (tiny local model, ScriptedRolloutWorker, no vLLM).

Run as a script, alone or under `accelerate launch` with several CPU processes (ddp or fsdp2); every rank writes
`OUT/rank{R}.json` with what the tests compare across ranks (stop micro-batch, steps, parameter checksum, how many
parameters are FSDP2 shards, outcome). Used by tests/trainer/learner/test_learner_runs.py, test_fsdp2.py and bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

SCENARIOS = {
    # (absolute group position, generation) -> reward
    "varied": lambda position, k: float(k % 2),
    "third_no_signal": lambda position, k: 0.0 if position % 3 == 0 else float(k % 2),
    "no_signal": lambda position, k: 1.0,
    "unscorable": lambda position, k: float("nan"),  # every reward function returned None
    "last_pass_no_signal": None,  # built in main(): depends on the dataset size
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="per-device train batch size (samples)")
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--stall-groups", type=int, default=0)
    parser.add_argument("--keep-no-signal", action="store_true", help="filter.dropNoSignal: false")
    parser.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--resume-newest", default=None, help="resume from the newest valid checkpoint here")
    parser.add_argument("--lost-every", type=int, default=0, help="every Nth group never reaches the trainer")
    parser.add_argument("--max-staleness", type=int, default=1000)
    parser.add_argument("--queue-maxsize", type=int, default=64, help="the worker's queue, in samples")
    parser.add_argument("--weights-dir", default=None, help="filesystem weight sync into this directory")
    parser.add_argument("--weights-server", default=None, help="the server the filesystem sync reloads")
    parser.add_argument("--weight-sync-deadline", type=float, default=900, help="seconds a weight sync may take")
    parser.add_argument("--baseline", action="store_true", help="plain AsyncGRPOTrainer instead of GRPOLearner")
    parser.add_argument("--progress-port", type=int, default=None)
    parser.add_argument("--worker-delay", type=float, default=0.0)
    parser.add_argument("--worker-fails-after", type=int, default=None, help="the worker dies after N groups")
    parser.add_argument("--reward-model", default=None, help="a reward model scored on the learner (rank 0)")
    parser.add_argument("--unscorable-every", type=int, default=0,
                        help="every Nth prompt holds the tiny reward model's NaN marker")
    parser.add_argument("--sigterm-at-step", type=int, default=None, help="the process SIGTERMs itself at step N")
    parser.add_argument("--off-policy-every", type=int, default=0,
                        help="every Nth group's rollout logprobs are far off the learner's (1: every group)")
    parser.add_argument("--nan-logprobs-every", type=int, default=0, help="every Nth group's rollout logprobs are NaN")
    parser.add_argument("--is-clip-max", type=float, default=None, help="training.vllmImportanceSamplingClipMax")
    parser.add_argument("--lora-rank", type=int, default=0, help="training.lora with this rank (0: no LoRA)")
    parser.add_argument("--multi-row", action="store_true",
                        help="each conversation becomes 1-3 training rows (forks), its group stamped as with tools")
    parser.add_argument("--sigkill-at-step", type=int, default=None, help="the process SIGKILLs itself at step N")
    parser.add_argument("--mlflow", default=None, help="spec.tracking.mlflow.trackingUri: the learner's trackers")
    parser.add_argument("--signal-tracker-at-step", type=int, default=None,
                        help="at step N, send --tracker-signal to the tracking server's process group")
    parser.add_argument("--tracker-pgid", type=int, default=None, help="the tracking server's process group")
    parser.add_argument("--tracker-signal", choices=("SIGSTOP", "SIGKILL"), default="SIGSTOP")
    parser.add_argument("--checkpoint-uri", default=None,
                        help="checkpoint.uri: upload checkpoints there (the store the environment names) and, with "
                             "no checkpoint in --out's folder, resume from its newest")
    return parser.parse_args(argv)


def fork_rows(position: int, generation: int) -> int:
    """--multi-row: the rows conversation `generation` of the group at `position` becomes (1, 2 or 3)."""
    return 1 + (position + generation) % 3


def every_nth(n: int):
    """Positions n-1, 2n-1, ...: the Nth group of each run of N (None when n is 0)."""
    return (lambda position: position % n == n - 1) if n else None


def main(argv=None) -> int:
    from grpo_trainer.learner import gang, preemption

    preemption.install()
    gang.record_start()
    return gang.record_outcome(run_scenario(parse_args(argv)))


def run_scenario(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from grpo_trainer.contract.config import FilterConfig, RewardConfig
    from grpo_trainer.learner import preemption
    from grpo_trainer.learner.cpu import enable_cpu_support
    from grpo_trainer.learner.scoring import RewardModel
    from grpo_trainer.learner.step_scoring import ImportanceBounds
    from grpo_trainer.learner.trainer import GRPOLearner, LearnerReporting, WeightSyncOptions
    from grpo_trainer.testing.scripted_worker import (
        GroupScript,
        NoWeightTransfer,
        SampleShape,
        ScriptedRolloutWorker,
    )
    from grpo_trainer.testing.tiny_assets import UNSCORABLE_MARKER

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"p{i}"}] for i in range(args.prompts)]})
    reward = SCENARIOS[args.scenario]
    if args.scenario == "last_pass_no_signal":
        last_pass = int(args.epochs) - 1
        reward = lambda position, k: 1.0 if position // args.prompts == last_pass else float(k % 2)  # noqa: E731
    lost = (lambda position: position % args.lost_every == args.lost_every - 1) if args.lost_every else None
    every = args.unscorable_every

    def prompt_text(index: int) -> str:
        return f"prompt {index} {UNSCORABLE_MARKER}" if every and index % every == every - 1 else f"prompt {index}"

    script = GroupScript(reward=reward, lost=lost, off_policy=every_nth(args.off_policy_every),
                         nan_logprobs=every_nth(args.nan_logprobs_every), fail_after_groups=args.worker_fails_after,
                         rows=fork_rows if args.multi_row else None)
    worker = ScriptedRolloutWorker(
        dataset_size=args.prompts, num_generations=args.generations, script=script,
        shape=SampleShape(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id),
        delay_s=args.worker_delay, prompt_text=prompt_text, queue_maxsize=args.queue_maxsize,
    )
    reward_models = []
    if args.reward_model and int(os.environ.get("RANK", "0")) == 0:
        reward_models = [RewardModel.load(RewardConfig(model=args.reward_model), "cpu")]
    tracking_callback, report_to = None, []
    if args.mlflow:  # the learner's trackers as learner_main wires them
        from functools import partial

        from grpo_trainer.contract.config import RunConfig
        from grpo_trainer.learner import tracking

        run = RunConfig.model_validate({
            "model": args.model, "dataset": {"path": "unused.jsonl"}, "rewards": [{"name": "constant"}],
            "runName": "scenario", "namespace": "tests", "outputDir": str(out / "checkpoints"),
            "tracking": {"mlflow": {"trackingUri": args.mlflow, "experiment": out.name}}})
        trackers = tracking.configure(run)
        tracking_callback, report_to = partial(tracking.parameters_callback, run, trackers), trackers.trackers
    config = AsyncGRPOConfig(
        output_dir=str(out / "checkpoints"), use_cpu=True, dtype="float32", report_to=report_to, logging_steps=1,
        num_generations=args.generations, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.ga, num_train_epochs=args.epochs, max_steps=args.max_steps,
        token_budget=0, max_staleness=args.max_staleness, learning_rate=1e-3, disable_tqdm=True, seed=0,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
    )
    uploads = store = None
    if args.checkpoint_uri:
        from grpo_trainer.contract.config import CheckpointConfig
        from grpo_trainer.learner.checkpoint_store import CheckpointStore, CheckpointUploads

        store = CheckpointStore.from_config(CheckpointConfig(uri=args.checkpoint_uri))
        store.probe()
        uploads = CheckpointUploads(store)
    transfer = NoWeightTransfer()
    if args.weights_dir:
        from grpo_trainer.rollout.weight_sync import FilesystemWeightTransfer

        transfer = FilesystemWeightTransfer([args.weights_server], args.weights_dir)
    common = dict(args=config, train_dataset=dataset, processing_class=tokenizer, rollout_worker=worker,
                  weight_transfer=transfer)
    if args.lora_rank:
        from grpo_trainer.contract.config import LoraConfig
        from grpo_trainer.learner.lora import peft_config

        common["peft_config"] = peft_config(LoraConfig(r=args.lora_rank))
    if args.baseline:
        enable_cpu_support()
        trainer = AsyncGRPOTrainer(args.model, **common)
    else:
        trainer = GRPOLearner(args.model, **common, stall_groups=args.stall_groups,
                              filter_config=FilterConfig(drop_no_signal=not args.keep_no_signal),
                              reporting=LearnerReporting(server_port=args.progress_port, tracking=tracking_callback,
                                                         checkpoint_uploads=uploads),
                              reward_models=reward_models,
                              weight_sync=WeightSyncOptions(args.weight_sync_deadline),
                              importance_bounds=ImportanceBounds(clip_max=args.is_clip_max))

    micro_batches: list[int] = []  # 1 trained, -1 fetched but discarded (the stop cut its window short), 0 the stop
    original_step = trainer.training_step

    def counting_step(model, inputs, num_items_in_batch=None):
        micro_batches.append(0 if "rollout_stop" in inputs else 1)
        return original_step(model, inputs, num_items_in_batch)

    trainer.training_step = counting_step
    if not args.baseline:
        original_stop = trainer._stop

        def counting_stop(*stop):
            micro_batches.extend([-1] * trainer.discarded_micro_batches + [0])
            return original_stop(*stop)

        trainer._stop = counting_stop
        original_fetch = trainer.get_batch_samples
        stepped: list[int] = []  # absolute positions of the groups in windows that went on to train

        def recording_fetch(*fetch_args):
            fetched = original_fetch(*fetch_args)
            stepped.extend(trainer.progress.start_group + g for g in sorted(trainer.window_groups))
            return fetched

        trainer.get_batch_samples = recording_fetch
        preemption.route_to(trainer.request_preemption)

    from torch.distributed.tensor import DTensor

    def whole(parameter) -> torch.Tensor:
        """A parameter whole on every rank: an FSDP2 shard is gathered (a collective every rank enters)."""
        return (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach().double()

    def adapter_checksum() -> float:
        return sum(float(whole(p).sum()) for name, p in trainer.model.named_parameters() if "lora_" in name)

    class Timeline(TrainerCallback):
        def on_train_begin(self, _args, _state, _control, **_kwargs):
            adapter_at_start.append(adapter_checksum())  # after a resume loaded the checkpoint

        def on_step_end(self, _args, state, _control, **_kwargs):
            if state.global_step == args.sigterm_at_step:
                sigterm_time.append(time.time())
                os.kill(os.getpid(), signal.SIGTERM)
            entry = {"step": state.global_step, "t": time.time(), "consumed": len(trainer._trained_groups)}
            if not args.baseline:
                entry["stepped"] = sorted(set(stepped))
            if not args.baseline and trainer.accelerator.is_main_process:
                report = trainer.progress_report()  # checks the accounting identity; raises when it breaks
                entry["report"] = {"consumed": report.groups_consumed, "trained": report.groups_trained,
                                   "dropped": report.dropped_total, "regenerated": report.regenerated}
            timeline.append(entry)
            if state.global_step == args.signal_tracker_at_step:
                # What was logged before reaches the tracker first (each integration runs on its own thread).
                assert all(cb.settle(60) for cb in trainer.callback_handler.callbacks if hasattr(cb, "settle"))
                tracker_signalled.append(time.time())
                os.killpg(args.tracker_pgid, getattr(signal, args.tracker_signal))
            if state.global_step == args.sigkill_at_step:
                if uploads is not None:
                    uploads.wait()  # the earlier checkpoints are up: the test knows which one the store holds
                # What the test can know of a killed process: the windows it stepped, by step.
                uploaded = uploads.last.__dict__ if uploads is not None and uploads.last else None
                (out / "killed.json").write_text(json.dumps({"timeline": timeline, "uploaded": uploaded}))
                os.kill(os.getpid(), signal.SIGKILL)  # before this step's checkpoint: the newest is an older one

    timeline: list[dict] = []
    adapter_at_start: list[float] = []
    sigterm_time: list[float] = []
    tracker_signalled: list[float] = []
    trainer.add_callback(Timeline())
    rank = trainer.accelerator.process_index
    started = time.time()
    outcome, message = "succeeded", ""
    resume = args.resume_from
    if args.resume_newest:
        from grpo_trainer.learner.checkpoints import newest_checkpoint

        resume = newest_checkpoint(args.resume_newest)
    elif store is not None and resume is None:
        from grpo_trainer.learner.checkpoint_store import agree_on_resume, resume_point

        # The machines torchrun joined (each one's local ranks share its folder), as the pod's learner.nodes.
        machines = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        resume = resume_point(config.output_dir, store, machines=machines)
        agree_on_resume(resume)
    try:
        trainer.train(resume_from_checkpoint=resume)
        if uploads is not None:
            uploads.wait()  # as the learner's entrypoint: the last checkpoint up before the run ends
        if not args.baseline and trainer.phase.value == "Preempted":
            outcome, message = "Preempted", trainer.message
    except Exception as error:  # noqa: BLE001 - recorded for the test, then re-raised as the exit code
        outcome, message = type(error).__name__, str(error)
    ended = time.time()
    checksum = sum(float(whole(p).sum()) for p in trainer.model.parameters())
    result = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "outcome": outcome,
        "message": message,
        "global_step": trainer.state.global_step,
        "micro_batches": micro_batches,
        "checksum": checksum,
        "sharded_parameters": sum(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "parameters": len(list(trainer.model.parameters())),
        "adapter_checksum": adapter_checksum(),
        "adapter_checksum_at_start": adapter_at_start[0] if adapter_at_start else None,
        "seconds": ended - started,
        "ended": ended,
        "timeline": timeline,
        "sigterm_time": sigterm_time[0] if sigterm_time else None,
        "tracker_signalled": tracker_signalled[0] if tracker_signalled else None,
        "resumed_from": resume,
    }
    if rank == 0:
        result["groups_generated"] = worker.groups_generated
        result["samples_generated"] = worker.samples_generated
        result["start_position"] = worker._loop_kwargs["dataset_start_index"]
        result["model_version"] = trainer.model_version
        if args.weights_dir:
            result["weight_version"] = transfer.version
            result["weight_dirs"] = sorted(os.listdir(args.weights_dir))
        if not args.baseline:
            result["progress"] = trainer.progress_report().to_wire()
            result["consumed_absolute"] = trainer.progress.consumed_positions()
            result["stepped_groups"] = stepped
            result["episodes"] = trainer.episodes.report().model_dump()
            result["samples_masked"] = trainer.exclusions.samples_masked
            result["samples_scored"] = trainer.exclusions.samples_scored
            if trainer.scoring is not None:
                result["scored_samples"] = trainer.scoring.samples_scored
                result["unscorable_samples"] = trainer.scoring.unscorable_samples
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if not args.baseline:
        trainer.close()
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    return {"succeeded": 0, "StallError": 42, "WeightSyncStuck": 42, "Preempted": 75}.get(outcome, 1)


if __name__ == "__main__":
    sys.exit(main())
