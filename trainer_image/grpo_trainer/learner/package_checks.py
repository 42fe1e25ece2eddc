"""accelerate's check for peft, answered once per process.

accelerate's `is_peft_available` reads peft's package metadata from disk on every call (0.8 ms of CPU on the
development machine), and its `is_peft_model` asks it twice a call. TRL asks `is_peft_model` three times in every
weight sync (`trl/experimental/async_grpo/async_grpo_trainer.py:671,1777,1787 (trl 1.16.0)`), so a run that syncs
every step spent a few milliseconds a step on it, training nothing. Whether peft is installed does not change while
the learner runs (transformers caches its own check the same way).
"""

from __future__ import annotations

import functools


def cache_peft_check() -> None:
    """Answer accelerate's `is_peft_available` once, from now on, wherever accelerate calls it. Idempotent."""
    import accelerate.utils
    from accelerate.utils import imports, modeling

    if hasattr(modeling.is_peft_available, "cache_info"):
        return
    cached = functools.cache(imports.is_peft_available)
    cached()
    for module in (imports, modeling, accelerate.utils):
        module.is_peft_available = cached
