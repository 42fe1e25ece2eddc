"""A folder in an S3-compatible object store (`s3://bucket/prefix`), written whole or not at all, and read back
verified.

An object store has no rename, so a folder cannot be staged and moved into place as on a volume. Instead the manifest
(`contract.codes.EXPORT_MANIFEST_FILE`: every file's path, size and sha256) is the commit: an upload removes the
prefix's old manifest, writes every file, and puts the manifest last; a reader treats a prefix without a manifest as
absent, and checks each file it downloads against the manifest. An upload killed halfway leaves files without a
manifest: no model, never half of one.

Where and as whom comes from the environment boto3 reads (so a Kubernetes Secret can be mounted as env):
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL for an
S3-compatible server, AWS_REGION. Without keys boto3's own chain applies (a pod's web identity, an instance role).
Every failure is an `ObjectStoreError` whose one-line message names the location and the cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager

from ..contract.codes import EXPORT_MANIFEST_FILE
from ..contract.store_uri import ACCESS_KEY_ENV, ENDPOINT_ENV, REGION_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV, Location
from .model_export import file_digests, sha256_of

#: A manifest bigger than this is not one of ours (a model's manifest is a few KB per thousand files).
MANIFEST_MAX_BYTES = 16 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The error codes S3 (and the servers that speak it) answer with, by cause.
_MISSING_KEY_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId": f"the access key ({ACCESS_KEY_ENV}) is not known to the object store",
    "SignatureDoesNotMatch": f"the secret key ({SECRET_KEY_ENV}) does not match the access key",
    "InvalidToken": f"the session token ({SESSION_TOKEN_ENV}) is not valid",
    "ExpiredToken": f"the session token ({SESSION_TOKEN_ENV}) has expired",
    "AccessDenied": "access denied: the credentials lack permission for it",
    "403": "access denied: wrong credentials, or they lack permission for it",
}


class ObjectStoreError(Exception):
    """An object-store operation failed; the message is one line naming the location and the cause."""


def endpoint_url(environ: Mapping[str, str] = os.environ) -> str | None:
    """The S3-compatible endpoint the environment names, None for AWS's own."""
    return next((environ[name] for name in ENDPOINT_ENV if environ.get(name)), None)


def client_from_env(environ: Mapping[str, str] = os.environ) -> Any:
    """An S3 client for the endpoint and credentials `environ` names (boto3's variables)."""
    endpoint = endpoint_url(environ)
    region = next((environ[name] for name in REGION_ENV if environ.get(name)), None)
    # S3-compatible servers (MinIO, SeaweedFS, Ceph) serve buckets as paths; AWS prefers virtual hosts.
    config = botocore.config.Config(s3={"addressing_style": "path" if endpoint else "auto"},
                                    retries={"max_attempts": 3, "mode": "standard"})
    session = boto3.session.Session(aws_access_key_id=environ.get(ACCESS_KEY_ENV) or None,
                                    aws_secret_access_key=environ.get(SECRET_KEY_ENV) or None,
                                    aws_session_token=environ.get(SESSION_TOKEN_ENV) or None,
                                    region_name=region or "us-east-1")
    return session.client("s3", endpoint_url=endpoint, config=config)


def describe(error: BaseException, location: Location, key: str | None = None) -> str:
    """One line naming `location` (or its object `key`) and the cause of `error`."""
    where = f"s3://{location.bucket}/{key}" if key else location.uri
    if isinstance(error, botocore.exceptions.ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return f"{where}: the bucket {location.bucket!r} does not exist"
        if code in _MISSING_KEY_CODES:
            return f"{where}: no such object"
        if code in _CREDENTIAL_CODES:
            return f"{where}: {_CREDENTIAL_CODES[code]} ({code})"
        message = str(error.response.get("Error", {}).get("Message", "")).splitlines()
        return f"{where}: the object store refused it: {code or 'error'}{': ' + message[0] if message else ''}"
    if isinstance(error, botocore.exceptions.NoCredentialsError):
        return f"{where}: no credentials: set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} (for example from a Secret)"
    if isinstance(error, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectTimeoutError):
        url = urllib.parse.urlsplit(str(error.kwargs.get("endpoint_url", "")))
        endpoint = f"{url.scheme}://{url.netloc}" if url.netloc else "its endpoint"
        return f"{where}: cannot reach the object store at {endpoint}"
    if isinstance(error, OSError) and error.strerror:
        return f"{where}: {error.strerror}{f' ({error.filename})' if error.filename else ''}"
    text = str(error).splitlines()
    return f"{where}: {text[0] if text and text[0] else type(error).__name__}"


def _is_missing_key(error: BaseException) -> bool:
    return (isinstance(error, botocore.exceptions.ClientError)
            and str(error.response.get("Error", {}).get("Code", "")) in _MISSING_KEY_CODES)


def safe_relative(path: Any) -> bool:
    """A manifest's path names a file under the folder: relative, no '..', no empty or '.' segment."""
    if not isinstance(path, str) or not path or "\\" in path or path == EXPORT_MANIFEST_FILE:
        return False
    parts = PurePosixPath(path).parts
    return not path.startswith("/") and "/".join(parts) == path and all(part not in (".", "..") for part in parts)


def check_manifest(manifest: Any, where: str) -> list[dict[str, Any]]:
    """The files `manifest` lists; ObjectStoreError naming `where` when it is not a manifest (it came from a store
    anyone with write access may have changed: every path must stay under the folder)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        raise ObjectStoreError(f"{where}: not a manifest: no list of files")
    seen = set()
    for entry in files:
        path = entry.get("path") if isinstance(entry, dict) else None
        if not safe_relative(path) or path in seen:
            raise ObjectStoreError(f"{where}: not a manifest: {path!r} is not a file path under the folder")
        size, digest = entry.get("bytes"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ObjectStoreError(f"{where}: not a manifest: {path}'s size is not a count of bytes")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ObjectStoreError(f"{where}: not a manifest: {path}'s sha256 is not 64 hex digits")
        seen.add(path)
    return files


@dataclass(frozen=True)
class Upload:
    """A folder uploaded whole: where, its manifest's sha256, and the bytes written (the manifest included)."""

    uri: str
    sha256: str
    bytes: int
    files: int


def _manifest_for(folder: Path) -> tuple[bytes, list[dict[str, Any]]]:
    """The manifest to upload: the folder's own (checked against its files) where it carries one, else one listing
    its files."""
    files = file_digests(folder)
    own = folder / EXPORT_MANIFEST_FILE
    if not own.exists():
        return (json.dumps({"files": files}, indent=2) + "\n").encode(), files
    data = own.read_bytes()
    try:
        listed = check_manifest(json.loads(data), str(own))
    except ValueError as error:
        raise ObjectStoreError(f"{own}: not a manifest: {error}") from None
    by_path = {entry["path"]: entry for entry in files}
    for entry in listed:
        found = by_path.pop(entry["path"], None)
        if found is None:
            raise ObjectStoreError(f"{folder}: {entry['path']} is in {EXPORT_MANIFEST_FILE} but missing")
        if (found["sha256"], found["bytes"]) != (entry["sha256"], entry["bytes"]):
            raise ObjectStoreError(f"{folder}: {entry['path']} does not match its sha256 in {EXPORT_MANIFEST_FILE}")
    if by_path:
        raise ObjectStoreError(f"{folder}: {min(by_path)} is not in {EXPORT_MANIFEST_FILE}")
    return data, listed


def upload_folder(folder: str | os.PathLike[str], location: Location, *, client: Any = None,
                  transfer: TransferConfig | None = None) -> Upload:
    """Upload every file under `folder` to `location`, then the manifest; ObjectStoreError naming the cause.

    The prefix's old manifest goes first, so that while the files are replaced the prefix reads as absent rather
    than as the old model with new files. Objects an earlier upload left under the prefix that the new manifest
    does not list are removed once it is in place. Big files go in parts (boto3's transfer manager)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ObjectStoreError(f"{folder}: not a folder: nothing to upload to {location.uri}")
    client = client or client_from_env()
    key = None
    try:
        manifest, files = _manifest_for(folder)
        key = location.manifest_key
        client.delete_object(Bucket=location.bucket, Key=key)
        with create_transfer_manager(client, transfer or TransferConfig()) as manager:
            uploads = [(entry["path"], manager.upload(str(folder / entry["path"]), location.bucket,
                                                      location.key(entry["path"])))
                       for entry in files]
            for path, future in uploads:
                key = location.key(path)
                future.result()
        key = location.manifest_key
        _put_manifest(client, location, manifest)
        key = None
        _remove_unlisted(client, location, {location.key(entry["path"]) for entry in files})
    except ObjectStoreError:
        raise
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
        raise ObjectStoreError(describe(error, location, key)) from None
    return Upload(uri=location.uri, sha256=hashlib.sha256(manifest).hexdigest(),
                  bytes=sum(entry["bytes"] for entry in files) + len(manifest), files=len(files))


def _put_manifest(client: Any, location: Location, manifest: bytes) -> None:
    client.put_object(Bucket=location.bucket, Key=location.manifest_key, Body=manifest,
                      ContentType="application/json")


def _remove_unlisted(client: Any, location: Location, listed: set[str]) -> None:
    keep = listed | {location.manifest_key}
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=location.bucket, Prefix=f"{location.prefix}/" if location.prefix else "")
    for page in pages:
        stale = [{"Key": item["Key"]} for item in page.get("Contents", []) if item["Key"] not in keep]
        if stale:
            client.delete_objects(Bucket=location.bucket, Delete={"Objects": stale, "Quiet": True})


def read_manifest(location: Location, *, client: Any = None) -> dict[str, Any] | None:
    """The manifest at `location`, None where there is none (nothing there, or an upload that did not finish);
    ObjectStoreError for anything else (credentials, a missing bucket, a manifest that is not one)."""
    fetched = _fetch_manifest(client or client_from_env(), location)
    return None if fetched is None else fetched[1]


def _fetch_manifest(client: Any, location: Location, *,
                    optional: bool = False) -> tuple[bytes, dict[str, Any]] | None:
    """`optional`: the location may hold no manifest at all (an input), so a refusal names the location rather
    than the manifest."""
    where = f"s3://{location.bucket}/{location.manifest_key}"
    try:
        response = client.get_object(Bucket=location.bucket, Key=location.manifest_key)
        data = response["Body"].read(MANIFEST_MAX_BYTES + 1)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        if _is_missing_key(error):
            return None
        raise ObjectStoreError(describe(error, location, None if optional else location.manifest_key)) from None
    if len(data) > MANIFEST_MAX_BYTES:
        raise ObjectStoreError(f"{where}: not a manifest: over {MANIFEST_MAX_BYTES} bytes")
    try:
        manifest = json.loads(data)
    except ValueError as error:
        raise ObjectStoreError(f"{where}: not a manifest: {error}") from None
    check_manifest(manifest, where)
    return data, manifest


def download_folder(location: Location, folder: str | os.PathLike[str], *, client: Any = None,
                    transfer: TransferConfig | None = None) -> dict[str, Any]:
    """Download the folder at `location` into `folder` (absent, or an empty folder), each file checked against the
    manifest; its manifest. ObjectStoreError naming the cause: no manifest (nothing complete there), a file missing
    or not matching. The files land in a hidden folder beside `folder` that is renamed into place once all are
    verified: `folder` is either complete or untouched."""
    folder = Path(folder)
    client = client or client_from_env()
    fetched = _fetch_manifest(client, location)
    if fetched is None:
        raise ObjectStoreError(f"{location.uri}: no model there: {EXPORT_MANIFEST_FILE} is missing "
                               "(nothing was uploaded, or the upload did not finish)")
    data, manifest = fetched
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ObjectStoreError(f"{folder}: not an empty folder: the download would mix two models")
    stage = folder.parent / f".{folder.name}.partial"
    key = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        files = manifest["files"]
        for entry in files:
            (stage / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
        with create_transfer_manager(client, transfer or TransferConfig()) as manager:
            downloads = [(entry, manager.download(location.bucket, location.key(entry["path"]),
                                                  str(stage / entry["path"])))
                         for entry in files]
            for entry, future in downloads:
                key = location.key(entry["path"])
                future.result()
        key = None
        for entry in files:
            path = stage / entry["path"]
            if path.stat().st_size != entry["bytes"] or sha256_of(path) != entry["sha256"]:
                raise ObjectStoreError(f"{location.uri}: {entry['path']} does not match its sha256 in "
                                       f"{EXPORT_MANIFEST_FILE}: it changed after the upload")
        (stage / EXPORT_MANIFEST_FILE).write_bytes(data)
        os.replace(stage, folder)
    except ObjectStoreError:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as error:
        shutil.rmtree(stage, ignore_errors=True)
        if key is not None and _is_missing_key(error):
            raise ObjectStoreError(f"s3://{location.bucket}/{key}: in {EXPORT_MANIFEST_FILE} but missing from the "
                                   "store") from None
        raise ObjectStoreError(describe(error, location, key)) from None
    return manifest


def download(location: Location, destination: str | os.PathLike[str], *, client: Any = None) -> Path:
    """Download what `location` names to `destination` (absent): a folder the store holds with a manifest (verified
    as download_folder does), else every object under the prefix as a folder, else the one object the prefix names
    as a file. ObjectStoreError naming the cause, or that nothing is there.

    What is downloaded lands in a hidden folder of its own beside `destination` and is renamed into place last, so
    that `destination` existing means complete: a download killed halfway leaves only the hidden folder, and two
    processes downloading at once each stage their own, the second finding the first's in place."""
    destination = Path(destination)
    client = client or client_from_env()
    destination.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))
    try:
        staged = stage / destination.name
        if _fetch_manifest(client, location, optional=True) is not None:
            download_folder(location, staged, client=client)
        else:
            _download_unlisted(client, location, staged)
        try:
            os.rename(staged, destination)
        except OSError:
            if not destination.exists():
                raise
    except OSError as error:
        raise ObjectStoreError(describe(error, location)) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return destination


def manifest_identity(manifest: bytes) -> str:
    """source_identity of a folder held with `manifest` (its bytes): the same whether read from the store or from a
    downloaded copy."""
    return f"manifest:{hashlib.sha256(manifest).hexdigest()}"


def source_identity(location: Location, *, client: Any = None) -> str:
    """What the store holds at `location`, as a string that changes whenever any of it does: `manifest:SHA256` for
    a folder the store holds with a manifest (the manifest lists every file's digest), else `objects:SHA256` over
    every key and ETag under the prefix, else `object:ETAG` for the one object the prefix names. ObjectStoreError
    naming the cause, or that nothing is there."""
    client = client or client_from_env()
    fetched = _fetch_manifest(client, location, optional=True)
    if fetched is not None:
        return manifest_identity(fetched[0])
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=f"{location.prefix}/" if location.prefix else "")
        listed = sorted(f"{item['Key']} {item.get('ETag', '')}" for page in pages for item in page.get("Contents", [])
                        if not item["Key"].endswith("/"))
        if listed:
            return f"objects:{hashlib.sha256(chr(10).join(listed).encode()).hexdigest()}"
        if not location.prefix:
            raise ObjectStoreError(f"{location.uri}: the bucket is empty")
        return f"object:{client.head_object(Bucket=location.bucket, Key=location.prefix)['ETag']}"
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        if _is_missing_key(error):
            raise ObjectStoreError(f"{location.uri}: no such object, and no objects under it") from None
        raise ObjectStoreError(describe(error, location)) from None


def _download_unlisted(client: Any, location: Location, target: Path) -> None:
    """The objects under `location`'s prefix into the folder `target`, else its one object into the file `target`."""
    key = None
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=f"{location.prefix}/" if location.prefix else "")
        keys = [item["Key"] for page in pages for item in page.get("Contents", []) if not item["Key"].endswith("/")]
        if keys:
            start = len(location.prefix) + 1 if location.prefix else 0
            for key in keys:
                if not safe_relative(key[start:]):  # anyone with write access names the keys
                    raise ObjectStoreError(f"s3://{location.bucket}/{key}: not a file path under {location.uri}")
                path = target / key[start:]
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(location.bucket, key, str(path))
            return
        if not location.prefix:
            raise ObjectStoreError(f"{location.uri}: the bucket is empty")
        key = location.prefix
        client.download_file(location.bucket, key, str(target))
    except ObjectStoreError:
        raise
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        if key == location.prefix and _is_missing_key(error):
            raise ObjectStoreError(f"{location.uri}: no such object, and no objects under it") from None
        raise ObjectStoreError(describe(error, location, key)) from None
