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
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..contract.config import CheckpointConfig
from ..contract.store_uri import Location, parse_uri
from ..storage.object_store import ObjectStoreError, client_from_env, describe, safe_relative
from .checkpoints import PROGRESS_STATE_FILE, MarkerError, UnusableCheckpoints, newest_checkpoint, read_marker

logger = logging.getLogger(__name__)

#: The object the start's probe writes and deletes under the prefix: proves the keys may write there.
PROBE_NAME = ".grpo-write-probe"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_LOCK_FILE = ".checkpoint-store.lock"


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
    def upload(self, checkpoint_dir: str) -> StoredCheckpoint:
        """Upload the checkpoint as its marker vouches for it: every file, then the marker; then delete what is
        beyond `keep`. The marker is read first, so files rewritten meanwhile fail their digest on resume rather
        than pass unvouched."""
        started = time.monotonic()
        name = os.path.basename(os.path.normpath(checkpoint_dir))
        bucket = self.location.bucket
        with open(os.path.join(checkpoint_dir, PROGRESS_STATE_FILE), "rb") as f:
            marker = f.read()
        payload = json.loads(marker)
        files = sorted(payload["files"])
        sizes = [record["size"] if isinstance(record, dict) else record for record in payload["files"].values()]
        key = self._key(name, PROGRESS_STATE_FILE)
        try:
            # A checkpoint saved again at its step replaces the one there: unvouched while its files change.
            self._client.delete_object(Bucket=bucket, Key=key)
            with create_transfer_manager(self._client, self._transfer) as manager:
                uploads = [(relative, manager.upload(os.path.join(checkpoint_dir, relative), bucket,
                                                     self._key(name, relative)))
                           for relative in files]
                for relative, future in uploads:
                    key = self._key(name, relative)
                    future.result()
            key = self._key(name, PROGRESS_STATE_FILE)
            self._client.put_object(Bucket=bucket, Key=key, Body=marker, ContentType="application/json")
            key = None
            self._prune(newest=name)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
            raise ObjectStoreError(describe(error, self.location, key)) from None
        return StoredCheckpoint(step=int(_NUMBERED.match(name)[1]), uri=self.uri_of(name), time=time.time(),
                                seconds=time.monotonic() - started, bytes=sum(sizes) + len(marker))

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
    def download_newest(self, directory: str) -> str | None:
        """Download the newest checkpoint the store holds complete into `directory`; its path, or None when the
        store holds none. One whose marker is missing (an upload that did not finish) is never chosen; one whose
        files are missing or do not match its marker is skipped with a warning for the one before it. Raises
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
                return self._download(name, listing[name], directory)
            except MarkerError as error:
                logger.warning("skipping the checkpoint %s in the store: %s", self.uri_of(name), error)
                rejected.append(f"{self.uri_of(name)}: {error}")
        if rejected:
            raise UnusableCheckpoints(f"checkpoint.uri {self.location.uri} holds no checkpoint that can be resumed: "
                                      f"{'; '.join(rejected)}. Remove these checkpoints to start the run afresh")
        return None

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


def resume_point(directory: str | None, store: CheckpointStore | None) -> str | None:
    """The checkpoint a learner resumes from: the newest in its folder, else (its folder holding none: a new node)
    the newest complete one in the store, downloaded. The learner processes of one pod share the folder: the first
    downloads, under a lock, and the others find it there."""
    if store is None or directory is None:
        return newest_checkpoint(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _LOCK_FILE), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = newest_checkpoint(directory)
        if found is not None:
            return found
        found = store.download_newest(directory)
        if found is not None:
            logger.info("downloaded the checkpoint %s from %s", found, store.location.uri)
        return found


class CheckpointUploads:
    """Uploads checkpoints to the store one at a time on a thread of its own, so training does not wait. A checkpoint
    saved while another uploads waits its turn; a newer one saved meanwhile takes its place (the older is not needed
    once a newer is up). A failed upload is logged and the run goes on: the next checkpoint tries again."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.last: StoredCheckpoint | None = None
        self.last_error = ""
        self._changed = threading.Condition()
        self._pending: str | None = None
        self._uploading: str | None = None
        # A daemon: a killed or preempted process leaves an unfinished upload behind, which no resume chooses.
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, checkpoint_dir: str) -> None:
        with self._changed:
            if self._pending is not None:
                logger.info("not uploading %s: the newer %s replaces it", self._pending, checkpoint_dir)
            self._pending = checkpoint_dir
            self._changed.notify_all()

    def in_flight(self) -> str | None:
        """The checkpoint uploading or waiting to, the newest; None when every one is up."""
        with self._changed:
            return self._pending or self._uploading

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every checkpoint submitted is up (or failed); whether they are, within `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending is None and self._uploading is None, timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None)
                self._uploading, self._pending = self._pending, None
            try:
                stored = self.store.upload(self._uploading)
            except (ObjectStoreError, OSError, ValueError, KeyError) as error:
                self.last_error = str(error)
                logger.error("the checkpoint %s was not uploaded: %s", self._uploading, error)
            else:
                self.last, self.last_error = stored, ""
                logger.info("checkpoint %d uploaded to %s in %.1f s (%d bytes)", stored.step, stored.uri,
                            stored.seconds, stored.bytes)
            with self._changed:
                self._uploading = None
                self._changed.notify_all()
