"""`grporun local` with a rollout server whose weight update never answers: the run ends Stalled/WeightSyncStuck at
the weight-sync deadline, not at the sync's own request timeouts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from grpo_trainer.contract.codes import EXIT_STALLED
from tests.support.paths import COMPLETIONS_SERVER, REPO

pytestmark = pytest.mark.slow

TINY = REPO / "examples" / "tiny.yaml"
SERVER = str(COMPLETIONS_SERVER)
GRPORUN = [sys.executable, "-m", "grpo_operator.cli", "local"]


def test_a_weight_sync_that_hangs_ends_the_local_run_as_stalled_weight_sync_stuck(
        tmp_path, tiny_model_dir, update_never_answered):
    deadline = 15
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["model"] = tiny_model_dir
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    manifest["spec"]["rollout"]["weightSync"]["deadlineSeconds"] = deadline
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(manifest))
    started = time.monotonic()
    result = subprocess.run(
        [*GRPORUN, str(path), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", update_never_answered,
         "--poll-interval", "0.5"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    took = time.monotonic() - started
    log = (tmp_path / "runs" / "tiny" / "logs" / "tiny-learner-0.log").read_text(errors="replace")
    assert result.returncode != 0, result.stdout + log[-3000:]
    assert "phase: Failed  reason: WeightSyncStuck" in result.stdout, result.stdout + log[-3000:]
    assert "weight sync stuck: still running after" in result.stdout
    assert "grpo learner: Stalled: weight sync stuck" in log
    # The sync's own request timeout is 300 s: the deadline, not that, ended it (start-up takes the rest).
    assert took < 300, took
    assert f"exited with code {EXIT_STALLED}" in result.stdout
