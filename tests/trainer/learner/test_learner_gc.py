"""The learner keeps what set-up built out of the garbage collector's full collections while it trains."""

from __future__ import annotations

import gc


def test_the_set_up_heap_is_frozen_while_training_and_released_after(tiny_model_dir, tmp_path, monkeypatch):
    # A full collection walked the whole set-up heap (~476k objects, 0.27 s) about 5 times per 300 1,200-token
    # samples in the input pipeline alone (bench section 1).
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from grpo_trainer.testing.scripted_worker import GroupScript
    from tests.support.learner.one_prompt import one_prompt_learner

    learner = one_prompt_learner(tiny_model_dir, tmp_path, script=GroupScript(reward=lambda p, k: float(k % 2)))
    frozen_while_training: list[int] = []
    monkeypatch.setattr(AsyncGRPOTrainer, "train", lambda *_a, **_k: frozen_while_training.append(
        gc.get_freeze_count()))
    try:
        learner.train()
    finally:
        learner.close()
    assert frozen_while_training[0] > 100_000  # the model, tokenizer and libraries
    assert gc.get_freeze_count() == 0
