"""Checkpoint markers: `grpo_progress.json` says a checkpoint is complete and holds the progress it resumes with.

The marker is written last and atomically, yet a volume can still tear it: a full disk, a copy cut short, a rename
that is not atomic on a FUSE or object-store volume, a file damaged in place. So a marker is checked before it is
trusted: the progress state against a schema, every file of the checkpoint against the size and SHA-256 the marker
recorded, and a SHA-256 digest over all of it. Resume takes the newest checkpoint whose marker passes, warning about
each one skipped and why.

Markers written by learners before the files' hashes (each file's size alone, and before that without
`regeneration_attempts` too) are read as they were written: their files are checked by size only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..contract.codes import DropReason
from ..progress.state import ProgressStateError, check_version
from ..storage.model_export import sha256_of

logger = logging.getLogger(__name__)

PROGRESS_STATE_FILE = "grpo_progress.json"
_STAGING_SUFFIX = ".tmp"
#: Validation errors named in a message, at most.
_ERRORS_SHOWN = 3
#: Files hashed at once: hashlib lets go of the GIL while it hashes, so a checkpoint's shards hash side by side.
_HASH_THREADS = min(8, os.cpu_count() or 1)


class MarkerError(ValueError):
    """A marker that cannot be trusted; the message says why in one line."""


class UnusableCheckpoints(ValueError):
    """Checkpoints exist, and their markers say complete, but none can be trusted: resuming would lose progress and
    starting afresh would overwrite it, so the learner stops (a retry would find the same files)."""


class FileRecord(BaseModel):
    """What a marker records of one file of its checkpoint."""

    model_config = ConfigDict(extra="allow")

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ProgressMarker(BaseModel):
    """The schema of a marker: the progress state (progress.ProgressState), the trainer's own figures, and what
    vouches for them.

    Keys beyond these are kept (a newer state may carry more); the digest covers them as well.
    """

    model_config = ConfigDict(extra="allow")

    first_unconsumed: int = Field(ge=0)
    consumed_after: list[int]
    dropped_after: dict[DropReason, list[int]]
    prefix_streak: int = Field(ge=0)
    regenerated: int = Field(ge=0)
    bound: int | None
    transparent_before: int = Field(ge=0)
    transparent_after: list[int]
    # Absent from markers written before it: no slot had a regeneration counted.
    regeneration_attempts: dict[int, int] = Field(
        default_factory=dict, description="Absolute position -> regenerations of its slot.")
    # Absent from markers written before it: none was counted apart.
    regenerated_environment: int = Field(0, ge=0, description="Of `regenerated`, those an environment's failure "
                                         "left untrained.")
    groups_trained: int = Field(ge=0)
    dropped: dict[DropReason, int]
    epochs_done: int = Field(ge=0)
    model_version: int = Field(ge=0)
    global_step: int = Field(ge=0)
    files: dict[str, FileRecord | int] = Field(
        description="Every other file of the checkpoint, relative path -> its size and SHA-256 (a size in bytes "
                    "alone in markers written before the hashes).")
    digest: str = Field(description="SHA-256 of the marker's other keys, canonical JSON.")


def _digest(payload: dict[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in payload.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def checkpoint_files(checkpoint_dir: str) -> dict[str, int]:
    """Every file under the checkpoint directory but the marker (and its staging copy), with its size."""
    files = {}
    for root, _dirs, names in os.walk(checkpoint_dir):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, checkpoint_dir).replace(os.sep, "/")
            if relative in (PROGRESS_STATE_FILE, PROGRESS_STATE_FILE + _STAGING_SUFFIX):
                continue
            files[relative] = os.path.getsize(path)
    return dict(sorted(files.items()))


def _hashes(checkpoint_dir: str, names: list[str]) -> dict[str, str]:
    paths = [os.path.join(checkpoint_dir, name) for name in names]
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:
        return dict(zip(names, pool.map(sha256_of, paths), strict=True))


def file_records(checkpoint_dir: str, sizes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """What a marker records of these files of the checkpoint: each one's size and SHA-256."""
    hashes = _hashes(checkpoint_dir, list(sizes))
    return {name: {"size": size, "sha256": hashes[name]} for name, size in sizes.items()}


def marker_payload(state: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A marker for the progress state `state` vouching for `files`, with its digest."""
    payload = {**state, "files": dict(sorted(files.items()))}
    payload["digest"] = _digest(payload)
    return payload


def write_marker(checkpoint_dir: str, state: dict[str, Any]) -> dict[str, Any]:
    """Vouch for the checkpoint as it is on disk now: call it once every other file is written. Returns the marker.

    Each file is hashed right after the save, while it is still in the page cache."""
    payload = marker_payload(state, file_records(checkpoint_dir, checkpoint_files(checkpoint_dir)))
    write_json_atomically(os.path.join(checkpoint_dir, PROGRESS_STATE_FILE), payload)
    return payload


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    staging = path + _STAGING_SUFFIX
    with open(staging, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def read_marker(checkpoint_dir: str) -> dict[str, Any]:
    """The progress state a checkpoint's marker holds, once the marker passes every check; else MarkerError."""
    path = os.path.join(checkpoint_dir, PROGRESS_STATE_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise MarkerError(f"cannot be read: {error.strerror or error}") from None
    if not raw.strip():
        raise MarkerError("is empty")
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MarkerError(f"is not valid JSON ({error}): cut short while written or copied?") from None
    if not isinstance(payload, dict):
        raise MarkerError(f"holds a JSON {type(payload).__name__}, not an object")
    try:
        check_version(payload)  # a state written by a newer learner is refused, not misread
    except ProgressStateError as error:
        raise MarkerError(str(error)) from None
    try:
        ProgressMarker.model_validate(payload)
    except ValidationError as error:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'marker'}: {e['msg']}" for e in error.errors()]
        more = f" and {len(problems) - _ERRORS_SHOWN} more" if len(problems) > _ERRORS_SHOWN else ""
        raise MarkerError(f"is incomplete or malformed ({'; '.join(problems[:_ERRORS_SHOWN])}{more})") from None
    if _digest(payload) != payload["digest"]:
        raise MarkerError("does not match its digest: its content changed after it was written")

    on_disk = checkpoint_files(checkpoint_dir)
    recorded = {name: record if isinstance(record, dict) else {"size": record}
                for name, record in payload["files"].items()}
    for name, record in recorded.items():
        if name not in on_disk:
            raise MarkerError(f"vouches for {name}, which is missing")
        if on_disk[name] != record["size"]:
            raise MarkerError(f"vouches for {name} of {record['size']} bytes, but it has {on_disk[name]}")
    hashed = sorted(name for name, record in recorded.items() if "sha256" in record)
    if len(hashed) < len(recorded):
        logger.info(f"{path} records no SHA-256 for some files (written by an older learner): "
                    "those are checked by size only")
    if hashed and not _verified_before(checkpoint_dir, payload):
        actual = _hashes(checkpoint_dir, hashed)
        for name in hashed:
            if actual[name] != recorded[name]["sha256"]:
                raise MarkerError(
                    f"vouches for {name}, whose content changed after it was written: "
                    f"{os.path.join(checkpoint_dir, name)} is damaged (SHA-256 {actual[name]}, "
                    f"recorded {recorded[name]['sha256']})")
        _remember_verified(checkpoint_dir, payload)
    return payload


# Checkpoints whose files this process hashed and found as their marker records them, each with the files'
# identities then: the resume reads the marker newest_checkpoint checked moments before, and hashing a large
# checkpoint twice costs as long again. A file written since has another modification time and is hashed again.
_verified: set[tuple[str, str, tuple[tuple[str, int, int, int], ...]]] = set()


def _identity(checkpoint_dir: str, payload: dict[str, Any]) -> tuple[str, str, tuple[tuple[str, int, int, int], ...]]:
    files = []
    for name in sorted(payload["files"]):
        stat = os.stat(os.path.join(checkpoint_dir, name))
        files.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return os.path.realpath(checkpoint_dir), payload["digest"], tuple(files)


def _remember_verified(checkpoint_dir: str, payload: dict[str, Any]) -> None:
    _verified.add(_identity(checkpoint_dir, payload))


def _verified_before(checkpoint_dir: str, payload: dict[str, Any]) -> bool:
    return _identity(checkpoint_dir, payload) in _verified


def newest_checkpoint(directory: str | None) -> str | None:
    """The newest checkpoint a restarted learner can resume from, or None for a fresh run.

    A directory without a marker was interrupted while saving (resuming from one crashed every restart until the
    backoff limit: no trainer_state.json) and is skipped. A marker that fails its checks is skipped with a warning
    naming it and why. Raises UnusableCheckpoints when markers exist but none passes.
    """
    if not directory or not os.path.isdir(directory):
        return None
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    numbered = sorted(
        ((int(match[1]), name) for name in os.listdir(directory) if (match := pattern.match(name))), reverse=True
    )
    rejected: list[str] = []
    for _, name in numbered:
        path = os.path.join(directory, name)
        marker = os.path.join(path, PROGRESS_STATE_FILE)
        if not os.path.isfile(marker):
            logger.warning(f"skipping the incomplete checkpoint {path} (interrupted while saving)")
            continue
        try:
            read_marker(path)
        except MarkerError as error:
            logger.warning(f"skipping the checkpoint {path}: {marker} {error}")
            rejected.append(f"{marker} {error}")
            continue
        return path
    if rejected:
        raise UnusableCheckpoints(
            f"checkpoint.directory {directory} holds no checkpoint that can be resumed: {'; '.join(rejected)}. "
            "Restore a good copy, or remove these checkpoints to start the run afresh")
    return None
