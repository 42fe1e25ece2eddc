"""`grporun local` on the higher/lower game: the tiny tool model, taught to guess but not to use the game's answers,
served by the real vLLM CPU server and trained by the real learner against the real game server, ends at its bound
with every episode scored by the game, and the right-answer rate is where a user looks for it: the learner's logged
`rewards/HigherLowerEnvironment` (the game pays 1.0 for a right guess, nothing else) and the server's tallies. The
rate does not rise measurably in a run of this length (BENCHMARKS.md, "The higher/lower game"), so no rise is
asserted; the test prints the run's curve. Long (marker `long`): it trains twice the guess game's episodes; the game's
rules and factory are checked in `make test` (tests/trainer/agentic/test_higher_lower_env.py), its tool model's
teaching too (tests/trainer/agentic/test_tiny_tool_model.py), and the agentic run itself on the guess game
(tests/operator/cli/test_local_agentic.py)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time

import pytest
import yaml

from grpo_trainer.contract.report import parse_progress
from tests.support import tiny_models
from tests.support.paths import REPO
from tests.support.servers.vllm_server import EAGER_VLLM_ARGS

MANIFEST = REPO / "examples" / "tiny-higher-lower.yaml"
GRPORUN = [sys.executable, "-m", "grpo_operator.cli", "local"]
TALLIES = re.compile(r"higher-lower environment: (\d+) episodes scored, right ([\d.]+), second guesses that followed"
                     r" the answer ([\d.]+) \((\d+)/(\d+)\)")

#: A hang guard only: the run ends at its bound (measured: BENCHMARKS.md, "The higher/lower game").
RUN_GUARD_S = 2400

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.long]


@pytest.mark.timeout(RUN_GUARD_S + 60)
def test_a_higher_lower_run_plays_to_the_bound_and_logs_its_right_answer_rate(tiny_higher_lower_model_dir, tmp_path):
    manifest = yaml.safe_load(MANIFEST.read_text())
    manifest["spec"]["model"] = tiny_higher_lower_model_dir
    manifest["spec"]["dataset"]["path"] = str(tiny_models.HIGHER_LOWER_PROMPTS)
    manifest["spec"]["rollout"]["vllm"]["extraArgs"] = list(EAGER_VLLM_ARGS)
    path = tmp_path / "higher-lower.yaml"
    path.write_text(yaml.safe_dump(manifest))
    started = time.monotonic()
    result = subprocess.run(
        [*GRPORUN, str(path), "--runs-dir", str(tmp_path / "runs"), "--poll-interval", "0.5"],
        capture_output=True, text=True, timeout=RUN_GUARD_S, cwd=tmp_path,
    )
    wall_s = time.monotonic() - started
    run_dir = tmp_path / "runs" / "tiny-higher-lower"
    learner_log = (run_dir / "logs" / "tiny-higher-lower-learner-0.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + learner_log[-3000:]
    assert "phase: Succeeded  reason: EpochBoundReached" in result.stdout
    report = parse_progress((run_dir / "termination-log").read_text())
    episodes = report.episodes
    assert episodes is not None and episodes.environment_failures == {} and episodes.tool_calls > 0

    # The right-answer rate per step, as the learner logs it (the mean of the game's reward over the step's groups).
    rates = [float(value) for value in re.findall(r"'rewards/HigherLowerEnvironment': '([^']+)'", learner_log)]
    tenth = max(1, len(rates) // 10)
    first, last = statistics.fmean(rates[:tenth]), statistics.fmean(rates[-tenth:])
    slope = statistics.linear_regression(range(len(rates)), rates).slope
    server_log = (run_dir / "logs" / "tiny-higher-lower-env-higher-lower-0.log").read_text()
    tallies = TALLIES.findall(server_log)
    print(f"higher-lower run: {len(rates)} steps in {wall_s:.0f} s; right-answer rate {first:.3f} in the first tenth,"
          f" {last:.3f} in the last; slope {slope:.5f} per step; server tallies {tallies}")
    assert len(rates) >= 10 and all(0.0 <= rate <= 1.0 for rate in rates), rates
    # The server's tallies, every 64 episodes it scored, add up: the second guesses within the episodes, those that
    # followed the answer within the second guesses.
    assert tallies, server_log
    (scored, right, _, followed, seconds) = tallies[-1]
    assert 0.0 < float(right) < 1.0 and int(followed) <= int(seconds) <= int(scored), tallies
