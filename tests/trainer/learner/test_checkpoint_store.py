"""Checkpoints in an object store (grpo_trainer.learner.checkpoint_store) against a real S3-compatible server
(SeaweedFS, tests/support/servers/s3_server.py: one per run): uploaded marker last, kept to `keep`, and resumed from
only when complete and as its marker vouches."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.report import parse_progress
from grpo_trainer.contract.store_uri import Location
from grpo_trainer.learner import checkpoint_store
from grpo_trainer.learner.checkpoint_store import (
    PARTS_POLL_S,
    CheckpointStore,
    CheckpointUploads,
    Share,
    part_name,
    resume_point,
)
from grpo_trainer.learner.checkpoints import (
    PROGRESS_STATE_FILE,
    UnusableCheckpoints,
    checkpoint_files,
    file_records,
    read_marker,
)
from grpo_trainer.storage.object_store import ObjectStoreError
from tests.support.ports import free_port
from tests.trainer.learner.test_checkpoints import complete_checkpoint

PREFIX = "runs/tiny/checkpoints"


def store_of(s3_server, bucket: str, keep: int = 2, **keys: str) -> CheckpointStore:
    return CheckpointStore(Location(bucket, PREFIX), keep, client=s3_server.client(**keys))


def stored(s3_server, bucket: str) -> dict[str, set[str]]:
    """Each checkpoint under the prefix with its objects."""
    listing = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=PREFIX + "/")
    found: dict[str, set[str]] = {}
    for item in listing.get("Contents", []):
        name, _, relative = item["Key"][len(PREFIX) + 1:].partition("/")
        found.setdefault(name, set()).add(relative)
    return found


def test_a_checkpoint_round_trips_through_the_store_and_reads_back_as_its_marker_vouches(s3_server, s3_bucket,
                                                                                         tmp_path):
    local = complete_checkpoint(tmp_path / "node-a", 3)
    store = store_of(s3_server, s3_bucket)
    up = store.upload(str(local))
    assert (up.step, up.uri) == (3, f"s3://{s3_bucket}/{PREFIX}/checkpoint-3")
    assert stored(s3_server, s3_bucket)["checkpoint-3"] == {PROGRESS_STATE_FILE, "model.safetensors",
                                                            "trainer_state.json", "sub/rng_state_1.pth"}
    downloaded = store.download_newest(str(tmp_path / "node-b"))
    assert downloaded == str(tmp_path / "node-b" / "checkpoint-3")
    assert read_marker(downloaded)["files"] == read_marker(str(local))["files"]
    for name in ("model.safetensors", "sub/rng_state_1.pth", "trainer_state.json"):
        assert (Path(downloaded) / name).read_bytes() == (local / name).read_bytes()
    assert not list((tmp_path / "node-b").glob(".*"))  # the staging folder is gone


def test_the_store_keeps_the_newest_keep_checkpoints(s3_server, s3_bucket, tmp_path):
    store = store_of(s3_server, s3_bucket, keep=2)
    for step in (1, 2, 3):
        store.upload(str(complete_checkpoint(tmp_path, step)))
    assert sorted(stored(s3_server, s3_bucket)) == ["checkpoint-2", "checkpoint-3"]


def no_marker(s3_server, bucket: str, key: str) -> None:
    """The upload was killed before its marker."""
    s3_server.client().delete_object(Bucket=bucket, Key=f"{key}/{PROGRESS_STATE_FILE}")


def file_missing(s3_server, bucket: str, key: str) -> None:
    """The marker is up but a file it vouches for is not (deleted, or an upload tool that skipped it)."""
    s3_server.client().delete_object(Bucket=bucket, Key=f"{key}/sub/rng_state_1.pth")


def file_changed(s3_server, bucket: str, key: str) -> None:
    """A file of the same size whose content does not match the marker's digest."""
    s3_server.client().put_object(Bucket=bucket, Key=f"{key}/model.safetensors", Body=b"x" * 1000)


@pytest.mark.parametrize("tear", [no_marker, file_missing, file_changed])
def test_a_torn_checkpoint_in_the_store_is_never_chosen_and_the_one_before_it_is(s3_server, s3_bucket, tmp_path,
                                                                                  tear, caplog):
    store = store_of(s3_server, s3_bucket, keep=3)
    for step in (4, 6):
        store.upload(str(complete_checkpoint(tmp_path / "node-a", step)))
    tear(s3_server, s3_bucket, f"{PREFIX}/checkpoint-6")
    with caplog.at_level(logging.WARNING):
        chosen = store.download_newest(str(tmp_path / "node-b"))
    assert chosen == str(tmp_path / "node-b" / "checkpoint-4")
    assert "checkpoint-6 in the store" in caplog.text
    assert not (tmp_path / "node-b" / "checkpoint-6").exists()
    assert not list((tmp_path / "node-b").glob(".*"))


def test_when_every_checkpoint_in_the_store_is_torn_the_error_names_each(s3_server, s3_bucket, tmp_path):
    store = store_of(s3_server, s3_bucket)
    store.upload(str(complete_checkpoint(tmp_path, 5)))
    file_changed(s3_server, s3_bucket, f"{PREFIX}/checkpoint-5")
    with pytest.raises(UnusableCheckpoints, match=r"checkpoint-5: vouches for model.safetensors, whose content "
                                                  r"changed after it was written"):
        store.download_newest(str(tmp_path / "node-b"))


def test_an_empty_store_means_a_fresh_run_and_a_local_checkpoint_is_preferred_to_the_store(s3_server, s3_bucket,
                                                                                           tmp_path):
    store = store_of(s3_server, s3_bucket)
    assert resume_point(str(tmp_path / "empty"), store) is None
    store.upload(str(complete_checkpoint(tmp_path / "node-a", 8)))
    local = complete_checkpoint(tmp_path / "node-b", 2)
    assert resume_point(str(tmp_path / "node-b"), store) == str(local)  # this node's own folder first
    assert resume_point(str(tmp_path / "node-c"), store) == str(tmp_path / "node-c" / "checkpoint-8")


def test_uploads_run_in_the_background_and_report_the_newest_one_up(s3_server, s3_bucket, tmp_path):
    uploads = CheckpointUploads(store_of(s3_server, s3_bucket))
    for step in (1, 2):
        uploads.submit(str(complete_checkpoint(tmp_path, step)))
    assert uploads.wait(timeout_s=60)
    assert uploads.last is not None and uploads.last.step == 2 and uploads.last_error == ""
    assert uploads.last.uri == f"s3://{s3_bucket}/{PREFIX}/checkpoint-2" and uploads.last.time <= time.time()
    assert "checkpoint-2" in stored(s3_server, s3_bucket)


def test_wrong_keys_and_a_missing_bucket_are_found_by_the_probe_naming_the_bucket(s3_server, s3_bucket):
    with pytest.raises(ObjectStoreError, match=rf"^checkpoint.uri: s3://{s3_bucket}/{PREFIX}: access denied"):
        store_of(s3_server, s3_bucket, access_key="nobody").probe()
    with pytest.raises(ObjectStoreError, match=rf"^checkpoint.uri: s3://no-such-bucket/{PREFIX}: the bucket "
                                               r"'no-such-bucket' does not exist$"):
        store_of(s3_server, "no-such-bucket").probe()
    store_of(s3_server, s3_bucket).probe()
    assert stored(s3_server, s3_bucket) == {}  # the probe leaves nothing behind


@pytest.mark.parametrize("bucket, keys, cause", [
    ("no-such-bucket", {}, "the bucket 'no-such-bucket' does not exist"),
    (None, {"secret_key": "wrong"}, "access denied: wrong credentials"),
])
def test_the_learner_exits_78_at_start_naming_the_bucket(s3_server, s3_bucket, tmp_path, monkeypatch, bucket, keys,
                                                         cause):
    """Before the model loads (this one does not exist): not at the first checkpoint of a long run."""
    from grpo_trainer.learner.main import main

    bucket = bucket or s3_bucket
    for name, value in s3_server.env(**keys).items():
        monkeypatch.setenv(name, value)
    config = RunConfig.model_validate({
        "model": str(tmp_path / "no-model"), "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu"}, "output_dir": str(tmp_path / "out"),
        "checkpoint": {"directory": str(tmp_path / "checkpoints"), "uri": f"s3://{bucket}/run"},
        "terminationMessagePath": str(tmp_path / "termination-log"),
    })
    assert main(config) == EXIT_INVALID_CONFIG
    message = parse_progress((tmp_path / "termination-log").read_text()).message
    assert message.startswith(f"checkpoint.uri: s3://{bucket}/run: ") and cause in message, message
    assert "\n" not in message


def test_a_preempted_learner_waits_for_the_upload_in_flight_and_says_it_finished(s3_server, s3_bucket, tmp_path,
                                                                                  monkeypatch):
    from grpo_trainer.learner import main, preemption

    monkeypatch.setenv("GRPO_TERMINATION_GRACE_SECONDS", "120")
    monkeypatch.setattr(preemption, "sigterm_at", time.monotonic())
    uploads = CheckpointUploads(store_of(s3_server, s3_bucket))
    uploads.submit(str(complete_checkpoint(tmp_path, 7)))
    said = main._preempted_upload(uploads)
    assert said == f"; the checkpoint's upload to s3://{s3_bucket}/{PREFIX} finished"
    assert uploads.last is not None and uploads.last.step == 7


def test_a_preempted_learner_whose_grace_period_is_spent_says_the_upload_did_not_finish(tmp_path, monkeypatch):
    """A store that takes the connection and never answers: the upload stays in flight past the grace period."""
    import socket

    from grpo_trainer.learner import main, preemption
    from grpo_trainer.storage.object_store import client_from_env

    silent = socket.create_server(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    client = client_from_env({"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    monkeypatch.setenv("GRPO_TERMINATION_GRACE_SECONDS", "30")
    monkeypatch.setattr(preemption, "sigterm_at", time.monotonic() - 25)  # 5 s left: less than the exit's margin
    uploads = CheckpointUploads(CheckpointStore(Location("ckpts", "run"), 2, client=client))
    checkpoint = complete_checkpoint(tmp_path, 9)
    uploads.submit(str(checkpoint))
    try:
        said = main._preempted_upload(uploads)
    finally:
        silent.close()
    assert said.startswith(f"; the upload of {checkpoint} to s3://ckpts/run did not finish within the grace period "
                           "(0 s left of 30 s)"), said


# ---------------------------------------------------------------------------------------- a learner of two machines
def machine_checkpoints(root: Path, step: int) -> tuple[Path, Path, dict[int, dict]]:
    """Checkpoint `step` as a learner of two machines with a folder each leaves it: machine 0's with the trainer's
    files and its marker, machine 1's with its own rank's shard and RNG state, no marker. Also what machine 1 tells
    machine 0 it holds (checkpoint_store.machine_shares)."""
    first = complete_checkpoint(root / "machine-0", step)
    second = root / "machine-1" / f"checkpoint-{step}"
    (second / "optimizer_0").mkdir(parents=True)
    (second / "optimizer_0" / "__1_0.distcp").write_bytes(b"s" * 300)
    (second / "rng_state_1.pth").write_bytes(b"q" * 20)
    return first, second, {1: file_records(str(second), checkpoint_files(str(second)))}


def committing(first: Path, peers: dict[int, dict]) -> Share:
    return Share.committing(str(first), json.loads((first / PROGRESS_STATE_FILE).read_text()), peers)


def test_machine_0_commits_only_once_the_other_machines_part_is_up_and_its_marker_vouches_for_both(
        s3_server, s3_bucket, tmp_path):
    first, second, peers = machine_checkpoints(tmp_path, 3)
    store = store_of(s3_server, s3_bucket)
    committer = CheckpointUploads(store)
    committer.submit(committing(first, peers))
    # An older part of machine 1 (a save at the same step, before) lists other digests: not this checkpoint's.
    s3_server.client().put_object(Bucket=s3_bucket, Key=f"{PREFIX}/checkpoint-3/{part_name(1)}",
                                  Body=json.dumps({"optimizer_0/__1_0.distcp": {"size": 300, "sha256": "0" * 64}}))
    assert not committer.wait(timeout_s=3 * PARTS_POLL_S)
    assert PROGRESS_STATE_FILE not in stored(s3_server, s3_bucket)["checkpoint-3"]  # machine 0's files, unvouched

    part = CheckpointUploads(store)
    part.submit(Share(str(second), 1, peers[1]))
    assert part.wait(timeout_s=60) and part.last is None and part.last_error == ""
    assert committer.wait(timeout_s=60) and committer.last_error == ""
    assert committer.last is not None and committer.last.step == 3
    assert stored(s3_server, s3_bucket)["checkpoint-3"] == {
        PROGRESS_STATE_FILE, "model.safetensors", "trainer_state.json", "sub/rng_state_1.pth",
        "optimizer_0/__1_0.distcp", "rng_state_1.pth", part_name(1)}

    # A new node gets every machine's files, checked against the one marker.
    downloaded = Path(store.download_newest(str(tmp_path / "new-node")))
    vouched = read_marker(str(downloaded))["files"]
    assert set(vouched) == set(read_marker(str(first))["files"]) | set(peers[1])
    assert (downloaded / "optimizer_0" / "__1_0.distcp").read_bytes() == b"s" * 300


def test_a_part_that_never_comes_leaves_the_checkpoint_uncommitted_naming_the_machine(s3_server, s3_bucket,
                                                                                     tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_store, "PARTS_WAIT_S", 2 * PARTS_POLL_S)
    first, _second, peers = machine_checkpoints(tmp_path, 5)
    committer = CheckpointUploads(store_of(s3_server, s3_bucket))
    committer.submit(committing(first, peers))
    assert committer.wait(timeout_s=60)
    assert committer.last is None
    assert committer.last_error == (f"s3://{s3_bucket}/{PREFIX}/checkpoint-5 was not committed: the learner's machine "
                                    "1 did not upload its files within 2 s")
    assert PROGRESS_STATE_FILE not in stored(s3_server, s3_bucket)["checkpoint-5"]


def test_every_machine_of_a_learner_resumes_from_the_stores_newest_whatever_its_folder_holds(s3_server, s3_bucket,
                                                                                           tmp_path):
    first, second, peers = machine_checkpoints(tmp_path / "run", 8)
    store = store_of(s3_server, s3_bucket)
    part = CheckpointUploads(store)
    part.submit(Share(str(second), 1, peers[1]))
    assert store.upload(committing(first, peers)).step == 8
    assert part.wait(timeout_s=60)
    complete_checkpoint(tmp_path / "run" / "machine-0", 10)  # saved, not in the store: machine 1 cannot have it
    every_file = set(read_marker(str(first))["files"]) | set(peers[1])

    for machine in (0, 1):
        folder = tmp_path / "run" / f"machine-{machine}"
        resumed = resume_point(str(folder), store, machines=2)
        assert resumed == str(folder / "checkpoint-8")
        assert set(read_marker(resumed)["files"]) == every_file
    # A single machine's own folder comes first, as before.
    assert resume_point(str(tmp_path / "run" / "machine-0"), store) == str(tmp_path / "run" / "machine-0" /
                                                                          "checkpoint-10")

    # A folder all machines share holds the checkpoint as the store does: it is used as it is, not downloaded.
    shared = tmp_path / "shared"
    copy = Path(store.download_newest(str(shared)))
    (copy / "not-in-the-store").write_text("x")
    assert resume_point(str(shared), store, machines=2) == str(copy) and (copy / "not-in-the-store").exists()


def test_ranks_that_found_different_checkpoints_do_not_start(tmp_path):
    """agree_on_resume over a real gloo group of two processes, one of which found checkpoint-8 and the other none."""
    script = (
        "import os, sys, torch.distributed as dist\n"
        "from grpo_trainer.learner.checkpoint_store import agree_on_resume\n"
        "dist.init_process_group('gloo')\n"
        "try:\n"
        "    agree_on_resume(sys.argv[1] or None)\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
        "else:\n"
        "    print('agreed')\n"
    )
    port = str(free_port())

    def ranks(found: tuple[str, str]) -> list[str]:
        launched = [subprocess.Popen([sys.executable, "-c", script, found[rank]], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                          "RANK": str(rank), "WORLD_SIZE": "2"})
                    for rank in (0, 1)]
        return [process.communicate(timeout=120)[0].strip() for process in launched]

    assert ranks(("/a/checkpoint-8", "/b/checkpoint-8")) == ["agreed", "agreed"]
    port = str(free_port())
    said = ranks(("/a/checkpoint-8", ""))
    assert said == [said[0]] * 2 and said[0] == (
        "ResumeDisagreement the learner's ranks found different checkpoints to resume from (rank 0: checkpoint-8, "
        "rank 1: none): checkpoint.directory must be one volume all the learner's pods mount, or checkpoint.uri set")
