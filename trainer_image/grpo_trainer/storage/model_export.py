"""The trained model, exported whole or not at all: Hugging Face files plus a manifest of where they came from.

At the end of a run the learner writes the model (safetensors, config, tokenizer, generation config) into a staging
folder beside its destination, on the same volume, adds a model card (README.md, with Hugging Face front matter) and,
last, the manifest (`contract.codes.EXPORT_MANIFEST_FILE`): the GRPORun spec, the base model and its commit, the
dataset and its digest, the final progress, the trackers' runs, the package versions and every file's size and
sha256. Everything is fsynced, then the staging folder is renamed into place in one step. A reader thus sees no folder,
the previous complete one, or the new complete one; an export killed halfway leaves only a hidden `.NAME.partial`
folder without a manifest, which the next export removes.

Torch-free: the caller passes the function that writes the model files (`save`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from ..contract.codes import EXPORT_MANIFEST_FILE
from ..contract.config import RunConfig
from ..contract.report import ExportReport
from ..contract.store_uri import is_hub_id

MODEL_CARD_FILE = "README.md"
MANIFEST_KIND = "GRPOModelExport"
MANIFEST_VERSION = 1
#: Packages whose versions the manifest records (those not installed are left out: vLLM is not in a CPU learner).
PROVENANCE_PACKAGES = ("grpo-operator", "torch", "transformers", "trl", "accelerate", "safetensors", "vllm")
#: Points of the reward trend kept in the manifest: enough to see its shape, few enough to read.
REWARD_TREND_POINTS = 20
#: The model card's tags: what a hub search for GRPO-trained models finds.
MODEL_CARD_TAGS = ("grpo", "trl", "grpo-operator")


class ExportError(Exception):
    """The model could not be exported: one line naming the path and the cause (no space, no permission)."""


def staging_path(directory: Path) -> Path:
    """Where an export of `directory` is written before it is renamed into place (hidden, same volume)."""
    return directory.parent / f".{directory.name}.partial"


def _replaced_path(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.replaced"


def package_versions(names: Iterable[str] = PROVENANCE_PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def reward_trend(log_history: Iterable[Mapping[str, Any]], points: int = REWARD_TREND_POINTS) -> list[dict[str, Any]]:
    """`[{step, reward}]` from the trainer's log history (its `reward` entries), thinned to at most `points`, the
    first and the last always kept."""
    trend = []
    for entry in log_history:
        reward, step = entry.get("reward"), entry.get("step")
        if isinstance(reward, int | float) and isinstance(step, int) and math.isfinite(reward):
            trend.append({"step": step, "reward": float(reward)})
    if len(trend) <= points:
        return trend
    last = len(trend) - 1
    picks = sorted({round(index * last / (points - 1)) for index in range(points)})
    return [trend[index] for index in picks]


def sha256_of(path: str | os.PathLike[str]) -> str:
    """A file's sha256, hex (a checkpoint's files, an export's, a download's)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_digests(folder: Path) -> list[dict[str, Any]]:
    """Every file under `folder` but the manifest (sorted, relative POSIX paths) with its size and sha256: what a
    manifest lists."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative != EXPORT_MANIFEST_FILE:
            files.append({"path": relative, "bytes": path.stat().st_size, "sha256": sha256_of(path)})
    return files


def input_provenance(spec: Mapping[str, Any], config: RunConfig,
                     dataset_fingerprint: str | None = None) -> dict[str, Any]:
    """Where the model started and what it trained on, named as the GRPORun `spec` names them, with what pins each:
    the hub commit every process loaded (`config` holds the pins), a dataset file's sha256, and the datasets
    library's fingerprint of the rows the learner read."""
    base: dict[str, Any] = {"model": spec.get("model") if isinstance(spec.get("model"), str) else config.model}
    if config.model_revision is not None:
        base["revision"] = config.model_revision
    named = spec.get("dataset") if isinstance(spec.get("dataset"), Mapping) else {}
    dataset: dict[str, Any] = {key: named[key] for key in ("name", "path", "config", "split")
                               if isinstance(named.get(key), str)}
    if not dataset:
        dataset = {"name": config.dataset.name} if config.dataset.name else {"path": config.dataset.path}
    if config.dataset.revision is not None:
        dataset["revision"] = config.dataset.revision
    if config.dataset.path is not None and Path(config.dataset.path).is_file():  # a downloaded s3:// file too
        dataset["sha256"] = sha256_of(config.dataset.path)
    if dataset_fingerprint:
        dataset["fingerprint"] = dataset_fingerprint
    return {"base": base, "dataset": dataset}


def model_card(provenance: Mapping[str, Any], step: int) -> str:
    """The export's README.md: Hugging Face front matter (what the hub and model registries index) and a summary."""
    from huggingface_hub import ModelCardData

    run = provenance.get("run", {})
    spec = provenance.get("spec", {})
    progress = provenance.get("progress", {})
    base = provenance.get("base", {})
    dataset = provenance.get("dataset", {})
    trend = progress.get("rewardTrend") or []
    rewards = ", ".join(str(reward.get("name") or reward.get("function") or reward.get("model"))
                        for reward in spec.get("rewards", []))
    hub_model = base.get("model") if is_hub_id(str(base.get("model", "/"))) else None
    front_matter = ModelCardData(
        base_model=hub_model, base_model_relation="finetune" if hub_model else None,
        datasets=[dataset["name"]] if dataset.get("name") else None, library_name="transformers",
        pipeline_tag="text-generation", tags=list(MODEL_CARD_TAGS))
    started = f"`{base.get('model', spec.get('model', '?'))}`" + (f" at commit `{base['revision']}`"
                                                                    if base.get("revision") else "")
    lines = [
        "---", front_matter.to_yaml(), "---",
        f"# {run.get('name', 'model')}",
        "",
        f"Trained with GRPO by grpo-operator (GRPORun `{run.get('namespace', 'default')}/{run.get('name', '')}`) "
        f"from {started}, {step} optimizer steps.",
        "",
        f"- rewards: {rewards or '?'}",
        f"- prompt groups: {progress.get('groupsConsumed', '?')} consumed, {progress.get('groupsTrained', '?')} "
        f"trained, dropped by reason: {json.dumps(progress.get('dropped', {}), sort_keys=True)}",
    ]
    if trend:
        lines.append(f"- mean reward: {trend[0]['reward']:.4g} at step {trend[0]['step']}, "
                     f"{trend[-1]['reward']:.4g} at step {trend[-1]['step']}")
    lines += [
        "",
        "Load it with `transformers.AutoModelForCausalLM.from_pretrained(<this folder>)` or serve it with vLLM.",
        f"`{EXPORT_MANIFEST_FILE}` holds the run's spec, the base model's commit, the dataset's digest, its final "
        "progress, the trackers' runs, the package versions and each file's sha256; it is written last, so a folder "
        "without it is not a complete export.",
        "",
    ]
    return "\n".join(lines)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders that hold them
        _fsync(path)
    _fsync(folder)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _install(stage: Path, directory: Path) -> None:
    """Rename the staged folder to `directory`; an earlier export there is moved aside first, then removed."""
    replaced = _replaced_path(directory)
    if directory.exists() or directory.is_symlink():
        _remove(replaced)
        os.replace(directory, replaced)
    os.replace(stage, directory)
    _fsync(directory.parent)
    _remove(replaced)


def _describe(error: BaseException, directory: Path) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"could not export the model to {directory}: {error.strerror}{where}"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"could not export the model to {directory}: {text}"


def export_model(directory: str | os.PathLike[str], save: Callable[[Path], None], provenance: Mapping[str, Any], *,
                 uri: str, step: int, clock: Callable[[], float] = time.time) -> ExportReport:
    """Write the model into `directory` whole, or raise ExportError naming the path and the cause (nothing at
    `directory` changes then). `save(folder)` writes the model's files; `provenance` (run, spec, progress, packages)
    goes into the manifest."""
    directory = Path(directory)
    stage = staging_path(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _remove(stage)  # what a killed export left
        stage.mkdir()
        try:
            save(stage)
        except OSError:
            raise
        except Exception as error:  # a writer's own error type (safetensors' for a full disk): still an export failure
            raise ExportError(_describe(error, directory)) from error
        (stage / MODEL_CARD_FILE).write_text(model_card(provenance, step), encoding="utf-8")
        exported_at = clock()
        manifest = {
            "kind": MANIFEST_KIND,
            "version": MANIFEST_VERSION,
            **provenance,
            "step": step,
            "exportedAt": datetime.datetime.fromtimestamp(exported_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "files": file_digests(stage),
        }
        manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode()
        (stage / EXPORT_MANIFEST_FILE).write_bytes(manifest_bytes)
        _fsync_tree(stage)
        _install(stage, directory)
    except ExportError:
        _remove_quietly(stage)
        raise
    except OSError as error:
        _remove_quietly(stage)
        raise ExportError(_describe(error, directory)) from None
    total = sum(entry["bytes"] for entry in manifest["files"]) + len(manifest_bytes)
    return ExportReport(uri=uri, path=str(directory), step=step, bytes=total,
                        sha256=hashlib.sha256(manifest_bytes).hexdigest(), time=exported_at)


def _remove_quietly(path: Path) -> None:
    try:
        _remove(path)
    except OSError:
        pass  # the volume that refused the export may refuse this too; the next export removes it


def verify_export(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a complete export at `directory`; raises ExportError when the folder is not one (no
    manifest, a file missing or changed)."""
    directory = Path(directory)
    manifest_path = directory / EXPORT_MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ExportError(f"{directory}: not a complete export: {manifest_path.name}: {error}") from None
    listed = {entry["path"]: entry for entry in manifest.get("files", [])}
    found = {entry["path"]: entry for entry in file_digests(directory)}
    for name in sorted(set(listed) | set(found)):
        if name not in found:
            raise ExportError(f"{directory}: {name} is in the manifest but missing")
        if name not in listed:
            raise ExportError(f"{directory}: {name} is not in the manifest")
        if found[name]["sha256"] != listed[name]["sha256"]:
            raise ExportError(f"{directory}: {name} does not match its sha256 in the manifest")
    return manifest
