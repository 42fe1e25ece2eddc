"""The export alone, again (grpo_trainer.storage.reexport, `python -m grpo_trainer export`, `grporun export`): a run
whose export failed keeps its checkpoints, and its model is exported from the newest complete one, to a folder or to the
real S3-compatible server (tests/support/servers/s3_server.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from grpo_operator.cli import main as grporun
from grpo_trainer.contract.codes import EXIT_EXPORT_FAILED, EXIT_SUCCEEDED, EXPORT_MANIFEST_FILE
from grpo_trainer.contract.config import (
    CheckpointConfig,
    DatasetConfig,
    OutputConfig,
    RewardConfig,
    RunConfig,
    load_run_config,
)
from grpo_trainer.contract.store_uri import parse_uri
from grpo_trainer.learner.checkpoints import write_marker
from grpo_trainer.progress import RolloutProgress
from grpo_trainer.storage.model_export import ExportError, verify_export
from grpo_trainer.storage.object_store import download_folder
from grpo_trainer.storage.reexport import export_from_checkpoint

TRAINING_STATE = {"optimizer.pt": b"o" * 100, "scheduler.pt": b"s", "rng_state.pth": b"r",
                  "training_args.bin": b"a"}


def checkpoint(directory: Path, model: Path, step: int) -> Path:
    """A complete checkpoint as the learner leaves one: the model's files beside the trainer's state, the marker
    last."""
    folder = directory / f"checkpoint-{step}"
    shutil.copytree(model, folder)
    for name, data in TRAINING_STATE.items():
        (folder / name).write_bytes(data)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [
        {"step": step, "reward": 0.5}]}))
    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=4, epochs=1)
    progress.train([0, 1, 2, 3])
    write_marker(str(folder), {**progress.checkpoint_state().to_dict(), "model_version": step, "global_step": step})
    return folder


def run_dir(tmp_path: Path, tiny_model_dir, uri: str | None, output: dict | None = None) -> Path:
    folder = tmp_path / "runs" / "tiny"
    checkpoints = folder / "checkpoints"
    checkpoint(checkpoints, Path(tiny_model_dir), 4)
    checkpoint(checkpoints, Path(tiny_model_dir), 8)
    (checkpoints / "checkpoint-12").mkdir()  # interrupted while saving: no marker
    config = RunConfig(
        run_name="tiny", model="m", dataset=DatasetConfig(path="p.jsonl"), rewards=[RewardConfig(name="constant")],
        checkpoint=CheckpointConfig(directory=str(checkpoints)),
        output=None if uri is None else OutputConfig(directory=str(folder / "model"), uri=uri,
                                                        run_spec={"model": "m", "output": output or {}}))
    (folder / "run.json").write_text(config.model_dump_json(by_alias=True))
    return folder


def _config(folder: Path) -> RunConfig:
    return load_run_config((folder / "run.json").read_text())


def test_the_newest_complete_checkpoints_model_is_exported_without_the_training_state(tmp_path, tiny_model_dir):
    folder = run_dir(tmp_path, tiny_model_dir, uri=(tmp_path / "runs" / "tiny" / "model").as_uri())
    exported = export_from_checkpoint(_config(folder))
    manifest = verify_export(folder / "model")
    assert exported.step == manifest["step"] == 8 and manifest["progress"]["checkpoint"] == "checkpoint-8"
    files = {entry["path"] for entry in manifest["files"]}
    assert {path.name for path in Path(tiny_model_dir).iterdir()} | {"README.md"} == files
    assert not files & {*TRAINING_STATE, "trainer_state.json", "grpo_progress.json"}
    assert manifest["spec"] == {"model": "m", "output": {}} and manifest["run"]["name"] == "tiny"
    assert hashlib.sha256((folder / "model" / EXPORT_MANIFEST_FILE).read_bytes()).hexdigest() == exported.sha256


def test_without_an_output_or_a_checkpoint_the_export_names_what_is_missing(tmp_path, tiny_model_dir):
    with pytest.raises(ExportError, match=r"^output: the run has no spec.output"):
        export_from_checkpoint(_config(run_dir(tmp_path / "a", tiny_model_dir, uri=None)))
    folder = run_dir(tmp_path / "b", tiny_model_dir, uri="file:///models/tiny")
    shutil.rmtree(folder / "checkpoints")
    with pytest.raises(ExportError, match=r"^checkpoint.directory .*: no complete checkpoint to export the model from"):
        export_from_checkpoint(_config(folder))


@pytest.mark.s3
def test_grporun_export_uploads_a_failed_runs_model_and_names_a_refusal(s3_server, s3_bucket, tiny_model_dir,
                                                                        tmp_path, monkeypatch, capsys):
    uri = f"s3://{s3_bucket}/runs/tiny"
    folder = run_dir(tmp_path, tiny_model_dir, uri=uri, output={"uri": uri, "endpoint": s3_server.endpoint})
    keys = {name: value for name, value in s3_server.env(secret_key="wrong-secret").items()
            if name != "AWS_ENDPOINT_URL_S3"}
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    assert grporun(["export", str(folder)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"grporun export: could not upload the model: s3://{s3_bucket}/")
    assert "the secret key (AWS_SECRET_ACCESS_KEY) does not match" in error and "\n" not in error

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.env()["AWS_SECRET_ACCESS_KEY"])
    assert grporun(["export", str(folder)]) == 0
    printed = capsys.readouterr().out
    manifest = download_folder(parse_uri(uri, "output.uri"), tmp_path / "downloaded", client=s3_server.client())
    digest = hashlib.sha256((tmp_path / "downloaded" / EXPORT_MANIFEST_FILE).read_bytes()).hexdigest()
    assert printed.startswith(f"model: {uri} (step 8, ") and f"manifest sha256 {digest}" in printed
    assert manifest["step"] == 8 and "optimizer.pt" not in {entry["path"] for entry in manifest["files"]}


def test_the_pods_export_entrypoint_exports_or_exits_74_naming_why(tmp_path, tiny_model_dir, capsys):
    from grpo_trainer.__main__ import main as entry_main

    folder = run_dir(tmp_path, tiny_model_dir, uri="pvc://models/tiny")
    assert entry_main(["export", "--config", str(folder / "run.json")]) == EXIT_SUCCEEDED
    assert capsys.readouterr().out.startswith("grpo export: model exported to pvc://models/tiny (step 8, ")
    verify_export(folder / "model")
    assert entry_main(["export", "--config", str(folder / "run.json"), "--checkpoint",
                       str(folder / "checkpoints" / "checkpoint-12")]) == EXIT_EXPORT_FAILED
    assert capsys.readouterr().err.startswith(f"grpo export: {folder / 'checkpoints' / 'checkpoint-12'}: ")


def test_the_pods_export_entrypoint_leaves_its_report_or_its_error_as_the_termination_message(tmp_path,
                                                                                             tiny_model_dir):
    from grpo_trainer.__main__ import main as entry_main
    from grpo_trainer.contract.report import ExportReport

    folder = run_dir(tmp_path, tiny_model_dir, uri="pvc://models/tiny")
    message = tmp_path / "termination-log"
    config = _config(folder).model_copy(update={"termination_message_path": str(message)})
    (folder / "run.json").write_text(config.model_dump_json(by_alias=True))
    assert entry_main(["export", "--config", str(folder / "run.json")]) == EXIT_SUCCEEDED
    report = ExportReport.model_validate_json(message.read_text())
    manifest = (folder / "model" / EXPORT_MANIFEST_FILE).read_bytes()
    assert (report.uri, report.step, report.sha256) == ("pvc://models/tiny", 8, hashlib.sha256(manifest).hexdigest())

    shutil.rmtree(folder / "checkpoints")
    assert entry_main(["export", "--config", str(folder / "run.json")]) == EXIT_EXPORT_FAILED
    assert message.read_text().startswith("grpo export: checkpoint.directory ")
    assert message.read_text().endswith(": no complete checkpoint to export the model from")


@pytest.mark.s3
def test_a_pod_without_the_checkpoint_exports_the_newest_one_in_checkpoint_uri(s3_server, s3_bucket, tiny_model_dir,
                                                                               tmp_path, monkeypatch):
    from grpo_trainer.learner.checkpoint_store import CheckpointStore

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    store_uri = f"s3://{s3_bucket}/checkpoints/tiny"
    uploaded = tmp_path / "uploaded"
    store = CheckpointStore(parse_uri(store_uri, "checkpoint.uri"), keep=2, client=s3_server.client())
    store.upload(str(checkpoint(uploaded, Path(tiny_model_dir), 4)))
    store.upload(str(checkpoint(uploaded, Path(tiny_model_dir), 8)))
    folder = run_dir(tmp_path, tiny_model_dir, uri="pvc://models/tiny")
    shutil.rmtree(folder / "checkpoints")  # a new pod's emptyDir
    config = _config(folder)
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"uri": store_uri})})
    exported = export_from_checkpoint(config)
    assert exported.step == 8 and verify_export(folder / "model")["progress"]["checkpoint"] == "checkpoint-8"

    empty = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"uri": f"s3://{s3_bucket}/checkpoints/none", "directory": str(tmp_path / "empty")})})
    with pytest.raises(ExportError, match=r"^checkpoint.directory .* and checkpoint.uri s3://.*/checkpoints/none: no "):
        export_from_checkpoint(empty)
