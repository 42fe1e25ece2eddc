"""A GRPOLearner on one prompt of the tiny model with TRL's worker scripted: for tests of what the learner is once
built (its report, its weight sync, its train() set-up), not of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def one_prompt_learner(model_dir: str, output_dir: Path, script=None, **learner_kwargs: Any):
    """The learner (`close()` it), groups of 2 samples (`script`: the scripted worker's GroupScript; its default
    otherwise), no weight transfer; `learner_kwargs` go to GRPOLearner."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from grpo_trainer.learner.trainer import GRPOLearner
    from grpo_trainer.testing.scripted_worker import NoWeightTransfer, SampleShape, ScriptedRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "p0"}]]})
    args = AsyncGRPOConfig(output_dir=str(output_dir), use_cpu=True, dtype="float32", report_to=[],
                           num_generations=2, per_device_train_batch_size=2, token_budget=0, save_strategy="no",
                           disable_tqdm=True)
    shape = SampleShape(vocab_size=len(tokenizer))
    worker = (ScriptedRolloutWorker(dataset_size=1, num_generations=2, shape=shape) if script is None
              else ScriptedRolloutWorker(dataset_size=1, num_generations=2, shape=shape, script=script))
    return GRPOLearner(model_dir, args=args, train_dataset=dataset, processing_class=tokenizer, rollout_worker=worker,
                       weight_transfer=NoWeightTransfer(), **learner_kwargs)
