"""The export alone, again: the model of a run's newest complete checkpoint written to its spec.output (and
uploaded to its object store) the way the learner exports at the end of a run, for a run whose export failed (a full
volume, wrong credentials, a missing bucket: the run fails, its checkpoints stay).

`python -m grpo_trainer export --config run.json` runs it where the learner ran (a pod with the run's ConfigMap and
volumes); `grporun export RUN_DIR` runs it for a `grporun local` run.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..contract.config import RunConfig
from ..contract.report import ExportReport
from .model_export import ExportError, export_model, input_provenance, package_versions, reward_trend

#: What a checkpoint holds besides the model: the trainer's and the run's state, which an export leaves out.
TRAINING_STATE = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state*.pth", "trainer_state.json",
                  "training_args.bin", "grpo_progress.json", "*.tmp")
#: A LoRA run's checkpoint holds the adapter alone (peft's files, `adapter_*`): the export merges it into the base.
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: An fsdp2 learner's checkpoint holds its model as accelerate's sharded save: torch.distributed.checkpoint files,
#: one per rank, and no config or tokenizer.
SHARDED_MODEL_FOLDER = "pytorch_model_fsdp_0"


def model_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's model files (weights, config, tokenizer, generation config): its top-level files less the
    training state."""
    return sorted(path for path in checkpoint.iterdir()
                  if path.is_file() and not any(fnmatch.fnmatch(path.name, pattern) for pattern in TRAINING_STATE))


def _provenance(config: RunConfig, checkpoint: Path, marker: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = {}
    step = marker.get("global_step", state.get("global_step", 0))
    step = step if isinstance(step, int) and not isinstance(step, bool) else 0
    history = state.get("log_history") if isinstance(state.get("log_history"), list) else []
    assert config.output is not None
    return {
        "run": {"name": config.run_name, "namespace": config.namespace},
        "spec": config.output.run_spec,
        **input_provenance(config.output.run_spec, config),
        "progress": {"globalStep": step, "rewardTrend": reward_trend(history), "checkpoint": checkpoint.name},
        "packages": package_versions(),
    }, step


def export_from_checkpoint(config: RunConfig, checkpoint: str | None = None) -> ExportReport:
    """Export the model of `checkpoint` (default: the newest complete one of config.checkpoint.directory, its
    marker verified) to config.output; ExportError naming the field or the path and the cause."""
    from ..contract.store_uri import is_object_store_uri
    from ..learner.checkpoint_store import CheckpointStore, resume_point
    from ..learner.checkpoints import MarkerError, UnusableCheckpoints, read_marker
    from .final_model import upload_export
    from .object_store import ObjectStoreError

    if config.output is None:
        raise ExportError("output: the run has no spec.output: there is nowhere to export the model to")
    where = config.checkpoint.directory if config.checkpoint.uri is None else (
        f"{config.checkpoint.directory} and checkpoint.uri {config.checkpoint.uri}")
    try:
        # With checkpoint.uri, a folder without a checkpoint (a new pod's) gets the store's newest, as a resume does.
        found = checkpoint or resume_point(config.checkpoint.directory, CheckpointStore.from_config(config.checkpoint))
        if found is None:
            raise ExportError(f"checkpoint.directory {where}: no complete checkpoint to export the model from")
        marker = read_marker(found)
    except (UnusableCheckpoints, MarkerError) as error:
        raise ExportError(f"{checkpoint or config.checkpoint.directory}: {error}") from None
    except (ObjectStoreError, ValueError) as error:
        raise ExportError(f"checkpoint.uri: the newest checkpoint could not be downloaded: {error}") from None
    path = Path(found)
    provenance, step = _provenance(config, path, marker)
    lora = (path / ADAPTER_CONFIG_FILE).exists()
    sharded = (path / SHARDED_MODEL_FOLDER).is_dir()

    def save(folder: Path) -> None:
        if sharded:
            save_consolidated(config, path, folder)
            return
        if lora:
            save_merged_adapter(config, path, folder)
            return
        for file in model_files(path):
            shutil.copy2(file, folder / file.name)

    exported = export_model(config.output.directory, save, provenance, uri=config.output.uri, step=step)
    if is_object_store_uri(config.output.uri):
        exported = upload_export(exported)
    return exported


def save_merged_adapter(config: RunConfig, checkpoint: Path, folder: Path) -> None:
    """A LoRA checkpoint holds the adapter alone: `folder` gets the run's base model (at its pinned commit) with the
    adapter merged in, the adapter itself in `folder/adapter`, and the checkpoint's tokenizer, as the learner's own
    export at the end of a run leaves them."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise ExportError(f"{checkpoint}: merging its LoRA adapter needs torch, transformers and peft, and "
                          f"{error.name} is not installed here") from None
    from ..learner.lora import FINAL_ADAPTER_FOLDER
    from .inputs import InputError, resolve

    try:
        model = resolve(config, dataset=False).model  # an s3:// model: through the inputs cache
        base = AutoModelForCausalLM.from_pretrained(model, revision=config.model_revision, dtype="auto")
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
    except (InputError, OSError, ValueError) as error:
        raise ExportError(f"{checkpoint}: its LoRA adapter could not be merged into {config.model}: {error}") from None
    merged.save_pretrained(folder)
    adapter = folder / FINAL_ADAPTER_FOLDER
    adapter.mkdir()
    for file in model_files(checkpoint):
        shutil.copy2(file, (adapter if file.name.startswith("adapter_") else folder) / file.name)


def save_consolidated(config: RunConfig, checkpoint: Path, folder: Path) -> None:
    """An fsdp2 checkpoint's model, every rank's shard gathered into one state dict here (without a process group),
    saved into the run's base model (at its pinned commit) as transformers saves it, with the base's tokenizer, as
    the learner's own export at the end of an fsdp2 run leaves it. A LoRA run's shards hold peft's model: its
    adapter is merged in, and saved beside the model in `folder/adapter`."""
    try:
        import torch
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ExportError(f"{checkpoint}: gathering its sharded model needs torch and transformers, and "
                          f"{error.name} is not installed here") from None
    from .inputs import InputError, resolve

    shards = checkpoint / SHARDED_MODEL_FOLDER
    with tempfile.TemporaryDirectory(prefix=".gather-", dir=folder) as scratch:
        whole = os.path.join(scratch, "model.pt")
        try:
            dcp_to_torch_save(str(shards), whole)
            state = torch.load(whole, weights_only=True)
        # torch's reader raises a missing shard as its CheckpointException, a BaseException.
        except (Exception, CheckpointException) as error:  # noqa: BLE001
            cause = str(error).strip().splitlines()[-1].strip('" ') if str(error).strip() else repr(error)
            raise ExportError(f"{shards}: the shards could not be gathered into one model: {cause}") from None
    state = state.get("model", state)  # accelerate saves the model's state dict under "model"
    dtype = next(iter(state.values())).dtype if state else None
    try:
        source = resolve(config, dataset=False).model  # an s3:// model: through the inputs cache
        model = AutoModelForCausalLM.from_pretrained(source, revision=config.model_revision, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=config.model_revision)
    except (InputError, OSError, ValueError) as error:
        raise ExportError(f"{checkpoint}: the run's model {config.model}, whose architecture takes the shards, could "
                          f"not be loaded: {error}") from None
    if any("lora_" in key for key in state):
        # A LoRA run's shards hold the adapter alone, as peft saves it (without the adapter's name in the keys).
        from peft import get_peft_model, set_peft_model_state_dict

        from ..learner.lora import FINAL_ADAPTER_FOLDER, peft_config

        if config.training.lora is None:
            raise ExportError(f"{shards} holds LoRA adapters, but the run config has no training.lora")
        model = get_peft_model(model, peft_config(config.training.lora))
        loaded = set_peft_model_state_dict(model, dict(state))
        missing = [key for key in loaded.missing_keys if "lora_" in key]
        _refuse_unlike(shards, missing, list(loaded.unexpected_keys))
        model.save_pretrained(folder / FINAL_ADAPTER_FOLDER)
        model = model.merge_and_unload()
    else:
        _load_whole(model, state, shards)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _load_whole(model: Any, state: Mapping[str, Any], shards: Path) -> None:
    """`state` into `model`, every parameter of it: a key the shards lack is allowed only for a parameter tied to one
    they hold (a tied output embedding is saved once)."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(parameters[key]) for key in state if key in parameters}
    _refuse_unlike(shards, [key for key in missing if key not in parameters or id(parameters[key]) not in loaded],
                   list(unexpected))


def _refuse_unlike(shards: Path, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ExportError(f"{shards} does not hold the run's model: "
                          + "; ".join(f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                                      for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys))


def write_export_message(text: str, path: str) -> None:
    """`text` as the pod's termination message (its last bytes within Kubernetes' limit); nothing where the path's
    folder does not exist (a workstation has no /dev/termination-log)."""
    from ..contract.codes import TERMINATION_MESSAGE_MAX_BYTES

    if os.path.isdir(os.path.dirname(path) or "."):
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            f.write(text[-TERMINATION_MESSAGE_MAX_BYTES:])


def store_environ(config: RunConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` with the endpoint and region the run's spec.output names (a pod has them as env already; a local
    run's config keeps them in the spec alone)."""
    from ..contract.store_uri import ENDPOINT_ENV, REGION_ENV

    output = (config.output.run_spec.get("output") or {}) if config.output is not None else {}
    env = dict(environ)
    if isinstance(output.get("endpoint"), str):
        env[ENDPOINT_ENV[0]] = output["endpoint"]
    if isinstance(output.get("region"), str):
        env[REGION_ENV[0]] = output["region"]
    return env
