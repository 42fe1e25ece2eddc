"""`grporun validate MANIFEST...`: `OK PATH` per good manifest, one line per problem naming the file and field,
exit 1 on any problem and never a traceback; in-process and as the installed command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_operator import cli
from grpo_operator.manifest import load_manifest
from tests.support.paths import MANIFEST_FIXTURES as FIXTURES

GOOD_FIXTURES = sorted(FIXTURES.glob("*.yaml"))


def good() -> dict:
    return load_manifest(FIXTURES / "full-gpu.yaml")


@pytest.fixture
def bad_manifest(tmp_path) -> Path:
    manifest = good()
    manifest["spec"]["trainning"] = manifest["spec"].pop("training")
    manifest["spec"]["rollout"]["vllm"]["maxModelLen"] = 512
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_validate_ok(capsys):
    paths = [str(path) for path in GOOD_FIXTURES]
    assert cli.main(["validate", *paths]) == 0
    assert capsys.readouterr().out.splitlines() == [f"OK {path}" for path in paths]


def test_validate_reports_each_problem_and_exits_1(capsys, bad_manifest, tmp_path):
    missing = tmp_path / "missing.yaml"
    good_path = str(FIXTURES / "minimal.yaml")
    assert cli.main(["validate", str(bad_manifest), str(missing), good_path]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)",
        f"{bad_manifest}: spec.rollout.vllm.maxModelLen: must be greater than training.maxCompletionLength "
        "(the prompt needs room in the context too)",
        f"cannot read {missing}: No such file or directory",
        f"OK {good_path}",
    ]
    assert "Traceback" not in out.err


def test_validate_as_a_subprocess(bad_manifest):
    grporun = Path(sys.executable).parent / "grporun"
    ok = subprocess.run([grporun, "validate", FIXTURES / "minimal.yaml"], capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"OK {FIXTURES / 'minimal.yaml'}\n", "")
    bad = subprocess.run([grporun, "validate", bad_manifest], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr == ""
    assert bad.stdout.splitlines()[0] == f"{bad_manifest}: spec.trainning: unknown field (did you mean training?)"


def test_validate_refuses_nccl_weight_sync_from_several_learner_ranks(capsys, tmp_path):
    manifest = good()
    manifest["spec"]["rollout"]["weightSync"] = {"mode": "nccl"}  # the learner has 2 nodes x 8 processes
    path = tmp_path / "nccl.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert cli.main(["validate", str(path)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{path}: spec.rollout.weightSync.mode: must be filesystem when the learner has more "
                           "than one process (learner.nodes x learner.processesPerNode)")
