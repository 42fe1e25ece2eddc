"""Checkpoints in an object store (`checkpoint.uri`): a learner rescheduled to another node, whose checkpoint folder
started empty, resumes from the store instead of starting over.

Each checkpoint is written to the checkpoint folder as always (checkpoints.py), then uploaded in the background by
`CheckpointUploads` (training does not wait): under `PREFIX/checkpoint-N/`, every file its marker vouches for first,
the marker (`grpo_progress.json`, every file's size and SHA-256) last. The marker is the commit: an upload killed
halfway leaves files without one, which no resume chooses. Once a new marker is up, checkpoints beyond the newest
`checkpoint.keep` are deleted.

A learner whose folder holds no checkpoint downloads the newest one the store holds with its marker, and checks every
file against the marker (read_marker) before it resumes from it; one that fails (a file missing, or not as the marker
records it) is skipped for the one before it, as on the volume.

A learner of several machines (pods) whose checkpoint folders are their own (an emptyDir each) holds each checkpoint
spread over them: each rank's shards and RNG state on its own machine. After the save, the machines tell each other
what they hold (`machine_shares`, a collective); each machine but 0 uploads the files only it holds, then a part
marker (`.parts/machine-K.json`) listing them; machine 0 uploads its own, waits until every other machine's part
marker is up and lists what it told, then uploads the marker, which vouches for every machine's files. Every machine
resumes from the store's newest complete checkpoint (the copy in its folder only when its marker is the store's), so
all of them agree; `agree_on_resume` ends a start where they do not. On a folder they share, machine 0 holds
everything and uploads it alone.

Wrong keys or a missing bucket are found at the learner's start (`CheckpointStore.probe`), not at its first
checkpoint hours later.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import botocore.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..contract.config import CheckpointConfig
from ..contract.store_uri import Location, parse_uri
from ..storage.object_store import ObjectStoreError, client_from_env, describe, safe_relative
from .checkpoints import (
    PROGRESS_STATE_FILE,
    MarkerError,
    UnusableCheckpoints,
    checkpoint_files,
    file_records,
    marker_payload,
    newest_checkpoint,
    read_marker,
)

logger = logging.getLogger(__name__)

#: The object the start's probe writes and deletes under the prefix: proves the keys may write there.
PROBE_NAME = ".grpo-write-probe"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_LOCK_FILE = ".checkpoint-store.lock"
#: Under a checkpoint's prefix: each machine's (but 0's) list of the files it uploaded, put after them.
PARTS_FOLDER = ".parts"
#: How long machine 0 waits for the other machines' parts before it gives the checkpoint up (the next one tries
#: again): each machine uploads its own shards at the same time, so they arrive about together.
PARTS_WAIT_S = 600.0
PARTS_POLL_S = 1.0


def part_name(machine: int) -> str:
    return f"{PARTS_FOLDER}/machine-{machine}.json"


@dataclass(frozen=True)
class Share:
    """What one learner machine (pod) uploads of a checkpoint: `files`, each file's record (size, SHA-256) by its
    path in the checkpoint. Machine 0 also holds the `marker` (the store's: every machine's files) and `peers`, the
    other machines' files, whose part markers it waits for before it puts the marker."""

    checkpoint_dir: str
    machine: int
    files: dict[str, Any]
    marker: bytes | None = None
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def whole(cls, checkpoint_dir: str) -> Share:
        """The checkpoint as its marker in the folder vouches for it, uploaded by one machine."""
        with open(os.path.join(checkpoint_dir, PROGRESS_STATE_FILE), "rb") as f:
            marker = f.read()
        return cls(checkpoint_dir, 0, json.loads(marker)["files"], marker)

    @classmethod
    def committing(cls, checkpoint_dir: str, local_marker: dict[str, Any],
                   peers: dict[int, dict[str, Any]]) -> Share:
        """Machine 0's share: its folder's marker, widened to vouch for the other machines' files too."""
        state = {k: v for k, v in local_marker.items() if k not in ("files", "digest")}
        files = dict(local_marker["files"])
        for records in peers.values():
            files.update(records)
        marker = json.dumps(marker_payload(state, files) if peers else local_marker).encode()
        return cls(checkpoint_dir, 0, dict(local_marker["files"]), marker, peers)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.checkpoint_dir))


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint whose marker is up in the store."""

    step: int
    uri: str
    time: float
    seconds: float
    bytes: int


class CheckpointStore:
    """The checkpoints under one `s3://bucket/prefix`; ObjectStoreError (one line naming the place) for a failure."""

    def __init__(self, location: Location, keep: int, client: Any = None,
                 transfer: TransferConfig | None = None):
        self.location = location
        self.keep = keep
        self._client = client or client_from_env()
        self._transfer = transfer or TransferConfig()

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig) -> CheckpointStore | None:
        if checkpoint.uri is None:
            return None
        return cls(parse_uri(checkpoint.uri, "checkpoint.uri"), checkpoint.keep)

    def _key(self, name: str, relative: str = "") -> str:
        return self.location.key(f"{name}/{relative}" if relative else name)

    def uri_of(self, name: str) -> str:
        return f"s3://{self.location.bucket}/{self._key(name)}"

    def probe(self) -> None:
        """The bucket exists and these keys may write under the prefix: a small object put and deleted. Raises
        ObjectStoreError naming the bucket and the cause."""
        bucket, key = self.location.bucket, self._key(PROBE_NAME)
        try:
            self._client.head_bucket(Bucket=bucket)
            self._client.put_object(Bucket=bucket, Key=key, Body=b"")
            self._client.delete_object(Bucket=bucket, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            code = str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
            # HEAD answers without a body: a missing bucket is a bare 404.
            cause = (f"{self.location.uri}: the bucket {bucket!r} does not exist" if code in ("404", "NoSuchBucket")
                     else describe(error, self.location))
            raise ObjectStoreError(f"checkpoint.uri: {cause}") from None

    # ------------------------------------------------------------------------------------------------------- upload
    def upload(self, share: Share | str) -> StoredCheckpoint | None:
        """Upload this machine's share of a checkpoint (a folder: the whole of it, as its marker vouches for it):
        every file first; then on machine 0, once the other machines' parts are up, the marker, and the checkpoints
        beyond `keep` are deleted; on another machine its part marker. The marker is read first, so files rewritten
        meanwhile fail their digest on resume rather than pass unvouched. Returns what machine 0 committed (None on
        another machine)."""
        share = Share.whole(share) if isinstance(share, str) else share
        started = time.monotonic()
        name, bucket = share.name, self.location.bucket
        commit = self._key(name, PROGRESS_STATE_FILE if share.marker is not None else part_name(share.machine))
        key = commit
        try:
            # A checkpoint saved again at its step replaces the one there: unvouched while its files change.
            self._client.delete_object(Bucket=bucket, Key=commit)
            with create_transfer_manager(self._client, self._transfer) as manager:
                uploads = [(relative, manager.upload(os.path.join(share.checkpoint_dir, relative), bucket,
                                                     self._key(name, relative)))
                           for relative in sorted(share.files)]
                for relative, future in uploads:
                    key = self._key(name, relative)
                    future.result()
            if share.marker is None:
                key = commit
                self._client.put_object(Bucket=bucket, Key=commit, Body=_part_body(share.files),
                                        ContentType="application/json")
                return None
            key = None
            self._wait_for_parts(name, share.peers)
            key = commit
            self._client.put_object(Bucket=bucket, Key=commit, Body=share.marker, ContentType="application/json")
            key = None
            self._prune(newest=name)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
            raise ObjectStoreError(describe(error, self.location, key)) from None
        files = json.loads(share.marker)["files"]
        sizes = [record["size"] if isinstance(record, dict) else record for record in files.values()]
        return StoredCheckpoint(step=_step(name), uri=self.uri_of(name), time=time.time(),
                                seconds=time.monotonic() - started, bytes=sum(sizes) + len(share.marker))

    def _wait_for_parts(self, name: str, peers: dict[int, dict[str, Any]]) -> None:
        """Until each other machine's part marker is up and lists the files it told machine 0 of (an older one, left
        by a save at the same step, lists other digests). The other machines upload every part in turn, so each
        one comes unless its machine failed (which it logs)."""
        waiting = dict(peers)
        deadline = time.monotonic() + PARTS_WAIT_S
        while waiting:
            for machine, files in list(waiting.items()):
                try:
                    body = self._client.get_object(Bucket=self.location.bucket,
                                                   Key=self._key(name, part_name(machine)))["Body"].read()
                except botocore.exceptions.ClientError as error:
                    if error.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
                        raise
                    continue
                if body == _part_body(files):
                    del waiting[machine]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise ObjectStoreError(
                    f"{self.uri_of(name)} was not committed: the learner's machine "
                    f"{', '.join(map(str, sorted(waiting)))} did not upload its files within {PARTS_WAIT_S:.0f} s")
            time.sleep(PARTS_POLL_S)

    def _listing(self) -> dict[str, set[str]]:
        """Each numbered checkpoint under the prefix with the relative paths of its objects."""
        root = f"{self.location.prefix}/" if self.location.prefix else ""
        found: dict[str, set[str]] = {}
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=root)
        for page in pages:
            for item in page.get("Contents", []):
                name, _, relative = item["Key"][len(root):].partition("/")
                if _NUMBERED.match(name) and relative:
                    found.setdefault(name, set()).add(relative)
        return found

    def _prune(self, newest: str) -> None:
        """Delete the checkpoints beyond the newest `keep` complete ones, and unfinished uploads (a learner killed
        while uploading) older than the oldest kept."""
        listing = self._listing()
        complete = sorted((n for n, files in listing.items() if PROGRESS_STATE_FILE in files), key=_step,
                          reverse=True)
        kept = set(complete[:self.keep]) | {newest}
        oldest_kept = min(_step(n) for n in kept)
        stale = [n for n in listing if n not in kept and (n in complete or _step(n) < oldest_kept)]
        for name in stale:
            # The marker first: a checkpoint half deleted reads as unfinished, never as complete.
            keys = [self._key(name, PROGRESS_STATE_FILE)] + [self._key(name, r) for r in sorted(listing[name])
                                                              if r != PROGRESS_STATE_FILE]
            for start in range(0, len(keys), 1000):
                self._client.delete_objects(Bucket=self.location.bucket,
                                            Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]],
                                                    "Quiet": True})
            logger.info("deleted the checkpoint %s from the store (checkpoint.keep %d)", self.uri_of(name), self.keep)

    # -------------------------------------------------------------------------------------------------- download
    def download_newest(self, directory: str, *, reuse_local: bool = False) -> str | None:
        """Download the newest checkpoint the store holds complete into `directory`; its path, or None when the
        store holds none. One whose marker is missing (an upload that did not finish) is never chosen; one whose
        files are missing or do not match its marker is skipped with a warning for the one before it. With
        `reuse_local`, a copy in `directory` whose marker is the store's is used as it is. Raises
        UnusableCheckpoints when markers exist but none passes, ObjectStoreError when the store fails."""
        try:
            listing = self._listing()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            raise ObjectStoreError(describe(error, self.location)) from None
        rejected = []
        for name in sorted(listing, key=_step, reverse=True):
            if PROGRESS_STATE_FILE not in listing[name]:
                logger.warning("skipping %s in the store: no %s (its upload did not finish)", self.uri_of(name),
                               PROGRESS_STATE_FILE)
                continue
            try:
                if reuse_local and self._same_as_local(name, directory):
                    logger.info("the checkpoint %s in %s is the store's newest", name, directory)
                    return os.path.join(directory, name)
                found = self._download(name, listing[name], directory)
                logger.info("downloaded the checkpoint %s from %s", found, self.location.uri)
                return found
            except MarkerError as error:
                logger.warning("skipping the checkpoint %s in the store: %s", self.uri_of(name), error)
                rejected.append(f"{self.uri_of(name)}: {error}")
        if rejected:
            raise UnusableCheckpoints(f"checkpoint.uri {self.location.uri} holds no checkpoint that can be resumed: "
                                      f"{'; '.join(rejected)}. Remove these checkpoints to start the run afresh")
        return None

    def _same_as_local(self, name: str, directory: str) -> bool:
        """Whether `directory` holds checkpoint `name` as the store's marker vouches for it (its own marker the
        same, and passing its checks)."""
        local = os.path.join(directory, name)
        try:
            with open(os.path.join(local, PROGRESS_STATE_FILE), "rb") as f:
                local_digest = json.loads(f.read()).get("digest")
        except (OSError, ValueError, AttributeError):
            return False
        key = self._key(name, PROGRESS_STATE_FILE)
        try:
            stored = json.loads(self._client.get_object(Bucket=self.location.bucket, Key=key)["Body"].read())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            raise ObjectStoreError(describe(error, self.location, key)) from None
        except ValueError:
            return False  # the download says what is wrong with it
        if not isinstance(stored, dict) or stored.get("digest") != local_digest:
            return False
        try:
            read_marker(local)
        except MarkerError as error:
            logger.warning("downloading %s again: the copy in %s %s", self.uri_of(name), local, error)
            return False
        return True

    def _download(self, name: str, present: set[str], directory: str) -> str:
        """The checkpoint `name` into `directory`, checked against its marker, renamed into place once it passes;
        MarkerError when it does not."""
        bucket = self.location.bucket
        stage = os.path.join(directory, f".{name}.download")
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        key = self._key(name, PROGRESS_STATE_FILE)
        try:
            self._client.download_file(bucket, key, os.path.join(stage, PROGRESS_STATE_FILE))
            try:
                with open(os.path.join(stage, PROGRESS_STATE_FILE)) as f:
                    files = list(json.load(f).get("files") or {})
            except (ValueError, AttributeError):
                files = []  # read_marker says what is wrong with it
            for relative in files:
                if not safe_relative(relative):  # anyone with write access to the store names the keys
                    raise MarkerError(f"vouches for {relative!r}, which is not a file path under the checkpoint")
                if relative not in present:
                    raise MarkerError(f"vouches for {relative}, which is missing from the store")
            with create_transfer_manager(self._client, self._transfer) as manager:
                downloads = []
                for relative in files:
                    os.makedirs(os.path.dirname(os.path.join(stage, relative)), exist_ok=True)
                    downloads.append((relative, manager.download(bucket, self._key(name, relative),
                                                                 os.path.join(stage, relative))))
                for relative, future in downloads:
                    key = self._key(name, relative)
                    future.result()
            read_marker(stage)
            target = os.path.join(directory, name)
            shutil.rmtree(target, ignore_errors=True)  # an unfinished local save of the same step
            os.replace(stage, target)
            return target
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
            shutil.rmtree(stage, ignore_errors=True)
            raise ObjectStoreError(describe(error, self.location, key)) from None
        except MarkerError:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _step(name: str) -> int:
    return int(_NUMBERED.match(name)[1])


def _part_body(files: dict[str, Any]) -> bytes:
    return json.dumps(files, sort_keys=True, separators=(",", ":")).encode()


def resume_point(directory: str | None, store: CheckpointStore | None, machines: int = 1) -> str | None:
    """The checkpoint a learner resumes from: the newest in its folder, else (its folder holding none: a new node)
    the newest complete one in the store, downloaded. A learner of several `machines` resumes from the store's newest
    always, so that every machine takes the same one (their folders may hold different steps: each its own files,
    one machine's folder kept, another's new), from its folder where the copy there is the store's. The learner
    processes of one pod share the folder: the first downloads, under a lock, and the others find it there."""
    if store is None or directory is None:
        return newest_checkpoint(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _LOCK_FILE), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if machines == 1:
            found = newest_checkpoint(directory)
            if found is not None:
                return found
        return store.download_newest(directory, reuse_local=machines > 1)


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def machine_shares(checkpoint_dir: str, local_main: bool) -> tuple[int | None, dict[int, dict[str, Any]]]:
    """A collective every rank enters after a checkpoint's save: the machines (each one's local main process) list
    the files their folder holds; a file machine 0 does not hold is uploaded by the first machine that holds it,
    which hashes it. Returns this process's machine (None on a process that is not its machine's first) and the
    files of every machine but 0 that machine 0 is to wait for, by machine."""
    import torch.distributed as dist

    rank = dist.get_rank()
    listings = _all_gather(checkpoint_files(checkpoint_dir) if local_main else None)
    firsts = [r for r, listing in enumerate(listings) if listing is not None]
    machine = firsts.index(rank) if local_main else None
    owner: dict[str, int] = {name: 0 for name in listings[firsts[0]]}
    for index, first in enumerate(firsts[1:], start=1):
        for name in listings[first]:
            owner.setdefault(name, index)
    mine: dict[str, Any] = {}
    if machine:
        sizes = {name: size for name, size in listings[rank].items() if owner[name] == machine}
        mine = file_records(checkpoint_dir, sizes)
    told = _all_gather(mine if machine else None)
    return machine, {index: told[first] for index, first in enumerate(firsts) if index > 0}


class ResumeDisagreement(RuntimeError):
    """The learner's ranks found different checkpoints to resume from. A crash, retried: the folders and the store
    a new start finds may agree."""


def agree_on_resume(resume: str | None) -> None:
    """Every rank of a learner of several processes resumes from the same step, or none does: raises
    ResumeDisagreement naming what each rank found (a collective every rank enters before training)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    found = _all_gather(os.path.basename(os.path.normpath(resume)) if resume else None)
    if len(set(found)) > 1:
        said = ", ".join(f"rank {rank}: {name or 'none'}" for rank, name in enumerate(found))
        raise ResumeDisagreement(f"the learner's ranks found different checkpoints to resume from ({said}): "
                                  "checkpoint.directory must be one volume all the learner's pods mount, or "
                                  "checkpoint.uri set")


class CheckpointUploads:
    """Uploads checkpoints to the store one at a time on a thread of its own, so training does not wait. A checkpoint
    saved while another uploads waits its turn. On machine 0 a newer one saved meanwhile takes the place of one
    waiting (the older is not needed once a newer is up); another machine uploads every part in turn, since machine
    0 waits for each part of the checkpoint it commits. A failed upload is logged and the run goes on: the next
    checkpoint tries again."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.last: StoredCheckpoint | None = None
        self.last_error = ""
        self._changed = threading.Condition()
        self._queue: list[Share] = []
        self._uploading: Share | None = None
        # A daemon: a killed or preempted process leaves an unfinished upload behind, which no resume chooses.
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, share: Share | str) -> None:
        """This machine's share of a checkpoint (a folder: the whole of it), to upload."""
        share = Share.whole(share) if isinstance(share, str) else share
        with self._changed:
            if share.marker is not None:
                for replaced in [queued for queued in self._queue if queued.marker is not None]:
                    logger.info("not uploading %s: the newer %s replaces it", replaced.checkpoint_dir,
                                share.checkpoint_dir)
                    self._queue.remove(replaced)
            self._queue.append(share)
            self._changed.notify_all()

    def in_flight(self) -> str | None:
        """The checkpoint uploading or waiting to, the newest; None when every one is up."""
        with self._changed:
            share = self._queue[-1] if self._queue else self._uploading
            return share.checkpoint_dir if share else None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every checkpoint submitted is up (or failed); whether they are, within `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and self._uploading is None, timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue))
                self._uploading = share = self._queue.pop(0)
            try:
                stored = self.store.upload(share)
            except (ObjectStoreError, OSError, ValueError, KeyError) as error:
                self.last_error = str(error)
                logger.error("the checkpoint %s was not uploaded: %s", share.checkpoint_dir, error)
            else:
                if stored is None:
                    logger.info("this machine's part of %s uploaded to %s", share.checkpoint_dir,
                                self.store.uri_of(share.name))
                else:
                    self.last, self.last_error = stored, ""
                    logger.info("checkpoint %d uploaded to %s in %.1f s (%d bytes)", stored.step, stored.uri,
                                stored.seconds, stored.bytes)
            with self._changed:
                self._uploading = None
                self._changed.notify_all()
