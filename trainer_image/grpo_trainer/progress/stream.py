"""The end of the rollout stream: the stop micro-batch every rank sees, and the collator that counts groups."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

from .accounting import RolloutProgress, RolloutStop, StopCode

logger = logging.getLogger("grpo_trainer.progress")


class StopAwareDataset(torch.utils.data.IterableDataset):
    """A rollout batcher whose stream ends with the RolloutStop it raised.

    `check()` runs before each micro-batch. On RolloutStop, or any exception of the pipeline (rank 0 alone would
    raise it and strand the other ranks in the broadcast until ddp_timeout), one stop item is yielded, then the
    stream ends. Sticky: the Trainer re-iterates the loader per "epoch", and a new iterator stops again at once.

    The run's end (DONE) comes only at a gradient-accumulation boundary (`window` micro-batches): the window it
    would cut short is filled with the next pass's overflow, so every group the run counts reaches an optimizer step.
    Other stops come at once; the trainer discards the partial window (GRPOLearner.get_batch_samples).
    """

    def __init__(self, batcher: Iterable[Any], progress: RolloutProgress | None = None, *, window: int = 1):
        self.batcher = batcher
        self.progress = progress
        self.window = window
        self.stop: RolloutStop | None = None
        self.micro_batches = 0

    def __iter__(self) -> Iterator[Any]:
        if self.stop is not None:
            yield self.stop
            return
        iterator = iter(self.batcher)
        try:
            if self.progress is not None:
                self.progress.check()
            for micro_batch in iterator:
                self.micro_batches += 1
                yield micro_batch
                # Let go of it before the batcher builds the next one: held here, its hundreds of young objects
                # (TRL's packing tries) were alive while the next micro-batch allocated as many, which crossed the
                # collector's threshold inside every micro-batch (205 collections vs TRL's 11 on one stream).
                del micro_batch
                if self.progress is not None:
                    self.progress.check()
        except RolloutStop as stop:
            self.stop = stop
        except Exception as error:  # noqa: BLE001 - any pipeline failure must reach every rank as a stop
            self._stop_on_error(error)
        if self.stop is None:
            self.stop = RolloutStop("the rollout stream ended", code=StopCode.PIPELINE_ERROR)
        if self.stop.code == StopCode.DONE:
            yield from self._fill_window(iterator)
        yield self.stop

    def _stop_on_error(self, error: Exception) -> None:
        logger.exception("rollout pipeline failed on rank 0; stopping every rank")
        self.stop = RolloutStop(f"{type(error).__name__}: {error}", code=StopCode.PIPELINE_ERROR)
        self.stop.__cause__ = error

    def _fill_window(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # A stop raised inside the batcher ended its generator: the fill then reads the queue through a new one.
        for source in (iterator, iter(self.batcher)):
            try:
                while self.micro_batches % self.window:
                    micro_batch = next(source)
                    self.micro_batches += 1
                    yield micro_batch
                    del micro_batch  # as in __iter__
                return
            except StopIteration:
                continue
            except RolloutStop as stop:  # a SIGTERM while filling: stop now, the window is discarded
                self.stop = stop
                return
            except Exception as error:  # noqa: BLE001 - the window is discarded and the run fails: nothing is counted twice
                self._stop_on_error(error)
                return


# -------------------------------------------------------------------------------------------------------- collation
STOP_KEY = "rollout_stop"
#: Each rank's row of samples as group ids (-1 pads rows to one width): the training step's scoring reports by group.
SAMPLE_GROUP_KEY = "sample_group"


@dataclass
class ProgressCollator(DataCollatorForRollout):
    """TRL's collator, reporting trained groups and passing a stream stop on.

    Groups are reported at collate time, like TRL's own count (fine for the stop decision, which is FIFO); the
    micro-batches collated but not yet trained are kept in `in_flight` so a checkpoint can leave them out.
    """

    progress: RolloutProgress | None = None
    in_flight: deque = field(default_factory=deque)
    #: With trainer-side scoring (grpo_trainer.learner.step_scoring), rank 0's samples collated per group, which tells
    #: it when every collated sample of a group was scored.
    samples_collated: dict[int, int] | None = None

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (item,) = examples
        if isinstance(item, RolloutStop):
            # One row per rank; every leaf is a tensor so accelerate's dispatcher can slice and broadcast it.
            streak = self.progress.stall_streak if self.progress else 0
            limit = self.progress.stall_limit if self.progress else 0
            return {STOP_KEY: torch.tensor([[int(item.code), streak, limit]] * self.num_processes)}
        batch = super().torch_call(examples)
        rows = [torch.tensor([sample["group_id"] for sample in row.samples], dtype=torch.long) for row in item]
        batch[SAMPLE_GROUP_KEY] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
        if self.samples_collated is not None:
            for group_id in batch[SAMPLE_GROUP_KEY][batch[SAMPLE_GROUP_KEY] >= 0].tolist():
                self.samples_collated[group_id] = self.samples_collated.get(group_id, 0) + 1
        group_ids = frozenset({sample["group_id"] for row in item for sample in row.samples})
        self.in_flight.append(group_ids)
        if self.progress is not None:
            self.progress.train(group_ids)
            # TRL's collator has just logged this micro-batch's nan-aware mean reward into the metric sink. A reward
            # function may return inf: the report holds finite numbers only (the operator copies it into status).
            rewards = self.metrics.get("reward")
            if rewards and math.isfinite(rewards[-1]):
                self.progress.reward_mean = rewards[-1]
        return batch


def stop_from_batch(inputs: dict[str, Any]) -> tuple[StopCode, int, int] | None:
    """The stop a micro-batch carries, as every rank sees it after dispatch, or None for a normal micro-batch."""
    if STOP_KEY not in inputs:
        return None
    code, streak, limit = (int(v) for v in inputs[STOP_KEY].reshape(-1, 3)[0].tolist())
    return StopCode(code), streak, limit
