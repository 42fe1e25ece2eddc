"""The trained model at the end of a run: saved as a transformers model (an FSDP2 model gathered, a LoRA adapter merged
into its base), written to `spec.output` whole or not at all with its provenance manifest
(grpo_trainer.storage.model_export), and uploaded when the output is an object store's (the manifest last).
`grpo_trainer.storage.reexport` uploads an export again the same way."""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from pathlib import Path

from ..contract.config import RunConfig
from ..contract.report import ExportReport
from ..contract.store_uri import is_object_store_uri
from ..learner.lora import FINAL_ADAPTER_FOLDER, save_adapter_and_merged

logger = logging.getLogger(__name__)

#: How often the learner's main thread, waiting for the upload, looks at whether a SIGTERM asked it to stop.
UPLOAD_STOP_POLL_S = 0.2


class UploadInterrupted(Exception):
    """A SIGTERM arrived while the model was uploading: the upload did not finish, the local export is kept."""


def save_final_model(learner, directory: str) -> None:
    """The trained policy in `directory` as a transformers model (what vLLM and `from_pretrained` load). A LoRA run
    saves its adapter (peft) in `directory/adapter` and, in `directory`, the base weights with the adapter merged in."""
    from accelerate.utils import is_peft_model

    model = learner.accelerator.unwrap_model(learner.model)
    if learner.accelerator.is_fsdp2:
        # The trainer's own save writes an FSDP2 model as each rank's shard (SHARDED_STATE_DICT): not a model
        # vLLM or from_pretrained loads.
        save_sharded_model(model, learner.processing_class, directory, is_main=learner.accelerator.is_main_process)
        learner.accelerator.wait_for_everyone()
        return
    if not is_peft_model(model):
        learner.save_model(directory)
        return
    save_adapter_and_merged(learner, model, directory)


def save_sharded_model(model, tokenizer, directory: str, *, is_main: bool) -> None:
    """An FSDP2 model consolidated into `directory` as a transformers model (safetensors): every rank takes part in
    gathering each parameter, rank 0 alone holds the whole state dict, in CPU memory, and writes it. A LoRA model's
    adapter goes to `directory/adapter` and its merge into the base weights to `directory`, as without FSDP2."""
    from accelerate.utils import is_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    if is_peft_model(model):
        save_merged_adapter_state(model, state, directory)
    else:
        model.save_pretrained(directory, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def save_merged_adapter_state(model, state: dict, directory: str) -> None:
    """A LoRA model's whole state (`state`, gathered from its FSDP2 shards) saved as its adapter and merged model.

    The sharded model itself cannot merge (its base weights are shards); an unsharded copy of its structure is built
    on the meta device and takes `state`'s tensors as its own (no second copy of the weights), then peft saves the
    adapter and merges it in place, as for an unsharded run."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    adapter_name = model.active_adapter
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model.get_base_model().config)
        whole = get_peft_model(base, model.peft_config[adapter_name], adapter_name=adapter_name)
    whole.load_state_dict(state, strict=True, assign=True)
    whole.get_base_model().tie_weights()
    whole.save_pretrained(os.path.join(directory, FINAL_ADAPTER_FOLDER))
    whole.merge_and_unload().save_pretrained(directory)


def with_current_images(config: RunConfig, config_path: str | None) -> RunConfig:
    """`config` with the `images` its file holds now: the operator records the pods' image digests in the mounted run
    config after the learner started. The images read at the start when the file cannot be read or parsed."""
    from pydantic import ValidationError

    from ..contract.config import load_run_config

    if config_path is None:
        return config
    try:
        images = load_run_config(Path(config_path).read_text(encoding="utf-8")).images
    except (OSError, UnicodeDecodeError, ValidationError) as error:
        logger.warning("run config %s: cannot read the pods' images again (%s); the manifest names those read at "
                       "the start", config_path, error)
        return config
    return config.model_copy(update={"images": images})


def export_trained_model(config: RunConfig, learner, stop: threading.Event) -> ExportReport | None:
    """Write the trained model to `config.output` with its manifest (grpo_trainer.storage.model_export), then upload it
    when its URI is an object store's (grpo_trainer.storage.object_store, the manifest last); rank 0's report, None on
    the other ranks. Every rank calls the trainer's save (a sharded model gathers its weights); rank 0 writes and
    uploads, until `stop` is set (`upload_export`)."""
    from ..learner.tracking import record_export
    from .model_export import export_model, input_provenance, package_versions, reward_trend, staging_path

    assert config.output is not None
    directory = Path(config.output.directory)
    if not learner.accelerator.is_main_process:
        save_final_model(learner, str(staging_path(directory)))
        return None

    def save(folder: Path) -> None:
        save_final_model(learner, str(folder))
        # Sampling defaults travel with the model: vLLM and `generate` read them from generation_config.json.
        generation_config = getattr(learner.accelerator.unwrap_model(learner.model), "generation_config", None)
        if generation_config is not None and not (folder / "generation_config.json").exists():
            generation_config.save_pretrained(folder)

    report = learner.progress_report()
    # The datasets library's hash of how the rows were made (files, revision, every transform): what was read.
    fingerprint = getattr(getattr(learner, "train_dataset", None), "_fingerprint", None)
    provenance = {
        "run": {"name": config.run_name, "namespace": config.namespace},
        "spec": config.output.run_spec,
        **input_provenance(config.output.run_spec, config, fingerprint if isinstance(fingerprint, str) else None),
        "progress": {
            "groupsTotal": report.groups_total, "groupsConsumed": report.groups_consumed,
            "groupsTrained": report.groups_trained, "groupsDropped": report.dropped_total,
            "dropped": dict(report.dropped), "epochsDone": report.epochs_done, "epochs": report.epochs,
            "globalStep": report.global_step, "rewardMean": report.reward_mean,
            "rewardTrend": reward_trend(learner.state.log_history),
        },
        "tracking": [run.model_dump(by_alias=True) for run in report.tracking],
        "images": config.images,
        "packages": package_versions(),
    }
    exported = export_model(directory, save, provenance, uri=config.output.uri, step=report.global_step)
    if is_object_store_uri(config.output.uri):
        exported = upload_export(exported, stop)
    record_export(config, report, exported)
    logger.info("model exported to %s (%s): step %d, %d bytes, manifest sha256 %s", exported.path, exported.uri,
                exported.step, exported.bytes, exported.sha256)
    return exported


def upload_export(exported: ExportReport, stop: threading.Event | None = None) -> ExportReport:
    """The export at `exported.path` uploaded to `exported.uri` with its own manifest, written last; ExportError
    naming the location and the cause (credentials, a missing bucket, an endpoint that does not answer).

    Once `stop` is set (the pod's SIGTERM), UploadInterrupted at once. boto3 cannot be cancelled (its requests wait up
    to 60 s, 3 times, on a store that does not answer), so the upload runs on a daemon thread that is left to end with
    the process; the store's old manifest is gone by then, so its prefix reads as absent, never as a half model."""
    from ..contract.store_uri import parse_uri
    from ..rollout.sync_watchdog import DaemonCall
    from .model_export import ExportError
    from .object_store import ObjectStoreError, upload_folder

    upload = DaemonCall(partial(upload_folder, exported.path, parse_uri(exported.uri, "output.uri")),
                        "grpo-model-upload")
    while not upload.join(UPLOAD_STOP_POLL_S):
        if stop is not None and stop.is_set():
            raise UploadInterrupted(f"the upload of the model to {exported.uri} did not finish: SIGTERM arrived "
                                    f"during it; the exported model is kept at {exported.path}")
    try:
        uploaded = upload.result()
    except ObjectStoreError as error:  # its message names the location
        raise ExportError(f"could not upload the model: {error}") from None
    # The folder's own manifest goes up verbatim: the digest and size are those of the objects in the store.
    return exported.model_copy(update={"sha256": uploaded.sha256, "bytes": uploaded.bytes})
