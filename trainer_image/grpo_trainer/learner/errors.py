"""The learner's error for a user mistake it finds while loading what the run config names (the dataset, the model,
a LoRA target, a reward model): one line naming the field; the learner then exits EXIT_INVALID_CONFIG."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the run config found while loading what it names. One line; exit EXIT_INVALID_CONFIG."""
