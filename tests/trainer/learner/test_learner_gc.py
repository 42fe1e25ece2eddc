"""The learner keeps what set-up built out of the garbage collector's full collections while it trains."""

from __future__ import annotations

import gc


def test_the_set_up_heap_is_frozen_while_training_and_released_after(tiny_model_dir, tmp_path, monkeypatch):
    # A full collection walked the whole set-up heap (~476k objects, 0.27 s) about 5 times per 300 1,200-token
    # samples in the input pipeline alone (bench section 1).
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from grpo_trainer.learner.trainer import GRPOLearner
    from grpo_trainer.testing.scripted_worker import GroupScript, NoWeightTransfer, SampleShape, ScriptedRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "p0"}]]})
    worker = ScriptedRolloutWorker(dataset_size=1, num_generations=2, shape=SampleShape(vocab_size=len(tokenizer)),
                                   script=GroupScript(reward=lambda p, k: float(k % 2)))
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dtype="float32", report_to=[], num_generations=2,
                           per_device_train_batch_size=2, token_budget=0, save_strategy="no", disable_tqdm=True)
    learner = GRPOLearner(tiny_model_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                          rollout_worker=worker, weight_transfer=NoWeightTransfer())
    frozen_while_training: list[int] = []
    monkeypatch.setattr(AsyncGRPOTrainer, "train", lambda *_a, **_k: frozen_while_training.append(
        gc.get_freeze_count()))
    try:
        learner.train()
    finally:
        learner.close()
    assert frozen_while_training[0] > 100_000  # the model, tokenizer and libraries
    assert gc.get_freeze_count() == 0
