"""The no-signal row's task (bench section 11): the tiny example's prompts, a deterministic share of them marked as
carrying no reward signal, and a reward that is constant on those.

GRPO on GSM8K-like data gives a small model many prompts it answers all wrong (or all right): every completion of
such a group scores the same, so the group has no advantage to train on. Here every other prompt of the tiny
example is one (half the groups); the others keep the example's own dense reward.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_trainer.learner.rewards import letter_a_fraction

#: The dataset column that says whether a prompt's group can carry signal.
SIGNAL_COLUMN = "signal"
#: One prompt in this many has no signal, in the dataset's order.
NO_SIGNAL_EVERY = 2
#: What this module's reward is called in a run config (`rewards[].function`).
REWARD_FUNCTION = f"{__name__}:reward"


def reward(completions: Sequence[Any], signal: Sequence[bool] | None = None, **kwargs: Any) -> list[float]:
    """The tiny example's reward where the prompt has signal; 0 for every completion of a prompt without."""
    scores = letter_a_fraction(completions, **kwargs)
    if signal is None:
        return scores
    return [score if has_signal else 0.0 for score, has_signal in zip(scores, signal, strict=True)]


def write_prompts(source: Path, destination: Path) -> float:
    """`source`'s prompts with the signal column, into `destination`; the share of prompts without signal."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    for index, row in enumerate(rows):
        row[SIGNAL_COLUMN] = index % NO_SIGNAL_EVERY != 0
    destination.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return sum(not row[SIGNAL_COLUMN] for row in rows) / len(rows)
