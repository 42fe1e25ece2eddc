"""A weight sync asks accelerate whether the model is a peft model; the answer is not read from disk each time."""

from __future__ import annotations

import importlib.metadata

from tests.support.learner.one_prompt import one_prompt_learner


def test_a_weight_sync_reads_no_package_metadata(tiny_model_dir, tmp_path, monkeypatch):
    # accelerate's is_peft_available read peft's metadata (0.8 ms) twice per is_peft_model, which TRL's merged weight
    # sync calls three times: every step of a run that syncs every step.
    learner = one_prompt_learner(tiny_model_dir, tmp_path)
    read = []
    metadata = importlib.metadata.metadata
    monkeypatch.setattr(importlib.metadata, "metadata", lambda name, *a: read.append(name) or metadata(name, *a))
    try:
        for _ in range(3):
            learner._sync_weight()
    finally:
        learner.close()
    assert learner.sync_timer.syncs == 3
    assert read == []
