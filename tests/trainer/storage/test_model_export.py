"""The model export: whole or not at all, a manifest whose digests match the files, and failures that name the path."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from grpo_trainer.contract.codes import EXPORT_MANIFEST_FILE
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.report import ExportReport
from grpo_trainer.storage.model_export import (
    MODEL_CARD_FILE,
    ExportError,
    export_model,
    input_provenance,
    model_card,
    reward_trend,
    staging_path,
    verify_export,
)

PROVENANCE = {
    "run": {"name": "tiny", "namespace": "default"},
    "spec": {"model": "Qwen/Qwen3-0.6B", "rewards": [{"name": "letter_a_fraction"}]},
    "progress": {"groupsConsumed": 16, "groupsTrained": 12, "dropped": {"no_signal": 4},
                 "rewardTrend": [{"step": 1, "reward": 0.1}, {"step": 4, "reward": 0.5}]},
    "packages": {"torch": "2.9.0"},
}


def write_model(folder: Path, weights: bytes = b"weights" * 1000) -> None:
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.json").write_text("{}")


def export(directory: Path, save=write_model) -> ExportReport:
    return export_model(directory, save, PROVENANCE, uri="file:///models/tiny", step=4, clock=lambda: 1700000000.0)


def test_an_export_lists_every_file_with_its_digest_and_reports_the_manifests(tmp_path):
    directory = tmp_path / "models" / "tiny"
    report = export(directory)
    manifest_bytes = (directory / EXPORT_MANIFEST_FILE).read_bytes()
    manifest = json.loads(manifest_bytes)
    assert {entry["path"] for entry in manifest["files"]} == {
        "model.safetensors", "config.json", "tokenizer/vocab.json", MODEL_CARD_FILE}
    for entry in manifest["files"]:
        data = (directory / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
    assert manifest["spec"] == PROVENANCE["spec"] and manifest["progress"] == PROVENANCE["progress"]
    assert manifest["step"] == 4 and manifest["exportedAt"] == "2023-11-14T22:13:20Z"
    assert report.sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    assert report.bytes == sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    assert (report.uri, report.path, report.step) == ("file:///models/tiny", str(directory), 4)
    assert "letter_a_fraction" in (directory / MODEL_CARD_FILE).read_text()
    assert verify_export(directory) == manifest
    assert not staging_path(directory).exists()


def test_a_changed_or_extra_file_fails_verification(tmp_path):
    directory = tmp_path / "tiny"
    export(directory)
    (directory / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="config.json does not match"):
        verify_export(directory)
    export(directory)
    (directory / "stray.bin").write_bytes(b"x")
    with pytest.raises(ExportError, match="stray.bin is not in the manifest"):
        verify_export(directory)


def test_a_second_export_replaces_the_first_whole(tmp_path):
    directory = tmp_path / "tiny"
    export(directory, save=lambda folder: write_model(folder, b"old"))
    export(directory, save=lambda folder: write_model(folder, b"new"))
    assert (directory / "model.safetensors").read_bytes() == b"new"
    verify_export(directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # nothing staged or set aside is left


KILLED_EXPORT = """
import os, signal, sys
from pathlib import Path
from grpo_trainer.storage.model_export import export_model

def save(folder):
    (folder / "model.safetensors").write_bytes(b"half a model")
    os.kill(os.getpid(), signal.SIGKILL)  # killed halfway: the pod's OOM kill, a node going away

export_model(Path(sys.argv[1]), save, {}, uri="file:///x", step=1)
"""


def test_a_killed_export_leaves_no_folder_that_reads_as_complete(tmp_path):
    directory = tmp_path / "tiny"
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(directory)], capture_output=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert not directory.exists()
    assert (staging_path(directory) / "model.safetensors").is_file()  # what it wrote is set apart and incomplete
    with pytest.raises(ExportError, match="not a complete export"):
        verify_export(directory)
    export(directory)  # the next export removes it
    verify_export(directory)
    assert not staging_path(directory).exists()


def test_a_killed_reexport_keeps_the_earlier_complete_model(tmp_path):
    directory = tmp_path / "tiny"
    export(directory)
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(directory)], capture_output=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert verify_export(directory)["step"] == 4


def test_a_target_that_is_no_folder_fails_naming_the_path(tmp_path):
    (tmp_path / "models").write_text("a file where the volume's folder should be")
    directory = tmp_path / "models" / "tiny"
    with pytest.raises(ExportError) as raised:
        export(directory)
    assert str(raised.value) == f"could not export the model to {directory}: File exists ({tmp_path / 'models'})"


def test_a_writer_error_of_its_own_type_is_an_export_failure_and_leaves_nothing(tmp_path):
    class SafetensorError(Exception):
        pass

    def save(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"x")
        raise SafetensorError("Error while serializing: IoError(StorageFull)")

    directory = tmp_path / "tiny"
    with pytest.raises(ExportError) as raised:
        export(directory, save=save)
    cause = "Error while serializing: IoError(StorageFull)"
    assert str(raised.value) == f"could not export the model to {directory}: {cause}"
    assert list(tmp_path.iterdir()) == []


ON_A_SMALL_VOLUME = """
import sys
from pathlib import Path
from grpo_trainer.storage.model_export import ExportError, export_model

def save(folder):
    (folder / "model.safetensors").write_bytes(b"w" * 1_000_000)

try:
    export_model(Path(sys.argv[1]) / "tiny", save, {}, uri="file:///x", step=1)
except ExportError as error:
    print(error)
    sys.exit(3)
"""


def _on_tmpfs(tmp_path: Path, options: str) -> subprocess.CompletedProcess:
    """The export script run in a private mount namespace with a real tmpfs at `tmp_path/volume` (gone with it)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs mount namespaces (unshare -m) to mount a real small or read-only volume")
    volume = tmp_path / "volume"
    volume.mkdir()
    script = textwrap.dedent(f"""
        mount -t tmpfs -o {options} tmpfs {volume} || exit 99
        exec {sys.executable} -c '{ON_A_SMALL_VOLUME}' {volume}
    """)
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    if result.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    return result


def test_a_full_volume_fails_the_export_naming_the_path_and_the_cause(tmp_path):
    result = _on_tmpfs(tmp_path, "size=64k")
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"could not export the model to {tmp_path / 'volume' / 'tiny'}: No space left on device" in result.stdout


def test_a_read_only_volume_fails_the_export_naming_the_path_and_the_cause(tmp_path):
    result = _on_tmpfs(tmp_path, "ro,size=64k")
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"could not export the model to {tmp_path / 'volume' / 'tiny'}: Read-only file system" in result.stdout


def test_the_reward_trend_keeps_the_first_and_last_points_and_skips_non_finite_ones():
    history = [{"step": step, "reward": step / 100} for step in range(1, 101)]
    history += [{"step": 101, "reward": float("nan")}, {"step": 102, "loss": 1.0}]
    trend = reward_trend(history, points=5)
    assert [point["step"] for point in trend] == [1, 26, 51, 75, 100]
    assert reward_trend(history[:3]) == [{"step": 1, "reward": 0.01}, {"step": 2, "reward": 0.02},
                                        {"step": 3, "reward": 0.03}]


def test_the_model_card_has_hugging_face_front_matter_naming_the_base_model_and_dataset(tmp_path):
    spec = {"model": "Qwen/Qwen3-0.6B", "dataset": {"name": "openai/gsm8k", "config": "main"}}
    config = RunConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "modelRevision": "c" * 40,
                                       "dataset": {"name": "openai/gsm8k", "revision": "d" * 40},
                                       "rewards": [{"name": "length"}]})
    provenance = {**PROVENANCE, "spec": spec, **input_provenance(spec, config, dataset_fingerprint="f00d")}
    assert provenance["base"] == {"model": "Qwen/Qwen3-0.6B", "revision": "c" * 40}
    assert provenance["dataset"] == {"name": "openai/gsm8k", "config": "main", "revision": "d" * 40,
                                     "fingerprint": "f00d"}
    (tmp_path / MODEL_CARD_FILE).write_text(model_card(provenance, step=4))
    card = ModelCard.load(tmp_path / MODEL_CARD_FILE)  # what the hub and model registries parse
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and card.data.base_model_relation == "finetune"
    assert card.data.datasets == ["openai/gsm8k"] and card.data.library_name == "transformers"
    assert set(card.data.tags) == {"grpo", "trl", "grpo-operator"}
    assert f"at commit `{'c' * 40}`" in card.text


def test_a_local_model_and_dataset_file_are_named_by_path_and_the_file_by_its_digest(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    # The spec names the store's object; the learner read the downloaded copy.
    spec = {"model": "/models/tiny", "dataset": {"path": "s3://data/prompts.jsonl"}}
    config = RunConfig.model_validate({"model": "/models/tiny", "dataset": {"path": str(prompts)},
                                       "rewards": [{"name": "length"}]})
    provenance = {**PROVENANCE, "spec": spec, **input_provenance(spec, config)}
    assert provenance["base"] == {"model": "/models/tiny"}
    assert provenance["dataset"] == {"path": "s3://data/prompts.jsonl",
                                     "sha256": hashlib.sha256(prompts.read_bytes()).hexdigest()}
    (tmp_path / MODEL_CARD_FILE).write_text(model_card(provenance, step=4))
    card = ModelCard.load(tmp_path / MODEL_CARD_FILE)
    assert card.data.base_model is None and card.data.datasets is None  # not hub ids: nothing to link
    assert "grpo" in card.data.tags

