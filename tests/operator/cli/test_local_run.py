"""`grporun local` end to end: the tiny example reaches Succeeded, its learner (`python -m grpo_trainer learner`, as
the pod runs it) ending with the termination message the operator reads, its model exported (to a folder, and to
the S3 test server) and its curves on a real MLflow server; Ctrl-C leaves no process behind."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from mlflow.tracking import MlflowClient

from grpo_trainer.contract.codes import DROP_REASONS, EXPORT_MANIFEST_FILE, LearnerPhase
from grpo_trainer.contract.config import DatasetConfig, InputsConfig, RewardConfig, RunConfig
from grpo_trainer.contract.report import parse_progress
from grpo_trainer.learner.tracking.mlflow_tracker import EXPORT_SHA256_TAG, EXPORT_URI_TAG
from grpo_trainer.storage.inputs import resolve as resolve_inputs
from tests.support.paths import REPO
from tests.support.servers.mlflow_server import MISSING, MLFLOW, check_tracked_run, running_mlflow_server
from tests.support.servers.vllm_server import EAGER_VLLM_ARGS

TINY = REPO / "examples" / "tiny.yaml"
GRPORUN = [sys.executable, "-m", "grpo_operator.cli", "local"]

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def tiny_manifest(tmp_path: Path, model: str, epochs: float, processes: int = 1, save_steps: int | None = None) -> Path:
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["learner"]["processesPerNode"] = processes
    if save_steps is not None:
        manifest["spec"]["checkpoint"]["saveSteps"] = save_steps
    manifest["spec"]["model"] = model  # the session server's model: a reused server serves one model
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    manifest["spec"]["training"]["epochs"] = epochs
    manifest["spec"]["rollout"]["vllm"]["extraArgs"] = list(EAGER_VLLM_ARGS)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_tiny_example_reaches_succeeded(vllm_server, tmp_path):
    assert MLFLOW.exists(), MISSING
    manifest = tiny_manifest(tmp_path, vllm_server.model, epochs=1)
    with_output = yaml.safe_load(manifest.read_text())
    with_output["spec"]["output"] = {"volume": {"hostPath": {"path": str(tmp_path / "models")}}}
    (tmp_path / "mlflow").mkdir()
    with running_mlflow_server(tmp_path / "mlflow") as mlflow:
        with_output["spec"]["tracking"] = {"mlflow": {"trackingUri": mlflow.uri, "experiment": "local-tiny"}}
        manifest.write_text(yaml.safe_dump(with_output))
        mlflow.wait_ready()
        result = subprocess.run(
            [*GRPORUN, str(manifest), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", vllm_server.url,
             "--poll-interval", "0.5"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )
        tracked = None  # read while the server runs; a failed run is reported below, with its logs
        if result.returncode == 0:
            trained = parse_progress((tmp_path / "runs" / "tiny" / "termination-log").read_text()).groups_trained
            tracked = check_tracked_run(mlflow.uri, "local-tiny", "tiny", model=vllm_server.model, epochs=1,
                                        groups_trained=trained)
            tags = MlflowClient(mlflow.uri).get_run(tracked.run_id).data.tags
    run_dir = tmp_path / "runs" / "tiny"
    learner_log = (run_dir / "logs" / "tiny-learner-0.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + learner_log[-3000:]
    assert "phase: Succeeded  reason: EpochBoundReached" in result.stdout
    assert "groups consumed 16/16" in result.stdout
    assert (run_dir / "run.json").is_file()
    # What the operator reads of the learner: its termination message.
    report = parse_progress((run_dir / "termination-log").read_text())
    assert report.phase == LearnerPhase.SUCCEEDED and report.groups_consumed == report.groups_total == 16
    assert set(report.dropped) == set(DROP_REASONS)  # every reason reported, zero or not
    assert report.groups_trained > 0 and report.global_step > 0
    assert report.weight_syncs >= report.global_step  # one sync per step (weightSyncSteps 1) plus the cold one
    assert "AsyncRolloutWorker child is ready" in learner_log  # TRL's own worker generated the rollouts
    # The tracked run, on the real MLflow server: the report names it as the operator's status would.
    assert [(run.tracker, run.run_id) for run in report.tracking] == [("mlflow", tracked.run_id)], report.tracking
    # The model, exported to spec.output's folder with its manifest; the summary says where.
    model_dir = tmp_path / "models" / "tiny"
    assert report.output is not None and report.output.path == str(model_dir)
    assert report.output.step == report.global_step
    assert f"model: {model_dir} (step {report.global_step}, {report.output.bytes} bytes" in result.stdout
    manifest_bytes = (model_dir / EXPORT_MANIFEST_FILE).read_bytes()
    assert hashlib.sha256(manifest_bytes).hexdigest() == report.output.sha256
    export = json.loads(manifest_bytes)
    files = {entry["path"]: entry["sha256"] for entry in export["files"]}
    on_disk = {path.relative_to(model_dir).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
               for path in model_dir.rglob("*") if path.is_file() and path.name != EXPORT_MANIFEST_FILE}
    assert files == on_disk
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
            "README.md"} <= set(files)
    assert export["spec"]["output"] == with_output["spec"]["output"] and export["step"] == report.global_step
    assert export["progress"]["groupsConsumed"] == 16 and set(export["progress"]["dropped"]) == set(DROP_REASONS)
    assert {"torch", "transformers", "trl"} <= set(export["packages"])
    # Its provenance: where it started, the rows it read, the tracker's run; a model card the hub can index.
    assert export["base"] == {"model": vllm_server.model}
    prompts = REPO / "examples" / "tiny-prompts.jsonl"
    assert export["dataset"]["path"] == str(prompts) and export["dataset"]["fingerprint"]
    assert export["dataset"]["sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert export["tracking"] == [run.model_dump(by_alias=True) for run in report.tracking] != []
    assert "grpo-operator" in ModelCard.load(model_dir / "README.md").data.tags
    # The tracked run names the model: a registry finds it from the run.
    assert (tags[EXPORT_URI_TAG], tags[EXPORT_SHA256_TAG]) == (report.output.uri, report.output.sha256)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generated = model.generate(**tokenizer("a", return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert generated.shape[-1] > 1
    assert not (run_dir / "output" / "final").exists()  # the model is where spec.output says, not in the run folder


@pytest.mark.s3
def test_two_learner_processes_under_accelerate_reach_succeeded_and_upload_the_model(vllm_server, tmp_path,
                                                                                     s3_server, s3_bucket):
    manifest = tiny_manifest(tmp_path, vllm_server.model, epochs=1, processes=2)
    uri = f"s3://{s3_bucket}/runs/tiny"
    prompts = REPO / "examples" / "tiny-prompts.jsonl"
    s3_server.client().upload_file(str(prompts), s3_bucket, "data/tiny-prompts.jsonl")
    with_output = yaml.safe_load(manifest.read_text())
    with_output["spec"]["output"] = {"uri": uri, "endpoint": s3_server.endpoint}
    # The prompts come from the store too: both learner processes read them from there.
    with_output["spec"]["dataset"]["path"] = f"s3://{s3_bucket}/data/tiny-prompts.jsonl"
    with_output["spec"]["inputs"] = {"endpoint": s3_server.endpoint}
    # The keys come from this machine's environment, the endpoint from the spec.
    credentials = {name: value for name, value in s3_server.env().items() if name != "AWS_ENDPOINT_URL_S3"}
    cache = tmp_path / "cache"  # grporun local's inputs cache: $XDG_CACHE_HOME/grpo/inputs
    (tmp_path / "mlflow").mkdir()
    with running_mlflow_server(tmp_path / "mlflow") as mlflow:
        with_output["spec"]["tracking"] = {"mlflow": {"trackingUri": mlflow.uri, "experiment": "local-s3"}}
        manifest.write_text(yaml.safe_dump(with_output))
        mlflow.wait_ready()
        result = subprocess.run(
            [*GRPORUN, str(manifest), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", vllm_server.url],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
            env={**os.environ, **credentials, "XDG_CACHE_HOME": str(cache)},
        )
        if result.returncode == 0:  # the tracker records the spec's URI, not the downloaded copy's path
            trained = parse_progress((tmp_path / "runs" / "tiny" / "termination-log").read_text()).groups_trained
            check_tracked_run(mlflow.uri, "local-s3", "tiny", model=vllm_server.model, epochs=1,
                              groups_trained=trained, dataset=with_output["spec"]["dataset"]["path"])
    log = (tmp_path / "runs" / "tiny" / "logs" / "tiny-learner-0.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + log[-3000:]
    assert "accelerate launch" in log  # accelerate's own start-up notice: the ranks ran under it
    assert log.count("grpo learner: Succeeded") == 1  # rank 0 alone reports
    assert "learner world size 2 (this is rank 1)" in log  # two ranks really joined (`--cpu` would run one)
    consumed = re.search(r"groups consumed (\d+)/(\d+), trained (\d+), dropped (\d+)", result.stdout)
    assert consumed is not None, result.stdout
    total, trained, dropped = int(consumed.group(2)), int(consumed.group(3)), int(consumed.group(4))
    # Exactly at the bound with two ranks: groups of the next pass riding in the last micro-batch are not counted.
    assert int(consumed.group(1)) == total == 16 and trained + dropped == total
    # Both ranks saved, rank 0 wrote the folder in the run's own and uploaded it; the summary names the store.
    report = parse_progress((tmp_path / "runs" / "tiny" / "termination-log").read_text())
    assert report.output is not None and report.output.uri == uri
    assert f"model: {uri} (step {report.global_step}, {report.output.bytes} bytes" in result.stdout
    (dataset,) = (cache / "grpo" / "inputs").rglob("tiny-prompts.jsonl")
    assert dataset.read_bytes() == prompts.read_bytes()
    # The export read back as a next run's model would be: through the inputs cache, checked against its manifest.
    config = RunConfig(model=uri, dataset=DatasetConfig(path=str(prompts)), rewards=[RewardConfig(name="length")],
                       inputs=InputsConfig(cache_dir=str(tmp_path / "next"), endpoint=s3_server.endpoint))
    downloaded = Path(resolve_inputs(config, dataset=False, environ=credentials).model)
    assert hashlib.sha256((downloaded / EXPORT_MANIFEST_FILE).read_bytes()).hexdigest() == report.output.sha256
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= {path.name for path in downloaded.iterdir()}
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(downloaded).num_parameters() > 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in the group."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry))
    return members


def test_ctrl_c_stops_the_learner_and_its_rollout_worker(vllm_server, tmp_path):
    manifest = tiny_manifest(tmp_path, vllm_server.model, epochs=50)
    # A terminal's Ctrl-C: SIGINT at its default in grporun, even when this suite runs as a background job (a
    # non-interactive shell starts those with SIGINT ignored, Python then installs no KeyboardInterrupt handler, and
    # the signal was lost: CI's clean-clone run timed out here).
    process = subprocess.Popen(
        [*GRPORUN, str(manifest), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", vllm_server.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    learner_log = tmp_path / "runs" / "tiny" / "logs" / "tiny-learner-0.log"
    deadline = time.monotonic() + 300
    # Wait until TRL's rollout worker (a spawned grandchild) is up, so there is a tree to clean up.
    def learner_output() -> str:
        return learner_log.read_text(errors="replace") if learner_log.exists() else ""

    while "AsyncRolloutWorker child is ready" not in learner_output():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the learner did not start its rollout worker"
        time.sleep(1)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out + err
    assert "interrupted" in err
    learner_pid = int(re.search(r"pid (\d+)", err.replace("\n", " ")).group(1))
    assert not _alive(learner_pid)
    assert _group_members(learner_pid) == []  # the rollout worker went with it


def _learner_child(parent: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == parent and b"learner" in cmdline:
            return int(entry)
    return None


def test_a_crashed_learner_restarts_and_resumes_from_its_checkpoint(vllm_server, tmp_path):
    manifest = tiny_manifest(tmp_path, vllm_server.model, epochs=3, save_steps=3)
    runs = tmp_path / "runs"
    process = subprocess.Popen(
        [*GRPORUN, str(manifest), "--runs-dir", str(runs), "--rollout-url", vllm_server.url, "--poll-interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    checkpoints = runs / "tiny" / "checkpoints"
    deadline = time.monotonic() + 300
    # A complete checkpoint (its progress file is written last); one cut short is skipped on resume (test_checkpoints)
    while not any(checkpoints.glob("checkpoint-*/grpo_progress.json")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.5)
    learner = _learner_child(process.pid)
    assert learner is not None
    os.kill(learner, signal.SIGKILL)  # a crash: no termination message, exit 137-style
    out, err = process.communicate(timeout=900)
    log = (runs / "tiny" / "logs" / "tiny-learner-0.log").read_text(errors="replace")
    assert process.returncode == 0, out + err + log[-3000:]
    assert "Restarting" in err  # the operator's rule: a crash restarts within backoffLimit
    assert "resuming from" in log and "checkpoint-" in log
    assert "phase: Succeeded" in out and "groups consumed 48/48" in out
