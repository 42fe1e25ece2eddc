"""grpo_trainer.storage.object_store: URIs and manifests on their own, then uploads and downloads against a real
S3-compatible server (SeaweedFS, tests/support/servers/s3_server.py: one per run)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

from grpo_trainer.contract.codes import EXPORT_MANIFEST_FILE
from grpo_trainer.contract.store_uri import InvalidObjectStoreURI, Location, parse_uri
from grpo_trainer.storage.object_store import (
    ObjectStoreError,
    check_manifest,
    client_from_env,
    download_folder,
    read_manifest,
    upload_folder,
)
from tests.support.paths import REPO
from tests.support.ports import free_port

SHA = "0" * 64


@pytest.mark.parametrize(("uri", "location"), [
    ("s3://models", Location("models", "")),
    ("s3://models/", Location("models", "")),
    ("s3://my.models-1/runs/tiny", Location("my.models-1", "runs/tiny")),
    ("s3://models/runs/tiny/", Location("models", "runs/tiny")),
])
def test_parse_uri(uri, location):
    assert parse_uri(uri, "spec.output.uri") == location
    assert location.key("model.safetensors") == (f"{location.prefix}/model.safetensors" if location.prefix
                                                 else "model.safetensors")


@pytest.mark.parametrize(("uri", "why"), [
    ("models/tiny", "must start with s3://"),
    ("gs://models/tiny", "must start with s3://"),
    ("s3://Models/tiny", "not a bucket name"),
    ("s3://m/tiny", "not a bucket name"),
    ("s3://models..x/tiny", "not a bucket name"),
    ("s3:///tiny", "not a bucket name"),
    ("s3://models/a//b", "empty, '.' or '..' segment"),
    ("s3://models/a/../b", "empty, '.' or '..' segment"),
    ("s3://models/tiny?versionId=3", "no query"),
])
def test_parse_uri_refuses_naming_the_field(uri, why):
    with pytest.raises(InvalidObjectStoreURI) as refused:
        parse_uri(uri, "spec.output.uri")
    message = str(refused.value)
    assert message.startswith(f"spec.output.uri: {uri!r} is not an object store URI") and why in message
    assert "\n" not in message


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "a/../../b", "./a", "a//b", "", EXPORT_MANIFEST_FILE,
                                  3])
def test_a_manifest_naming_a_path_outside_the_folder_is_refused(path):
    with pytest.raises(ObjectStoreError, match="is not a file path under the folder"):
        check_manifest({"files": [{"path": path, "bytes": 1, "sha256": SHA}]}, "s3://b/p/grpo-export.json")


@pytest.mark.parametrize(("entry", "why"), [
    ({"path": "a", "bytes": -1, "sha256": SHA}, "size is not a count"),
    ({"path": "a", "bytes": True, "sha256": SHA}, "size is not a count"),
    ({"path": "a", "bytes": 1, "sha256": "abc"}, "sha256 is not 64 hex digits"),
])
def test_a_manifest_with_a_wrong_size_or_digest_is_refused(entry, why):
    with pytest.raises(ObjectStoreError, match=why):
        check_manifest({"files": [entry]}, "s3://b/p/grpo-export.json")


def test_a_folder_that_is_not_there_is_not_uploaded_as_an_empty_model(tmp_path):
    with pytest.raises(ObjectStoreError, match=r"missing: not a folder: nothing to upload to s3://models/runs/tiny"):
        upload_folder(tmp_path / "missing", Location("models", "runs/tiny"), client=object())


def test_no_credentials_anywhere_is_named(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    # nowhere else for boto3's chain to look: no config files, no instance metadata
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = client_from_env({"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}"})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}\n")
    with pytest.raises(ObjectStoreError) as refused:
        upload_folder(tmp_path / "model", Location("models", "runs/tiny"), client=client)
    assert str(refused.value) == ("s3://models/runs/tiny/grpo-export.json: no credentials: set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY (for example from a Secret)")


def test_an_endpoint_that_does_not_answer_is_named(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = client_from_env({"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "a",
                              "AWS_SECRET_ACCESS_KEY": "b"})
    with pytest.raises(ObjectStoreError) as refused:
        download_folder(Location("models", "runs/tiny"), tmp_path / "downloaded", client=client)
    assert str(refused.value) == f"s3://models/runs/tiny/grpo-export.json: cannot reach the object store at {endpoint}"


def test_the_client_reads_the_endpoint_from_the_environment():
    client = client_from_env({"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "a",
                              "AWS_SECRET_ACCESS_KEY": "b"})
    assert client.meta.endpoint_url == "http://127.0.0.1:9"


# ---- against the real server ---------------------------------------------------------------------------------------

def _files(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def _keys(client, bucket: str) -> set[str]:
    return {item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


@pytest.fixture
def model(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model, with a nested file as checkpoints and tokenizers have."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("nested\n")
    return folder


@pytest.mark.s3
def test_a_folder_round_trips_with_its_big_files_in_parts(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    location = parse_uri(f"s3://{s3_bucket}/runs/tiny", "spec.output.uri")
    # the weights (~0.5 MB) go in parts: a threshold below their size
    upload = upload_folder(model, location, client=client, transfer=TransferConfig(multipart_threshold=64 << 10))

    manifest_bytes = client.get_object(Bucket=s3_bucket, Key=f"runs/tiny/{EXPORT_MANIFEST_FILE}")["Body"].read()
    assert upload.sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    listed = json.loads(manifest_bytes)["files"]
    assert [entry["path"] for entry in listed] == sorted(_files(model))
    assert upload.bytes == sum(len(data) for data in _files(model).values()) + len(manifest_bytes)
    weights = max(listed, key=lambda entry: entry["bytes"])
    etag = client.head_object(Bucket=s3_bucket, Key=f"runs/tiny/{weights['path']}")["ETag"]
    assert etag.strip('"').endswith("-1"), f"{weights['path']} was not uploaded in parts: ETag {etag}"

    downloaded = tmp_path / "downloaded"
    manifest = download_folder(location, downloaded, client=client)
    assert manifest["files"] == listed
    assert _files(downloaded) == {**_files(model), EXPORT_MANIFEST_FILE: manifest_bytes}


@pytest.mark.s3
def test_a_folder_carrying_its_own_manifest_is_uploaded_with_it_verbatim(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    files = [{"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
             for path, data in _files(model).items()]
    own = json.dumps({"kind": "GRPOModelExport", "spec": {"model": "tiny"}, "files": files}).encode()
    (model / EXPORT_MANIFEST_FILE).write_bytes(own)
    location = Location(s3_bucket, "exported")
    upload = upload_folder(model, location, client=client)
    assert upload.sha256 == hashlib.sha256(own).hexdigest()
    assert read_manifest(location, client=client)["spec"] == {"model": "tiny"}

    (model / "extra" / "notes.txt").write_text("changed after the export\n")
    with pytest.raises(ObjectStoreError, match=r"extra/notes.txt does not match its sha256 in grpo-export.json"):
        upload_folder(model, Location(s3_bucket, "again"), client=client)


@pytest.mark.s3
def test_a_reupload_replaces_the_folder_and_removes_what_the_new_one_lacks(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    location = Location(s3_bucket, "runs/tiny")
    upload_folder(model, location, client=client)
    shutil.rmtree(model / "extra")
    (model / "config.json").write_text('{"changed": true}\n')
    upload_folder(model, location, client=client)
    assert "runs/tiny/extra/notes.txt" not in _keys(client, s3_bucket)
    download_folder(location, tmp_path / "downloaded", client=client)
    assert json.loads((tmp_path / "downloaded" / "config.json").read_text()) == {"changed": True}


@pytest.mark.s3
@pytest.mark.parametrize(("keys", "cause"), [
    ({"access_key": "nobody"}, "the access key (AWS_ACCESS_KEY_ID) is not known to the object store"),
    ({"secret_key": "wrong-secret"}, "the secret key (AWS_SECRET_ACCESS_KEY) does not match the access key"),
])
def test_wrong_credentials_are_named(s3_server, s3_bucket, model, tmp_path, keys, cause):
    client = s3_server.client(**keys)
    location = Location(s3_bucket, "runs/tiny")
    with pytest.raises(ObjectStoreError) as upload:
        upload_folder(model, location, client=client)
    with pytest.raises(ObjectStoreError) as download:
        download_folder(location, tmp_path / "downloaded", client=client)
    for refused in (upload, download):
        message = str(refused.value)
        assert f"s3://{s3_bucket}/" in message and cause in message and "\n" not in message, message
    assert not (tmp_path / "downloaded").exists()


@pytest.mark.s3
def test_a_missing_bucket_is_named(s3_server, model, tmp_path):
    client = s3_server.client()
    location = parse_uri("s3://no-such-bucket/runs/tiny", "spec.output.uri")
    for attempt in (lambda: upload_folder(model, location, client=client),
                    lambda: download_folder(location, tmp_path / "downloaded", client=client)):
        with pytest.raises(ObjectStoreError) as refused:
            attempt()
        assert "the bucket 'no-such-bucket' does not exist" in str(refused.value)
    assert "no-such-bucket" not in {bucket["Name"] for bucket in client.list_buckets()["Buckets"]}


@pytest.mark.s3
def test_nothing_at_a_prefix_reads_as_absent(s3_server, s3_bucket, tmp_path):
    location = Location(s3_bucket, "never/uploaded")
    assert read_manifest(location, client=s3_server.client()) is None
    with pytest.raises(ObjectStoreError, match=r"s3://grpo-test-\d+/never/uploaded: no model there: grpo-export"):
        download_folder(location, tmp_path / "downloaded", client=s3_server.client())


KILLED_BEFORE_THE_MANIFEST = textwrap.dedent("""\
    import os, signal, sys
    from grpo_trainer.storage import object_store
    from grpo_trainer.contract.store_uri import parse_uri
    # the process dies the moment it would write the manifest: every file is uploaded, the manifest is not
    object_store._put_manifest = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    object_store.upload_folder(sys.argv[1], parse_uri(sys.argv[2], "uri"))
    """)


def _upload_killed_before_the_manifest(s3_server, folder: Path, uri: str) -> None:
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_MANIFEST, str(folder), uri], cwd=REPO,
                            env={**os.environ, **s3_server.env()}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


@pytest.mark.s3
def test_an_upload_killed_before_its_manifest_reads_as_absent(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    _upload_killed_before_the_manifest(s3_server, model, f"s3://{s3_bucket}/runs/tiny")
    assert _keys(client, s3_bucket) == {f"runs/tiny/{path}" for path in _files(model)}  # every file, no manifest
    location = Location(s3_bucket, "runs/tiny")
    assert read_manifest(location, client=client) is None
    with pytest.raises(ObjectStoreError, match="no model there: grpo-export.json is missing"):
        download_folder(location, tmp_path / "downloaded", client=client)
    assert not (tmp_path / "downloaded").exists()


@pytest.mark.s3
def test_a_reupload_killed_halfway_does_not_leave_the_old_manifest_over_new_files(s3_server, s3_bucket, model,
                                                                                  tmp_path):
    client = s3_server.client()
    location = Location(s3_bucket, "runs/tiny")
    upload_folder(model, location, client=client)
    (model / "config.json").write_text('{"retrained": true}\n')
    _upload_killed_before_the_manifest(s3_server, model, location.uri)
    assert read_manifest(location, client=client) is None


@pytest.mark.s3
def test_a_file_altered_after_the_upload_is_refused_by_name(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    location = Location(s3_bucket, "runs/tiny")
    upload_folder(model, location, client=client)
    client.put_object(Bucket=s3_bucket, Key="runs/tiny/config.json", Body=b'{"tampered": true}\n')
    with pytest.raises(ObjectStoreError) as refused:
        download_folder(location, tmp_path / "downloaded", client=client)
    assert str(refused.value) == (f"s3://{s3_bucket}/runs/tiny: config.json does not match its sha256 in "
                                  "grpo-export.json: it changed after the upload")
    assert not (tmp_path / "downloaded").exists() and not (tmp_path / ".downloaded.partial").exists()


@pytest.mark.s3
def test_a_file_missing_from_the_store_is_named(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    location = Location(s3_bucket, "runs/tiny")
    upload_folder(model, location, client=client)
    client.delete_object(Bucket=s3_bucket, Key="runs/tiny/extra/notes.txt")
    with pytest.raises(ObjectStoreError, match=rf"s3://{s3_bucket}/runs/tiny/extra/notes.txt: in grpo-export.json "
                                               "but missing from the store"):
        download_folder(location, tmp_path / "downloaded", client=client)


@pytest.mark.s3
def test_a_download_into_a_folder_holding_files_is_refused(s3_server, s3_bucket, model, tmp_path):
    client = s3_server.client()
    location = Location(s3_bucket, "runs/tiny")
    upload_folder(model, location, client=client)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.bin").write_bytes(b"x")
    with pytest.raises(ObjectStoreError, match="not an empty folder"):
        download_folder(location, tmp_path / "busy", client=client)
    (tmp_path / "empty").mkdir()
    download_folder(location, tmp_path / "empty", client=client)
    assert (tmp_path / "empty" / EXPORT_MANIFEST_FILE).exists()
