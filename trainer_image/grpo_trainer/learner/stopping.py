"""How a GRPOLearner run stops: `RunStopping`, a mixin of `GRPOLearner`.

The stop micro-batch (the progress package's stream puts it in rank 0's stream; every rank sees it) is handled in
`get_batch_samples`, the same way on every rank, so the window it ends never backpropagates; the end at the epoch
bound is confirmed by rank 0 once every collated micro-batch has trained and broadcast to every rank; SIGTERM
(grpo_trainer.learner.preemption) asks for a stop at the next micro-batch, a checkpoint and the preempted exit; `train`
leaves the phase the run ended in (Succeeded, Stalled, Preempted or Failed).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from accelerate.utils import broadcast
from transformers.trainer_utils import SaveStrategy

from ..contract.codes import LearnerPhase, StallCause
from ..progress import STOP_KEY, RolloutPipelineError, StallError, StopCode, stop_from_batch
from ..rollout.weight_sync import FilesystemWeightTransfer
from ..rollout.worker import SupervisedRolloutWorker


class RunStopping:
    """The stop micro-batch, the end at the bound, preemption and the run's final phase. Reads what `GRPOLearner`
    sets up: `progress`, `exclusions`, `_collator`, `_train_stream`, `_training`, `phase`, `message`, `stall_cause`,
    and TRL's trainer state (`accelerator`, `control`, `args`, `weight_transfer`, `rollout_worker`)."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One gradient-accumulation window, fetched before any of it trains (transformers' seam,
        `transformers/trainer.py:2289 (transformers 5.24.0)`).

        The stop micro-batch is handled here, on every rank, so the window it ends never backpropagates: the
        micro-batches before it in the window are discarded (their groups go back to the unconsumed set, and a
        checkpoint leaves them out, except groups with rows in a window that stepped), and no optimizer step runs
        on an empty window. Stepping on zeroed gradients
        advanced the step counter, the LR schedule and a weight sync; stepping on a partial window's unreduced
        gradients made two gloo ranks diverge (parameter checksums 308.53 vs 311.73).
        """
        self._fold_settled_groups()
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        at = next((i for i, batch in enumerate(batch_samples) if STOP_KEY in batch), None)
        collated = self._collator.in_flight if self._collator is not None else None
        window = len(batch_samples) if at is None else at
        groups = [collated.popleft() for _ in range(window) if collated]
        self.window_groups = set().union(*groups)
        if at is None:
            # The window trains: its groups are trained for good, also where rows of theirs are in later windows.
            self.progress.stepped(self.window_groups)
            return batch_samples, num_items_in_batch
        self.window_groups = set()
        self.discarded_micro_batches += at
        self.progress.untrain(set().union(*groups))
        self._stop(*stop_from_batch(batch_samples[at]))
        return [], None

    def _fold_settled_groups(self) -> None:
        """Every window before this one reached its optimizer step; groups still only collated are not settled."""
        if self._collator is None or not self.accelerator.is_main_process:
            return
        pending = [min(ids) for ids in self._collator.in_flight if ids]
        settled = min(pending, default=self.progress.first_unconsumed)
        self.progress.fold(settled)
        self.exclusions.forget_below(min(settled, self.progress.first_unconsumed))

    def _stop(self, code: StopCode, streak: int, _limit: int) -> None:
        if code == StopCode.DONE:
            code, streak = self._confirm_end(streak)
        if code in (StopCode.DONE, StopCode.PREEMPTED):
            self.control.should_training_stop = True
            if self.args.save_strategy == SaveStrategy.STEPS:
                self.control.should_save = True
            if code == StopCode.PREEMPTED:
                stream_stop = self._stream_stop()
                self.phase = LearnerPhase.PREEMPTED
                self.message = stream_stop.error if stream_stop else "preempted: stopped by SIGTERM"
            return
        stream_stop = self._stream_stop()
        if code == StopCode.STALLED:
            message = stream_stop.error if stream_stop else f"stalled: {streak} groups in a row trained nothing"
            self.phase, self.message, self.stall_cause = LearnerPhase.STALLED, message, StallCause.STREAK
            raise StallError(message)
        message = stream_stop.error if stream_stop else "rank 0's rollout pipeline failed; see rank 0's log"
        self.phase, self.message = LearnerPhase.FAILED, message
        raise RolloutPipelineError(message) from (stream_stop.__cause__ if stream_stop else None)

    def _confirm_end(self, streak: int) -> tuple[StopCode, int]:
        """The stream's end at the bound, confirmed now that every micro-batch collated before it trained.

        The stream decided with the groups it had collated, counted as trained; the training step's scoring (rank
        0's `exclude`) may have taken out whole groups of the last micro-batches since. Rank 0 applies the stall
        rules again (`RolloutProgress.end_stop`) and every rank takes its verdict from one broadcast, at this same
        micro-batch: a pass excluded whole ends with the stall error, never as a success that trained nothing.
        """
        verdict = [int(StopCode.DONE), streak]
        if self.accelerator.is_main_process:
            stop = self.progress.end_stop()
            verdict = [int(stop.code), self.progress.stall_streak]
            if stop.code != StopCode.DONE and self._train_stream is not None:
                self._train_stream.stop = stop
        shared = broadcast(torch.tensor(verdict, dtype=torch.long, device=self.accelerator.device), from_process=0)
        code, streak = (int(v) for v in shared.tolist())
        return StopCode(code), streak

    def request_preemption(self) -> bool:
        """SIGTERM while training: stop at the next micro-batch on every rank, save, and end as preempted.

        Only rank 0's stream decides (it checks before every sample it reads); other ranks get the stop micro-batch.
        Returns False before `train()` (nothing to checkpoint yet): the caller then exits at once.
        """
        if not self._training:
            return False
        self.progress.request_stop("preempted: SIGTERM received; checkpoint saved for the restart")
        if isinstance(self.weight_transfer, FilesystemWeightTransfer):
            # A drain stops the rollout servers with the learner: a sync waiting on them would outlast the grace.
            self.weight_transfer.stop_waiting()
        if isinstance(self.rollout_worker, SupervisedRolloutWorker):
            self.rollout_worker.abandon_in_flight()
        return True

    def _stream_stop(self):
        """Rank 0's RolloutStop, with the full message and the original exception; None on other ranks."""
        return self._train_stream.stop if self._train_stream is not None else None

    def train(self, *args: Any, **kwargs: Any):
        self._training = True
        # What set-up built (model, tokenizer, libraries: ~476k objects with the tiny model) leaves the collector's
        # reach: every full collection during training walked it, 0.27 s each, about 5 per 300 1,200-token samples
        # in the input pipeline alone (bench section 1). Its cyclic garbage is collected first.
        gc.collect()
        gc.freeze()
        try:
            output = super().train(*args, **kwargs)
        except StallError:
            raise
        except Exception as error:
            if self.phase not in (LearnerPhase.STALLED, LearnerPhase.FAILED):
                self.phase, self.message = LearnerPhase.FAILED, f"{type(error).__name__}: {error}"
            raise
        finally:
            gc.unfreeze()
        if self.phase == LearnerPhase.PREEMPTED:
            return output
        self.phase = LearnerPhase.SUCCEEDED
        if not self.progress.all_consumed:
            # Only TRL's max_steps (the user's, or TRL's generous ceiling) ends a run short of its bound.
            self.message = (f"stopped at max_steps={self.args.max_steps} before the epoch bound "
                            f"({self.progress.groups_consumed}/{self.progress.groups_total} groups consumed)")
        return output
