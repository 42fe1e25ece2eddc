"""`grporun local` on the higher/lower game: the tiny tool model, taught to read the game's answers mostly backwards,
served by the real vLLM CPU server and trained by the real learner against the real game server, ends at its bound
with every episode scored by the game, and learns to go where the answers point: its right-answer rate rises over the
run, both as a user reads it (the learner's logged `rewards/HigherLowerEnvironment`: the game pays 1.0 for a right
guess, nothing else) and in the server's tallies over every episode. Long (marker `long`): it trains four times the
guess game's episodes; the game's rules and factory are checked in `make test`
(tests/trainer/agentic/test_higher_lower_env.py), its tool model's teaching too
(tests/trainer/agentic/test_tiny_tool_model.py), and the agentic run itself on the guess game
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
TALLIES = re.compile(r"higher-lower environment: (\d+) episodes scored, right [\d.]+ \((\d+)\), second guesses that"
                     r" followed the answer [\d.]+ \((\d+)/(\d+)\)")

#: A hang guard only: the run ends at its bound (measured: BENCHMARKS.md, "The higher/lower game").
RUN_GUARD_S = 2400

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.long]


def second_guess_given(model_dir: str, answer: str) -> dict[int, float]:
    """The taught model's second guess after a first guess of 2 answered `answer`: P(number), teacher-forced."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer.testing.tiny_assets import _higher_lower_schema, guess_call, guess_prompts, tool_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = guess_prompts(tiny_models.HIGHER_LOWER_PROMPTS)[0]["prompt"]
    conversation = [{"role": "user", "content": prompt}, guess_call(2),
                    {"role": "tool", "name": "guess", "content": answer}, guess_call(2)]
    ids = tokenizer.apply_chat_template(conversation, tools=_higher_lower_schema(), return_dict=True,
                                        chat_template=tool_chat_template(tokenizer))["input_ids"]
    digits = {n: tokenizer.convert_tokens_to_ids(str(n)) for n in (1, 2, 3)}
    second = len(ids) - 1 - ids[::-1].index(digits[2])  # the second call's number
    with torch.no_grad():
        probabilities = model(torch.tensor([ids[:second]])).logits[0, -1].softmax(-1)
    return {n: probabilities[token].item() for n, token in digits.items()}


@pytest.mark.timeout(RUN_GUARD_S + 60)
def test_a_higher_lower_run_learns_to_go_where_the_answers_point(tiny_higher_lower_model_dir, tmp_path):
    # As taught, the model reads the answer, backwards mostly: after "higher" it guesses 1 more than 3, after "lower"
    # 3 more than 1.
    after_higher = second_guess_given(tiny_higher_lower_model_dir, "higher")
    after_lower = second_guess_given(tiny_higher_lower_model_dir, "lower")
    assert after_higher[1] > 2 * after_higher[3] and after_lower[3] > 2 * after_lower[1], (after_higher, after_lower)

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
    scored, right, followed, seconds = (int(count) for count in tallies[-1])
    assert 0 < right < scored and followed <= seconds <= scored, tallies
    # Learned: the rate rises over the run, as the learner logs it (the least-squares line through every step) and
    # over every episode the server scored (the right answers of its last quarter against its first, from the
    # cumulative tallies every 64 episodes). Measured: slopes +0.0009 and +0.0029 per step, quarters 0.42 -> 0.52 and
    # 0.37 -> 0.55 (BENCHMARKS.md).
    assert slope > 0, (rates, slope)
    quarter = len(tallies) // 4
    right_so_far = [int(right) for _, right, _, _ in tallies]
    assert quarter >= 1 and right_so_far[-1] - right_so_far[-1 - quarter] > right_so_far[quarter - 1], tallies
