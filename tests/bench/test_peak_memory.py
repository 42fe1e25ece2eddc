"""bench/peak_memory.py: the learner's entrypoint run under it keeps its exit code, and the rank's peak is
recorded once the learner's main returns (CPU here: no CUDA figures, the resident peak)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.peak_memory import read_peaks
from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG
from tests.support.paths import REPO


def test_the_learners_exit_code_passes_through_and_the_ranks_peak_is_recorded(tmp_path):
    config = tmp_path / "run.json"
    config.write_text('{"model": 3}')
    env = {**os.environ, "RANK": "2", "PYTHONPATH": os.pathsep.join([str(REPO / "trainer_image"), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "bench.peak_memory", str(tmp_path / "peaks"), "learner", "--config",
                           str(config)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_INVALID_CONFIG, done.stderr[-3000:]
    (peak,) = read_peaks(tmp_path / "peaks")
    assert peak.rank == 2 and peak.cuda_allocated is None and peak.cuda_reserved is None
    assert peak.max_rss > 10 * 1024**2  # an interpreter that imported the learner's contract
