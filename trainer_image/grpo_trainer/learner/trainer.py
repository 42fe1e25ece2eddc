"""GRPOLearner: TRL 1.16's AsyncGRPOTrainer with progress accounting and a run that always ends.

Hooks (subclass only; TRL is not patched): the data pipeline is rebuilt with SampleFilterQueue, StopAwareDataset and
ProgressCollator; TRL's count-based `_EpochStopCallback` is removed (the stream now decides, and counts drops too);
checkpoints carry the consumed groups. See the progress package for the rules. Two mixins hold the rest: the loss with
the training step's scoring (grpo_trainer.learner.loss) and how a run stops, preemption included
(grpo_trainer.learner.stopping: `get_batch_samples` handles the stop micro-batch the same way on every rank).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from accelerate.utils import is_peft_model
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
    _EpochStopCallback,
    _iter_vllm_named_params,
    save_lora_adapter,
    validate_lora_for_vllm_sync,
)
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from ..agentic.availability import EnvironmentWatch, WatchedEnvironment
from ..agentic.episodes import EpisodeCounts, EpisodeQueue
from ..contract.codes import AttentionKernel, LearnerPhase, StallCause
from ..contract.config import WEIGHT_SYNC_DEADLINE_SECONDS, FilterConfig
from ..contract.report import CheckpointReport, ProgressReport, TrackedRunReport, TrackerLossReport
from ..progress import (
    AccountingError,
    ConsumedIds,
    ProgressCollator,
    ProgressState,
    RolloutPipelineError,
    RolloutProgress,
    SampleFilterQueue,
    SampleLimits,
    StallError,
    StopAwareDataset,
)
from ..rollout.sync_watchdog import SyncTimer, WeightSyncStuck
from ..rollout.wait import RolloutWaitMeter
from ..rollout.weight_sync import ADAPTER_NAME, FilesystemWeightTransfer, gathered_before_sending, gathered_parameters
from ..rollout.worker import SupervisedRolloutWorker
from .attention import AUTO, choose_kernel, install, probe_device
from .checkpoints import (
    PROGRESS_STATE_FILE,
    MarkerError,
    UnusableCheckpoints,
    read_marker,
    write_json_atomically,
    write_marker,
)
from .exporter import StepMetrics
from .loss import ScoredLoss
from .package_checks import cache_peft_check
from .scoring import RewardModel, ScoringQueue
from .step_scoring import ExclusionTracker, ImportanceBounds
from .stopping import RunStopping
from .tracking import progress_logs

if TYPE_CHECKING:
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from ..rollout.pool import RolloutPool
    from .checkpoint_store import CheckpointUploads

logger = logging.getLogger(__name__)

# TRL's own resume file: trl/experimental/async_grpo/async_grpo_trainer.py:1860-1901 (trl 1.16.0).
ROLLOUT_STATE_FILE = "rollout_state.json"
# TRL's worker posts a completion up to 3 times, each bounded by `request_timeout`
# (`trl/experimental/async_grpo/async_rollout_worker.py:1126 (trl 1.16.0)`).
LOST_AFTER_REQUEST_TIMEOUTS = 3


@dataclass(frozen=True)
class WeightSyncOptions:
    """How the learner's weights reach the rollout servers.

    deadline_s: a weight sync still running after this long ends the run as stalled (grpo_trainer.rollout.sync_watchdog;
        default: the spec's); None: no deadline.
    adapter: a LoRA run whose filesystem weight transfer syncs the adapter alone to every server (started with the
        flags it needs); merged weights where vLLM cannot serve the adapter. The same on every rank.
    """

    deadline_s: float | None = WEIGHT_SYNC_DEADLINE_SECONDS
    adapter: bool = False


class TrackedRuns(Protocol):
    """A TrainerCallback that knows the trackers' runs once they have started (grpo_trainer.learner.tracking)."""

    def tracked_runs(self) -> list[TrackedRunReport]: ...

    def degraded(self) -> list[str]: ...

    def lost(self) -> list[TrackerLossReport]: ...


@dataclass(frozen=True)
class LearnerReporting:
    """What the learner reports beyond its own figures, and where.

    server_port: serve /progress and /metrics on this port from rank 0 (None: no server; 0: any port).
    tracking: given the trainer's callbacks, the callback that names the trackers' runs on /progress
        (grpo_trainer.learner.tracking.parameters_callback). The learner adds it after transformers' tracker
        integrations, which it reads, so their runs have started when it looks. None: no trackers.
    rollout_pool: rank 0's rollout servers and their supervision (filesystem sync): TRL's worker routes its requests
        over them, their state goes on /progress; the learner owns the pool from then on and `close()` stops it.
    checkpoint_uploads: this process's uploads of each checkpoint to the object store (checkpoint.uri,
        grpo_trainer.learner.checkpoint_store), on every rank alike (each learner pod uploads the files only it
        holds); rank 0's newest one up goes on /progress. None: checkpoints stay in the checkpoint folder.
    model_digest: the content digest of the model as loaded (grpo_trainer.storage.inputs.loaded_digest), which the
        operator pins the run to; None for a hub model or a folder without an export manifest.
    environments: the run's environment servers, which rank 0 watches (grpo_trainer.agentic.availability): a wait
        for one with no ready server goes on /progress, and one unavailable past its bound ends the run as stalled.
    """

    server_port: int | None = None
    tracking: Callable[[list], TrackedRuns] | None = None
    rollout_pool: RolloutPool | None = None
    checkpoint_uploads: CheckpointUploads | None = None
    model_digest: str | None = None
    environments: tuple[WatchedEnvironment, ...] = ()


class GRPOLearner(ScoredLoss, RunStopping, AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose run ends at the epoch bound, or with StallError when a full pass trains nothing: TRL's
    trainer with the scored loss (`ScoredLoss`) and the run's stops (`RunStopping`); this class builds the pipeline,
    syncs the weights, reports and checkpoints.

    TRL's arguments, with `args` (its AsyncGRPOConfig) by keyword; extra keyword-only arguments:
        filter_config: which rollouts to drop before training (contract.config.FilterConfig).
        stall_groups: groups consumed in a row without one training before the run stalls; 0 = one pass.
        reward_models: rank 0's reward models (grpo_trainer.learner.scoring), scoring each group before batching.
        importance_bounds: masked importance sampling's sequence-ratio bounds (grpo_trainer.learner.step_scoring);
            samples with a non-finite loss or logprob leave the loss whatever they are.
        weight_sync: how the weights reach the servers (`WeightSyncOptions`: the sync's deadline, adapter or merged).
        attention_kernel: the tree-attention kernel (grpo_trainer.learner.attention); None: the rule's auto choice for
            this process's device.
        reporting: where /progress is served and what joins the report (`LearnerReporting`).

    A group missing for three of TRL's `request_timeout`s (while later groups arrived) is dropped as lost, as TRL
    posts a completion up to 3 times; a missing group whose samples would be stale is regenerated long before.
    """

    def __init__(
        self,
        *positional: Any,
        args: AsyncGRPOConfig | None = None,
        filter_config: FilterConfig | None = None,
        stall_groups: int = 0,
        reward_models: Sequence[RewardModel] = (),
        weight_sync: WeightSyncOptions | None = None,
        importance_bounds: ImportanceBounds | None = None,
        attention_kernel: AttentionKernel | None = None,
        reporting: LearnerReporting | None = None,
        **kwargs: Any,
    ):
        cache_peft_check()  # TRL asks accelerate whether the model is a peft model several times every weight sync
        on_cpu = args is not None and args.use_cpu
        if on_cpu:
            from .cpu import enable_cpu_support

            enable_cpu_support()
        if attention_kernel is None:
            choice = choose_kernel(AUTO, probe_device("cpu" if on_cpu else "cuda"))
            logger.info("tree attention: %s (%s)", choice.kernel.value, choice.reason)
            attention_kernel = choice.kernel
        install(attention_kernel)  # before TRL builds the model: its first forward asks for the kernel
        self.attention_kernel = attention_kernel
        # Tool calls and environments: /progress reports their episodes (grpo_trainer.agentic.episodes).
        self.uses_tools = bool(kwargs.get("tools")) or kwargs.get("environment_factory") is not None
        self.episodes = EpisodeCounts()
        super().__init__(*positional, args=args, **kwargs)
        reporting = reporting or LearnerReporting()
        self.checkpoint_uploads = reporting.checkpoint_uploads
        self.model_digest = reporting.model_digest
        self._rollout_pool = reporting.rollout_pool
        self._tracking: TrackedRuns | None = None
        if reporting.tracking is not None:
            self._tracking = reporting.tracking(self.callback_handler.callbacks)
            self.add_callback(self._tracking)
        weight_sync = weight_sync or WeightSyncOptions()
        if weight_sync.adapter:
            self._choose_adapter_sync()
        if type(self.rollout_worker) is AsyncRolloutWorker:
            # TRL builds its worker itself and offers no seam for the class; the subclass adds no state.
            self.rollout_worker.__class__ = SupervisedRolloutWorker
            if self._rollout_pool is not None:
                # Its child sends each generation request to a server of the pool itself (grpo_trainer.rollout.router).
                self.rollout_worker._loop_kwargs["routing"] = self._rollout_pool.routing()
        # The stream decides when the run ends (and counts drops, which this callback does not); `max_steps` stays
        # as TRL's safety ceiling.
        self.remove_callback(_EpochStopCallback)
        # TRL reads its consumed set with `in` and `len` only; this one folds the settled prefix of a long run.
        self._trained_groups = ConsumedIds()
        train_dataset = self.train_dataset
        groups_per_epoch = len(train_dataset) if hasattr(train_dataset, "__len__") else None
        self.filter_config = filter_config or FilterConfig()
        self.stall_groups = stall_groups
        self.progress = RolloutProgress(
            self._trained_groups,
            epochs_done=0,
            stall_groups=stall_groups,
            groups_per_epoch=groups_per_epoch,
            epochs=self.args.num_train_epochs if groups_per_epoch else None,
            stall_cause=self.episodes.failed_environments,
        )
        self.lost_after_s = LOST_AFTER_REQUEST_TIMEOUTS * self.args.request_timeout
        self.reward_models = list(reward_models)
        self.scoring: ScoringQueue | None = None
        self.phase = LearnerPhase.STARTING
        self.message = ""
        # A stall outside the progress rules (a weight sync past its deadline); theirs is on progress's report.
        self.stall_cause: StallCause | None = None
        self.importance_bounds = importance_bounds or ImportanceBounds()
        self.exclusions = ExclusionTracker({})  # rank 0: fed by the collator and every rank's verdicts
        self.sync_timer = SyncTimer(weight_sync.deadline_s, thread_setup=self._select_device,
                                    waiting_on=self._sync_waiting_on)
        self._collator: ProgressCollator | None = None
        self._train_stream: StopAwareDataset | None = None
        self._training = False
        self.discarded_micro_batches = 0  # fetched in the window a stop cut short: never trained
        self.window_groups: set[int] = set()  # rank 0: the groups of the window now training (worker ids)
        self.rollout_wait: RolloutWaitMeter | None = None  # rank 0, once the pipeline is built
        self._progress_server = None
        self._environment_watch: EnvironmentWatch | None = None
        if reporting.environments and self.accelerator.is_main_process:
            # From now: the first episodes may wait for servers that are not ready yet, and /progress says so.
            self._environment_watch = EnvironmentWatch(
                list(reporting.environments), on_expired=lambda message: self.progress.stop_unavailable(message))
            self._environment_watch.start()
        self.step_metrics = StepMetrics()  # TRL's logged step curves, for /metrics
        if reporting.server_port is not None and self.accelerator.is_main_process:
            from .exporter import ProgressServer

            self._progress_server = ProgressServer(self.progress_report, port=reporting.server_port,
                                                   step_metrics=self.step_metrics).start()
            logger.info(f"progress: {self._progress_server.url}/progress and /metrics")

    # ------------------------------------------------------------------------------------------------ adapter sync
    def _choose_adapter_sync(self) -> None:
        """Sync the adapter alone through our transfer, to every server.

        TRL turns adapter sync on only when it builds its own transfer, from the server's `/server_info` (which
        vLLM 0.32 answers 500 where its environment has no pip: it lists pip's packages), and its adapter sync
        reaches the one server its client talks to. Here the servers are started from the same spec, with
        `--enable-lora`, the rank and the slots the adapter needs (rollout.lora_server_flags); an adapter vLLM
        cannot serve (TRL's `validate_lora_for_vllm_sync`) is synced merged instead. The decision depends on the
        spec and the model alone, so every rank takes the same one. The rollout worker then names `policy-vN`.
        """
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            return
        try:
            validate_lora_for_vllm_sync(model)
        except ValueError as error:
            logger.warning("weight sync: merged weights, as the adapter cannot be served alone: %s", error)
            return
        self._lora_sync = True
        self._lora_name = ADAPTER_NAME
        loop_kwargs = getattr(self.rollout_worker, "_loop_kwargs", None)
        if loop_kwargs is not None:
            loop_kwargs["lora_name"] = ADAPTER_NAME
        logger.info("weight sync: the adapter alone, loaded on every rollout server as %s-vN", ADAPTER_NAME)

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """TRL's adapter sync (its dispatch and timings), through our transfer: the adapter is saved into the next
        version directory (TRL's collective save, published by a rename) and loaded on every server in the pool.
        The version continues the transfer's count, so a restarted learner never reuses a name a server holds."""
        model = self.accelerator.unwrap_model(self.model)
        transfer = self.weight_transfer if self.accelerator.is_main_process else None
        if transfer is not None:
            transfer.version = max(transfer.version, self.model_version)
            transfer.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        # Every rank saves: gathering a sharded adapter is a collective; only rank 0 writes (the path is its).
        save_lora_adapter(model, self.accelerator, self._adapter_name,
                          str(transfer.adapter_directory()) if transfer is not None else "")
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        if transfer is not None:
            # Loaded before the version moves: the worker names the adapter after `model_version`.
            transfer.publish_adapter()
            transfer.resume()
            transfer.retire_stale_adapter()
            self.model_version = transfer.version
            if self.rollout_worker is not None:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer

    # ------------------------------------------------------------------------------------------------ observability
    def progress_report(self) -> ProgressReport:
        timer = self.sync_timer
        report = self.progress.report(
            phase=self.phase, global_step=self.state.global_step, weight_syncs=timer.syncs, message=self.message
        ).model_copy(update={
            "weight_sync_seconds": timer.total_s, "weight_sync_last_seconds": timer.last_s,
            "weight_sync_running_seconds": timer.running_s, "weight_sync_deadline_seconds": timer.deadline_s,
            "weight_version": self.model_version,
            "samples_scored": self.exclusions.samples_scored, "samples_masked": dict(self.exclusions.samples_masked),
            "attention_kernel": self.attention_kernel,
            "episodes": self.episodes.report() if self.uses_tools else None,
            "model_digest": self.model_digest,
            "environment_wait": self._environment_watch.waiting() if self._environment_watch is not None else None,
        })
        if self.stall_cause is not None:
            report = report.model_copy(update={"stalled": True, "stall_cause": self.stall_cause})
        if self.rollout_wait is not None:
            report = report.model_copy(update={"rollout_wait_seconds": self.rollout_wait.seconds,
                                               "rollout_queue_samples": self.rollout_wait.qsize()})
        if self._tracking is not None:
            report = report.model_copy(update={"tracking": self._tracking.tracked_runs(),
                                               "tracking_degraded": self._tracking.degraded(),
                                               "tracking_lost": self._tracking.lost()})
        if self._rollout_pool is not None:
            report = report.model_copy(update={"rollout": self._rollout_pool.report()})
        stored = self.checkpoint_uploads.last if self.checkpoint_uploads is not None else None
        if stored is not None:
            report = report.model_copy(update={"checkpoint": CheckpointReport(step=stored.step, uri=stored.uri,
                                                                             time=stored.time)})
        return report

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log (its step metrics join `logs`), with our progress numbers beside them for the trackers; what
        was logged then feeds /metrics' step curves."""
        if self.accelerator.is_main_process:
            try:
                logs.update(progress_logs(self.progress_report()))
            except AccountingError:
                pass  # the run's end reports the broken accounting; a log line must not end the run
        super().log(logs, start_time)
        self.step_metrics.record(logs)

    @property
    def progress_url(self) -> str | None:
        return self._progress_server.url if self._progress_server else None

    def _sync_weight(self) -> None:
        try:
            self.sync_timer.run(super()._sync_weight)
        except WeightSyncStuck as stuck:
            self.phase, self.message, self.stall_cause = LearnerPhase.STALLED, str(stuck), StallCause.WEIGHT_SYNC
            logger.error(str(stuck))
            # TRL destroys the transfer when training ends; a transfer stuck mid-call would wait on the same peer.
            self.weight_transfer = None
            raise
        self._follow_served_version()

    def _streaming_iter(self):
        """The weights the sync sends, each parameter gathered whole before it is handed on (every rank walks it;
        rank 0 sends). TRL's own (`async_grpo_trainer.py:1723 (trl 1.16.0)`) hands the sender lazy `full_tensor()`
        gathers, which its NCCL client runs on its own thread between broadcasts to vLLM.

        A sender that consumes on the caller's thread (the filesystem sync) takes each parameter as it is gathered;
        TRL's NCCL client, which consumes on a thread of its own, gets them once all are gathered on rank 0 (with
        more than one rank: a single rank has no collective to order).
        """
        named = _iter_vllm_named_params(self.accelerator.unwrap_model(self.model))
        device = self.accelerator.device
        transfer = self.weight_transfer
        if (self.accelerator.is_main_process and self.accelerator.num_processes > 1 and transfer is not None
                and not isinstance(transfer, FilesystemWeightTransfer)):
            return gathered_before_sending(named, device)
        return gathered_parameters(named, device)

    def _sync_waiting_on(self) -> str:
        """For a stalled sync's message: the server and step it waits on where this rank can see them."""
        transfer = self.weight_transfer
        if isinstance(transfer, FilesystemWeightTransfer):
            return transfer.waiting_on()
        if not self.accelerator.is_main_process:
            return "this rank waits for rank 0 in the sync (rank 0's message names the server)"
        return (f"TRL's weight transfer to {self.args.vllm_server_base_url} did not return; the learner log has the "
                "step it was in (pause, transfer, resume)")

    def _select_device(self) -> None:
        """The sync's thread trains nothing, but its collectives and copies must use this rank's device."""
        device = self.accelerator.device
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def _follow_served_version(self) -> None:
        """Raise TRL's `model_version` to the version the servers now serve, when the weight transfer counts one.

        The filesystem sync keeps counting from the newest version directory across a learner restart, while the
        checkpoint's `model_version` is older by the syncs made after that checkpoint: without this the learner
        stamped samples v6 while the servers served v7. Never lowers it (TRL's LoRA path does not use the transfer).
        """
        served = getattr(self.weight_transfer, "version", None)
        if not self.accelerator.is_main_process or not isinstance(served, int) or served <= self.model_version:
            return
        self.model_version = served
        if self.rollout_worker is not None:
            self.rollout_worker.update_model_version(served)

    # ------------------------------------------------------------------------------------------------ pipeline
    def get_train_dataloader(self) -> DataLoader:
        """TRL's pipeline with the three wrappers; TRL offers no seam, so it is rebuilt here.

        TRL's own: `trl/experimental/async_grpo/async_grpo_trainer.py:1419-1473 (trl 1.16.0)`.
        """
        num_processes = self.accelerator.num_processes
        main = self.accelerator.is_main_process
        if main:
            if self.args.token_budget is None:
                self.vllm_client.wait_for_server_ready()
                self.args.token_budget = self.vllm_client.get_max_model_len()
                logger.info(f"token_budget unset; defaulting to vLLM max_model_len={self.args.token_budget}")
            source = SampleFilterQueue(
                self._scored_rollout_queue(),
                self.progress,
                model_version_fn=lambda: self.model_version,
                limits=SampleLimits(max_staleness=self.args.max_staleness,
                                    num_generations=self.args.num_generations,
                                    token_budget=max(self.args.token_budget, 0)),
                filter_config=self.filter_config,
                end_token_ids={*self.eos_token_ids, self.processing_class.pad_token_id},
                lost_after_s=self.lost_after_s,
            )
            # One meter per process, whatever rebuilds the pipeline: its counter never goes back to 0.
            if self.rollout_wait is None:
                self.rollout_wait = RolloutWaitMeter(source)
            self.rollout_wait.inner = source
            dataset = RolloutQueueDataset(
                rollout_queue=self.rollout_wait,
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = dataset
            if self.args.token_budget > 0:
                batcher = TokenBudgetBatcher(dataset, num_processes, self.args.token_budget, self._metrics["train"])
            else:
                rows = self.args.per_device_train_batch_size * num_processes
                batcher = FixedCountBatcher(dataset, num_processes, rows)
            stream = StopAwareDataset(batcher, self.progress, window=self.args.gradient_accumulation_steps)
            self._train_stream = stream
        else:
            stream = _EmptyIterableDataset()
        self._collator = ProgressCollator(
            self.processing_class.pad_token_id,
            num_processes,
            groups_trained=set(),  # throw-away: `progress.train` fills TRL's consumed set, drops included
            metrics=self._metrics["train"],
            token_budget=max(self.args.token_budget or 0, 0),
            progress=self.progress if main else None,
            samples_collated=self.exclusions.samples_collated if main else None,
        )
        if main and self.phase == LearnerPhase.STARTING:
            self.phase = LearnerPhase.RUNNING
        return self.accelerator.prepare(DataLoader(stream, batch_size=1, collate_fn=self._collator, num_workers=0))

    def _scored_rollout_queue(self) -> Any:
        """TRL's rollout queue, its episodes counted, with the reward models' scores when there are any (rank 0)."""
        episodes = EpisodeQueue(self.rollout_queue, self.episodes)
        if not self.reward_models:
            return episodes
        self.scoring = ScoringQueue(
            episodes,
            self.reward_models,
            num_generations=self.args.num_generations,
            # Looked up at each drop: a resume replaces self.progress (_inner_training_loop).
            drop=lambda group_id, reason: self.progress.drop(group_id, reason),
            drop_no_signal=self.filter_config.drop_no_signal,
            no_signal_epsilon=self.filter_config.no_signal_epsilon,
            metrics=self._metrics["train"],
        )
        return self.scoring

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        checkpoint_dir = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        marker = os.path.join(checkpoint_dir, PROGRESS_STATE_FILE)
        if self.checkpoint_uploads is not None and os.path.isdir(checkpoint_dir):
            self.checkpoint_uploads.wait()  # its upload reads the files about to be rewritten
        if self.accelerator.is_main_process and os.path.exists(marker):
            # Saving again at the same step (the end-of-run or preemption save after a step save) rewrites the
            # directory in place: without its marker until done, a kill meanwhile leaves it skipped, not torn.
            os.remove(marker)
        super()._save_checkpoint(model, trial)
        # Every rank writes its own files (its RNG state): the marker vouches for them all.
        self.accelerator.wait_for_everyone()
        if self.checkpoint_uploads is not None:
            from .checkpoint_store import Share, machine_shares  # boto3's import, only for a run with a store
        machine, peers = None, {}
        if self.checkpoint_uploads is not None and self.accelerator.num_processes > 1:
            # Each machine's folder may hold files only it has (its ranks' shards): every machine uploads its own.
            machine, peers = machine_shares(checkpoint_dir, self.accelerator.is_local_main_process)
        if not self.accelerator.is_main_process:
            if machine:
                self.checkpoint_uploads.submit(Share(checkpoint_dir, machine, peers[machine]))
            return
        os.makedirs(checkpoint_dir, exist_ok=True)
        # Collated is not trained: groups only in micro-batches not yet through an optimizer step are left out, so a
        # resumed run generates them again instead of losing them (a group with rows in a window that stepped is
        # kept: RolloutProgress.stepped).
        in_flight = set().union(*self._collator.in_flight) if self._collator else set()
        progress_state = self.progress.checkpoint_state(exclude=in_flight)
        state = {**progress_state.to_dict(), "model_version": self.model_version,
                 "global_step": self.state.global_step}
        # TRL's prompt_index counts only from its own set; write the position resume really starts from, so TRL's
        # resume path (AsyncRolloutWorker) agrees with ours.
        start = progress_state.first_unconsumed
        write_json_atomically(os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE),
                              {"prompt_index": start, "model_version": self.model_version})
        # Written last, and atomically: it marks the checkpoint complete and vouches for its files (checkpoints.py).
        vouched = write_marker(checkpoint_dir, state)
        if self.checkpoint_uploads is not None:
            # In the background: training goes on.
            self.checkpoint_uploads.submit(Share.committing(checkpoint_dir, vouched, peers))

    def _inner_training_loop(self, *args: Any, **kwargs: Any):
        checkpoint = kwargs.get("resume_from_checkpoint")
        state_file = os.path.join(checkpoint, PROGRESS_STATE_FILE) if checkpoint else None
        if state_file and os.path.isfile(state_file):
            try:
                state = read_marker(checkpoint)
            except MarkerError as error:
                raise UnusableCheckpoints(f"cannot resume from {checkpoint}: {state_file} {error}") from None
            self.progress = RolloutProgress.restore(
                ProgressState.from_dict(state),
                self._trained_groups,
                stall_groups=self.stall_groups,
                groups_per_epoch=self.progress.groups_per_epoch,
                epochs=self.progress.epochs,
                stall_cause=self.episodes.failed_environments,
            )
            start = self.progress.start_group
            self._groups_before_resume = start
            if self.accelerator.is_main_process and self.rollout_worker is not None:
                # TRL repositions only its own AsyncRolloutWorker (and does so again from rollout_state.json, which
                # we wrote to agree); any worker with the same `_loop_kwargs` is repositioned here.
                loop_kwargs = getattr(self.rollout_worker, "_loop_kwargs", None)
                if loop_kwargs is not None:
                    loop_kwargs["dataset_start_index"] = start
                self.model_version = state.get("model_version", 0)
                self.rollout_worker.update_model_version(self.model_version)
            logger.info(f"resumed: restarting at group {start}, {len(state['consumed_after'])} consumed beyond it")
        return super()._inner_training_loop(*args, **kwargs)

    def close(self) -> None:
        """Stop the progress server, the environments' watch and the rollout pool; the report still names the pool's
        servers after."""
        if self._environment_watch is not None:
            self._environment_watch.stop()
        if self._progress_server is not None:
            self._progress_server.stop()
            self._progress_server = None
        if self._rollout_pool is not None:
            self._rollout_pool.stop()


__all__ = ["GRPOLearner", "LearnerReporting", "RolloutPipelineError", "StallError"]
