"""Launch one instrumented trainer run (bench.learner_run) in its own process and time its exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def learner_run(scratch: Path, label: str, *, kind: str, scenario: str, model: str, wall_bound: float,
                **flags: object) -> dict:
    """The child's record plus `exit_time` (parent clock, same host) and `returncode`."""
    directory = scratch / label
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "run.json"
    command = [sys.executable, "-m", "bench.learner_run", "--kind", kind, "--scenario", scenario, "--model", model,
               "--out", str(out), "--wall-bound", str(wall_bound)]
    for name, value in flags.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    # One intra-op thread: with two on two cores shared with other processes, OpenMP's barrier waits made a tiny
    # model's step take ~2 s instead of ~10 ms (measured), which would swamp every latency here. Same for both kinds.
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(directory / "log.txt", "w") as log:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=wall_bound + 120)
    exit_time = time.time()
    if not out.exists():
        tail = (directory / "log.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{label}: the run wrote no result (exit {done.returncode}):\n{tail}")
    return json.loads(out.read_text()) | {"exit_time": exit_time, "returncode": done.returncode}
