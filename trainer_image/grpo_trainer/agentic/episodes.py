"""Episodes: a group's conversations may each become several training rows, and the learner still counts groups.

With tools, TRL's worker renders a conversation again before every turn and reconciles the re-rendered tokens
with the ones it held; a rewrite it cannot reconcile (the template dropped an earlier turn's reasoning) starts a new
training row ("fork"), and a conversation with no trained token becomes none. A group is therefore not
`num_generations` rows. The rollout loop (grpo_trainer.rollout.worker.EpisodeRolloutLoop) stamps each row it puts on
the queue with its group's exact row count, and the group's first row with what its conversations did; the learner
reads both here, before anything else sees the samples:
- `group_rows(sample)`: how many rows make the sample's group whole (ScoringQueue scores a group when they all came;
  SampleFilterQueue gives a group up when they were all dropped);
- `EpisodeQueue`: counts the episodes on the group's first row into `EpisodeCounts` (/progress, metrics) and takes
  the stamps out of `sample.metrics`, which TRL's collator averages into its logged metrics.
A sample without the stamp (a worker that does not stamp) is one row of a `num_generations` group, as before.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

from ..contract.report import EpisodeReport

#: Every row: the number of rows its group became (a float, as TRL's metrics are).
GROUP_ROWS_KEY = "grpo/group_rows"
#: The group's first row only: a dict of what its conversations did (`GroupEpisodes.as_stamp`).
EPISODES_KEY = "grpo/episodes"
#: The rows of an episode whose environment failed (1.0): SampleFilterQueue regenerates a group that trains nothing
#: because of one (grpo_trainer.progress.filtering) instead of dropping it.
ENVIRONMENT_FAILED_KEY = "grpo/environment_failed"


def environment_failed(sample: Any) -> bool:
    """Whether the sample is a row of an episode whose environment failed."""
    return bool(sample.metrics.get(ENVIRONMENT_FAILED_KEY))


def group_rows(sample: Any, default: int) -> int:
    """How many rows the sample's group has, from its stamp; `default` (num_generations) without one."""
    value = sample.metrics.get(GROUP_ROWS_KEY)
    if isinstance(value, (int, float)) and math.isfinite(value) and value >= 1:
        return int(value)
    return default


class EpisodeCounts:
    """What the episodes that reached this learner process did. Thread-safe: /progress reads it while it counts.

    It also keeps the groups that arrived last in a row with every episode failed in an environment, and where they
    failed: a pass of them trains nothing and stalls the run, and the stall's message then names the environment
    (`failed_environments`), which the drops alone (`unscorable`) do not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._environment_failures: Counter[str] = Counter()
        self._failed_groups = 0  # the last groups to arrive, in a row, whose every episode failed
        self._failed_by_environment: Counter[str] = Counter()  # their episodes, by the environment they failed in

    def add(self, stamp: dict[str, Any]) -> None:
        failures = {str(k): int(v) for k, v in (stamp.get("environment_failures") or {}).items()}
        episodes = int(stamp.get("episodes", 0))
        with self._lock:
            for key in ("episodes", "rows", "turns", "tool_calls", "tool_failures", "forked"):
                self._totals[key] += int(stamp.get(key, 0))
            self._environment_failures.update(failures)
            if episodes > 0 and sum(failures.values()) >= episodes:
                self._failed_groups += 1
                self._failed_by_environment.update(failures)
            else:
                self._failed_groups = 0
                self._failed_by_environment.clear()

    def failed_environments(self, groups: int) -> str | None:
        """Where every episode of the last `groups` groups to arrive failed, when each of them failed whole (the
        environments, most failures first, with their episodes over that run of groups); else None."""
        with self._lock:
            if groups <= 0 or self._failed_groups < groups:
                return None
            where = ", ".join(f"{name} ({count} episode{'' if count == 1 else 's'})"
                              for name, count in self._failed_by_environment.most_common())
            plural = "s" if len(self._failed_by_environment) > 1 else ""
            return (f"every episode of the last {self._failed_groups} groups failed in environment{plural} {where}; "
                    "each failure's cause is in the learner's log")

    def report(self) -> EpisodeReport:
        with self._lock:
            return EpisodeReport(**self._totals, environment_failures=dict(self._environment_failures))


class EpisodeQueue:
    """TRL's rollout queue, with the episode stamps counted and taken out of each sample's metrics (rank 0).

    Duck-types the queue ScoringQueue and SampleFilterQueue read (`get(timeout)`, `get_nowait()`, `qsize()`). The
    group row count stays on the sample (`GROUP_ROWS_KEY`) for them; `strip_stamps` takes it out when the sample
    leaves the filter.
    """

    def __init__(self, inner: Any, counts: EpisodeCounts):
        self.inner = inner
        self.counts = counts

    def qsize(self) -> int:
        return self.inner.qsize()

    def get_nowait(self) -> Any:
        return self._count(self.inner.get_nowait())

    def get(self, timeout: float | None = None) -> Any:
        return self._count(self.inner.get(timeout=timeout))

    def _count(self, sample: Any) -> Any:
        stamp = sample.metrics.pop(EPISODES_KEY, None)
        if isinstance(stamp, dict):
            self.counts.add(stamp)
        return sample


def strip_stamps(sample: Any) -> Any:
    """The sample without the stamps, as TRL's collator must see it (it averages every metric key)."""
    sample.metrics.pop(GROUP_ROWS_KEY, None)
    sample.metrics.pop(EPISODES_KEY, None)
    sample.metrics.pop(ENVIRONMENT_FAILED_KEY, None)
    return sample


def completion_turns(completion: Any) -> int:
    """The model's turns in one conversation's completion (TRL's list of messages)."""
    if not isinstance(completion, list):
        return 1
    return sum(1 for message in completion if isinstance(message, dict) and message.get("role") == "assistant")


def stamp_group(samples: list[Any], rows_per_episode: list[int], *, turns: list[int], tool_calls: list[int],
                tool_failures: list[int], failed_environments: list[str | None]) -> None:
    """Stamp one scored group's rows (in order, `rows_per_episode[i]` of them for conversation i)."""
    if not samples:
        return  # no row at all: the group never reaches the learner (SampleFilterQueue gives it up as missing)
    for sample in samples:
        sample.metrics[GROUP_ROWS_KEY] = float(len(samples))
    samples[0].metrics[EPISODES_KEY] = {
        "episodes": len(rows_per_episode),
        "rows": len(samples),
        "turns": sum(turns),
        "tool_calls": sum(tool_calls),
        "tool_failures": sum(tool_failures),
        "forked": sum(1 for rows in rows_per_episode if rows > 1),
        "environment_failures": dict(Counter(label for label in failed_environments if label is not None)),
    }

