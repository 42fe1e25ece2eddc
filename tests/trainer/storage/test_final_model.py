"""The learner's end of a run with `output` (grpo_trainer.storage.final_model): every rank saves, rank 0 exports with
the run's provenance (and uploads it to an object store, against the real S3 test server), and an export that fails ends
the learner with the export-failed code and a message naming the path or the cause (the operator fails the run on it:
tests/operator/test_status.py). The learner here is a stand-in for what `main` calls on it; the real learner's export
runs in tests/operator/cli/test_local_run.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_operator.builders import LEARNER_TERMINATION_GRACE_S
from grpo_trainer.contract.codes import (
    EXIT_EXPORT_FAILED,
    EXIT_PREEMPTED,
    EXIT_SUCCEEDED,
    EXPORT_MANIFEST_FILE,
    PERMANENT_EXIT_CODES,
    LearnerPhase,
)
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.report import ProgressReport, TrackedRunReport, parse_progress
from grpo_trainer.contract.store_uri import parse_uri
from grpo_trainer.learner import main as learner_main
from grpo_trainer.storage import final_model
from grpo_trainer.storage.model_export import verify_export
from grpo_trainer.storage.object_store import download_folder
from tests.support.paths import REPO

TRACKED = TrackedRunReport(tracker="mlflow", run_id="0a1b", uri="http://mlflow:5000/#/experiments/1/runs/0a1b")


class FinishedLearner:
    """What learner_main.main reads of a learner that trained to its bound."""

    def __init__(self, is_main: bool = True, weights_from: str | None = None):
        self.accelerator = SimpleNamespace(is_main_process=is_main, num_processes=1, process_index=0,
                                           unwrap_model=lambda model: model, is_fsdp2=False)
        # A module (what accelerate's is_peft_model inspects) that is not a peft model: the plain save.
        self.model = torch.nn.Module()
        self.model.generation_config = None
        self.state = SimpleNamespace(log_history=[{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}])
        self.phase, self.message = LearnerPhase.SUCCEEDED, ""
        self.saved: list[str] = []
        self.weights_from = weights_from  # a saved model whose files the save writes; b"weights" without one

    def request_preemption(self) -> bool:
        return True

    def train(self, resume_from_checkpoint=None) -> None:
        pass

    def save_model(self, folder: str) -> None:
        self.saved.append(folder)
        if self.accelerator.is_main_process and self.weights_from is not None:
            shutil.copytree(self.weights_from, folder, dirs_exist_ok=True)
        elif self.accelerator.is_main_process:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model.safetensors").write_bytes(b"weights")

    def progress_report(self) -> ProgressReport:
        return ProgressReport(phase=LearnerPhase.SUCCEEDED, groups_total=4, groups_consumed=4, groups_trained=3,
                              dropped={"no_signal": 1}, global_step=2, epochs_done=1, tracking=[TRACKED])

    def close(self) -> None:
        pass


def run_config(tmp_path: Path, model_dir: Path, uri: str | None = None) -> RunConfig:
    return RunConfig.model_validate({
        "runName": "tiny", "model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu"}, "output_dir": str(tmp_path / "out"),
        "terminationMessagePath": str(tmp_path / "termination-log"),
        "output": {"directory": str(model_dir), "uri": uri or model_dir.as_uri(), "runSpec": {"model": "m"}},
    })


@pytest.fixture
def learner(monkeypatch) -> FinishedLearner:
    finished = FinishedLearner()
    monkeypatch.setattr(learner_main, "build_learner", lambda *args, **kwargs: finished)
    return finished


def test_a_learner_that_exported_reports_the_model_in_its_final_report(tmp_path, learner):
    model_dir = tmp_path / "models" / "tiny"
    assert learner_main.main(run_config(tmp_path, model_dir)) == EXIT_SUCCEEDED
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.output is not None and report.output.path == str(model_dir) and report.output.step == 2
    assert report.message.endswith(f"; model exported to {model_dir.as_uri()}")
    manifest = verify_export(model_dir)
    assert manifest["run"] == {"name": "tiny", "namespace": "default"} and manifest["spec"] == {"model": "m"}
    assert manifest["progress"]["dropped"]["no_signal"] == 1
    assert manifest["base"] == {"model": "m"} and manifest["dataset"] == {"path": "p.jsonl"}
    assert manifest["tracking"] == [{"tracker": "mlflow", "runId": "0a1b", "uri": TRACKED.uri}]
    assert manifest["progress"]["rewardTrend"] == [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}]
    assert json.loads((tmp_path / "termination-log").read_text())["output"]["sha256"] == report.output.sha256
    assert not (tmp_path / "out" / "final").exists()  # the export replaces the plain save


def test_the_manifest_names_the_images_the_run_config_holds_when_the_learner_exports(tmp_path, learner):
    """The operator records the pods' image digests in the mounted run config while the learner runs: the export
    reads the file again, and keeps what it read at the start when the file is torn."""
    model_dir = tmp_path / "models" / "tiny"
    config = run_config(tmp_path, model_dir)
    config_path = tmp_path / "run.json"
    images = {"learner": ["localhost/grpo-trainer@sha256:" + "1" * 64], "rollout": ["sha256:" + "2" * 64]}
    config_path.write_text(config.model_copy(update={"images": images}).model_dump_json(by_alias=True))
    assert learner_main.main(config, str(config_path)) == EXIT_SUCCEEDED
    assert verify_export(model_dir)["images"] == images
    config_path.write_text("{torn")
    at_start = {"learner": ["sha256:" + "3" * 64]}
    assert learner_main.main(config.model_copy(update={"images": at_start}), str(config_path)) == EXIT_SUCCEEDED
    assert verify_export(model_dir)["images"] == at_start


def test_a_failed_export_exits_with_its_own_code_naming_the_path(tmp_path, learner):
    (tmp_path / "models").write_text("a file where the volume's folder should be")
    model_dir = tmp_path / "models" / "tiny"
    assert learner_main.main(run_config(tmp_path, model_dir)) == EXIT_EXPORT_FAILED
    assert EXIT_EXPORT_FAILED in PERMANENT_EXIT_CODES
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED and report.output is None
    assert report.message.startswith(f"could not export the model to {model_dir}: ")


def test_other_ranks_save_with_rank_0_but_leave_the_writing_to_it(tmp_path):
    rank1 = FinishedLearner(is_main=False)
    model_dir = tmp_path / "models" / "tiny"
    assert final_model.export_trained_model(run_config(tmp_path, model_dir), rank1, threading.Event()) is None
    assert rank1.saved == [str(tmp_path / "models" / ".tiny.partial")]  # the same folder as rank 0's save
    assert not (tmp_path / "models").exists()


@pytest.mark.s3
def test_a_learner_uploads_its_export_to_the_object_store_and_reports_the_manifest_there(
        tmp_path, monkeypatch, tiny_model_dir, s3_server, s3_bucket):
    from transformers import AutoModelForCausalLM

    finished = FinishedLearner(weights_from=tiny_model_dir)
    monkeypatch.setattr(learner_main, "build_learner", lambda *args, **kwargs: finished)
    for name, value in s3_server.env().items():  # what the operator sets from spec.output on rank 0
        monkeypatch.setenv(name, value)
    uri = f"s3://{s3_bucket}/runs/tiny"
    staged = tmp_path / "out" / "tiny"
    assert learner_main.main(run_config(tmp_path, staged, uri)) == EXIT_SUCCEEDED
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.output is not None and report.output.uri == uri
    assert report.message.endswith(f"; model exported to {uri}")
    downloaded = tmp_path / "downloaded"
    manifest = download_folder(parse_uri(uri, "output.uri"), downloaded, client=s3_server.client())
    manifest_bytes = (downloaded / EXPORT_MANIFEST_FILE).read_bytes()
    assert hashlib.sha256(manifest_bytes).hexdigest() == report.output.sha256
    assert report.output.bytes == sum(entry["bytes"] for entry in manifest["files"]) + len(manifest_bytes)
    assert verify_export(downloaded)["run"] == {"name": "tiny", "namespace": "default"}
    assert AutoModelForCausalLM.from_pretrained(downloaded).config.vocab_size > 0  # the model itself, loadable


@pytest.mark.s3
@pytest.mark.parametrize(("where", "keys", "cause"), [
    ("bucket", {}, "the bucket 'no-such-bucket' does not exist"),
    ("credentials", {"access_key": "nobody"}, "the access key (AWS_ACCESS_KEY_ID) is not known to the object store"),
    ("credentials", {"secret_key": "wrong-secret-0123456789"},
     "the secret key (AWS_SECRET_ACCESS_KEY) does not match the access key"),
])
def test_an_upload_that_fails_ends_the_learner_as_export_failed_naming_the_cause(
        tmp_path, learner, monkeypatch, s3_server, s3_bucket, where, keys, cause):
    for name, value in s3_server.env(**keys).items():
        monkeypatch.setenv(name, value)
    bucket = "no-such-bucket" if where == "bucket" else s3_bucket
    uri = f"s3://{bucket}/runs/tiny"
    assert learner_main.main(run_config(tmp_path, tmp_path / "out" / "tiny", uri)) == EXIT_EXPORT_FAILED
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED and report.output is None
    assert report.message.startswith(f"could not upload the model: s3://{bucket}/runs/"), report.message
    assert cause in report.message and "\n" not in report.message, report.message


def test_an_unreachable_endpoint_ends_the_learner_as_export_failed_naming_it(tmp_path, learner, monkeypatch):
    from tests.support.ports import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    uri = "s3://models/runs/tiny"
    assert learner_main.main(run_config(tmp_path, tmp_path / "out" / "tiny", uri)) == EXIT_EXPORT_FAILED
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message == f"could not upload the model: s3://models/runs/tiny/{EXPORT_MANIFEST_FILE}: " \
        f"cannot reach the object store at {endpoint}"


def test_a_run_config_with_a_bad_object_store_uri_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"output\.uri\n.*'s3://models/a/\.\./b' is not an object store URI"):
        run_config(tmp_path, tmp_path / "out" / "tiny", "s3://models/a/../b")


#: A learner process at its end (FinishedLearner), as the pod runs one: the entrypoint's SIGTERM handling and exit.
FINISHED_LEARNER_PROCESS = """
import sys
from grpo_trainer.__main__ import exit_with
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.learner import main as learner_main, preemption
from tests.trainer.storage.test_final_model import FinishedLearner
preemption.install()
learner_main.build_learner = lambda *args, **kwargs: FinishedLearner()
exit_with(learner_main.main(RunConfig.model_validate_json(open(sys.argv[1]).read())))
"""
#: How long the stand-in learner may take to import what a learner imports and reach its upload.
REACH_UPLOAD_TIMEOUT_S = 300


@pytest.mark.slow  # a learner process: torch, transformers and TRL imported
def test_a_sigterm_during_a_stuck_upload_ends_the_learner_preempted_within_the_grace_period_keeping_the_export(
        tmp_path):
    # An object store that takes the connection and never answers: boto3 waits 60 s per request, 3 attempts, and the
    # learner outlived the pod's grace period (the kubelet's SIGKILL: 137, no termination message, read as a crash).
    store = socket.create_server(("127.0.0.1", 0))
    reached = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(store.accept()[0])
            except OSError:  # closed at the end of the test
                return
            reached.set()

    threading.Thread(target=accept, daemon=True).start()
    model_dir = tmp_path / "models" / "tiny"
    uri = "s3://models/runs/tiny"
    config_path = tmp_path / "run.json"
    config_path.write_text(run_config(tmp_path, model_dir, uri).model_dump_json(by_alias=True))
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{store.getsockname()[1]}",
           "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret"}
    with open(tmp_path / "learner.log", "wb") as log:
        learner = subprocess.Popen([sys.executable, "-c", FINISHED_LEARNER_PROCESS, str(config_path)], cwd=REPO,
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        waited = 0.0
        while not reached.wait(0.5) and learner.poll() is None and waited < REACH_UPLOAD_TIMEOUT_S:
            waited += 0.5
        assert reached.is_set(), (tmp_path / "learner.log").read_text(errors="replace")[-4000:]
        learner.send_signal(signal.SIGTERM)
        code = learner.wait(timeout=LEARNER_TERMINATION_GRACE_S)
    finally:
        learner.kill()
        learner.wait()
        store.close()
        for connection in held:
            connection.close()
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_PREEMPTED, log[-4000:]
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.PREEMPTED and report.output is None
    assert report.message == (f"the upload of the model to {uri} did not finish: SIGTERM arrived during it; the "
                              f"exported model is kept at {model_dir}"), report.message
    verify_export(model_dir)  # the local export is whole
