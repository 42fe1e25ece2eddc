"""`grporun validate MANIFEST...`: `OK PATH` on stdout per good manifest; on stderr one line per problem naming the
file and field, and warnings for what a cluster run would not do as meant (`--strict` makes them errors); exit 4 on
any problem and never a traceback; in-process and as the installed command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_operator import cli
from grpo_operator.cli.exit_codes import ExitCode
from grpo_operator.manifest import load_manifest
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES
from tests.support.paths import REPO

GOOD_FIXTURES = sorted(FIXTURES.glob("*.yaml"))


def good() -> dict:
    return load_manifest(FIXTURES / "full-gpu.yaml")


def write(tmp_path: Path, manifest: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture
def bad_manifest(tmp_path) -> Path:
    manifest = good()
    manifest["spec"]["trainning"] = manifest["spec"].pop("training")
    manifest["spec"]["rollout"]["vllm"]["maxModelLen"] = 512
    return write(tmp_path, manifest, "bad.yaml")


def test_validate_ok(capsys):
    paths = [str(path) for path in GOOD_FIXTURES]
    assert cli.main(["validate", *paths]) == ExitCode.OK
    assert [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()] == [f"OK {path}" for path in paths]


def test_validate_reports_each_problem_on_stderr_and_exits_4(capsys, bad_manifest, tmp_path):
    missing = tmp_path / "missing.yaml"
    good_path = str(FIXTURES / "full-gpu.yaml")
    assert cli.main(["validate", str(bad_manifest), str(missing), good_path]) == ExitCode.INVALID
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)",
        f"{bad_manifest}: spec.rollout.vllm.maxModelLen: must be greater than training.maxCompletionLength "
        "(the prompt needs room in the context too)",
        f"cannot read {missing}: No such file or directory",
    ]
    assert out.out.splitlines() == [f"OK {good_path}"]
    assert "Traceback" not in out.err


def test_validate_refuses_an_unknown_reward_name_like_local(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["rewards"] = [{"name": "nope"}]
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    assert capsys.readouterr().err.splitlines() == [
        f"{path}: spec.rewards[0].name: unknown reward 'nope'; built-in rewards: accuracy, constant, letter_a_fraction"]


def test_validate_warns_of_a_missing_checkpoint_volume_and_paths_on_this_machine(capsys):
    tiny = str(REPO / "examples" / "tiny.yaml")
    assert cli.main(["validate", tiny]) == ExitCode.OK
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"OK {tiny} (3 warnings)"]
    assert out.err.splitlines() == [
        f"{tiny}: warning: spec.checkpoint.volume: not set: checkpoints live as long as the learner pod, so a "
        "restarted learner starts over",
        f"{tiny}: warning: spec.model: ./tiny-assets/model is a path on this machine: only grporun local resolves it; "
        "a cluster's pods need a hub id or a path on a volume they mount",
        f"{tiny}: warning: spec.dataset.path: ./tiny-prompts.jsonl is a path on this machine: only grporun local "
        "resolves it; a cluster's pods need a hub id or a path on a volume they mount",
    ]
    assert cli.main(["validate", "--strict", tiny]) == ExitCode.INVALID
    gpu = str(REPO / "examples" / "gpu.yaml")  # a checkpoint PVC and a hub model: nothing to warn of
    assert cli.main(["validate", "--strict", gpu]) == ExitCode.OK
    assert capsys.readouterr().err.count("warning") == 3


def test_validate_as_a_subprocess(bad_manifest):
    grporun = Path(sys.executable).parent / "grporun"
    good_path = FIXTURES / "full-gpu.yaml"
    ok = subprocess.run([grporun, "validate", good_path], capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"OK {good_path}\n", "")
    bad = subprocess.run([grporun, "validate", bad_manifest], capture_output=True, text=True, timeout=120)
    assert bad.returncode == ExitCode.INVALID and bad.stdout == ""
    assert bad.stderr.splitlines()[0] == f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)"


def test_validate_refuses_nccl_weight_sync_from_several_learner_ranks(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["rollout"]["weightSync"] = {"mode": "nccl"}  # the learner has 2 nodes x 8 processes
    path = tmp_path / "nccl.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: spec.rollout.weightSync.mode: must be filesystem when the learner has more "
                           "than one process (learner.nodes x learner.processesPerNode)")


def test_validate_refuses_a_lora_adapter_on_the_head_in_one_line(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["training"]["lora"] = {"r": 8, "targetModules": ["q_proj", "lm_head"]}
    path = write(tmp_path, manifest)
    assert cli.main(["validate", str(path)]) == ExitCode.INVALID
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"{path}: spec.training.lora.targetModules: must not name lm_head or embed_tokens: the learner "
                    "scores log-probabilities with the output embedding's base weight, so an adapter there would "
                    "never be scored")
