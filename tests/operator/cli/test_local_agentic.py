"""`grporun local` with environments: the tiny tool model (taught offline to call the guess game's tool in a third
of its episodes) served by the real vLLM CPU server, playing the guess game two ways in one run, as the dataset's
`environment` column says row by row:
- over plain HTTP through the example's environment factory (examples/tiny-agentic.yaml), against three game servers;
- over OpenEnv, with no factory (examples/tiny-agentic-openenv.yaml's environment, `protocol: openenv`), against two
  servers built on openenv-core's server library: the learner lists the game's tool from the server and plays each
  episode in a WebSocket session of its own.
grporun local starts every server as a process of its own, each holding the episodes it opened. The run ends at its
bound, the episodes are counted, the group counts add up, the tool calls train, every episode plays on one server
(none fails as the environment's, and every server of both environments plays some), and the environments' reward
rises over the run: the policy learns that playing pays."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys

import pytest
import yaml

from grpo_trainer.contract.report import parse_progress
from grpo_trainer.testing.guess_env import FIRST_EPISODE_LINE
from tests.support import tiny_models
from tests.support.paths import REPO
from tests.support.servers.vllm_server import EAGER_VLLM_ARGS

AGENTIC = REPO / "examples" / "tiny-agentic.yaml"
AGENTIC_OPENENV = REPO / "examples" / "tiny-agentic-openenv.yaml"
GRPORUN = [sys.executable, "-m", "grpo_operator.cli", "local"]
#: How much the environment's reward per step rises over the run, at least, by the least-squares line through every
#: step. Runs rose 0.12 to 0.33 from the first tenth of steps to the last; without a rise to learn the tenths moved by a
#: few hundredths either way. A tenth is two or three steps of about 16 episodes each (noisy): the line through all of
#: them is the firmer measure, and the tenths only have to rise.
REWARD_RISE = 0.05
#: The game's servers: each holds its own episodes, so an episode's calls must all reach the one its reset reached.
GUESS_SERVERS = 3
#: The OpenEnv game's servers: each session (episode) lives on one.
OPENENV_SERVERS = 2

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_an_agentic_run_trains_against_its_environment_servers_over_http_and_openenv_to_the_bound(
        tiny_tool_model_dir, tmp_path):
    manifest = yaml.safe_load(AGENTIC.read_text())
    manifest["spec"]["model"] = tiny_tool_model_dir
    manifest["spec"]["rollout"]["vllm"]["extraArgs"] = list(EAGER_VLLM_ARGS)
    (environment,) = manifest["spec"]["environments"]
    environment["replicas"] = GUESS_SERVERS
    (openenv,) = yaml.safe_load(AGENTIC_OPENENV.read_text())["spec"]["environments"]
    openenv["replicas"] = OPENENV_SERVERS
    manifest["spec"]["environments"].append(openenv)
    # The rows choose their environment by name: every other prompt plays the OpenEnv game.
    training = manifest["spec"]["training"]
    training["environmentFactories"] = {environment["name"]: training.pop("environmentFactory")}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(tiny_models.guess_prompts_played_in_turn((environment["name"], openenv["name"])))
    manifest["spec"]["dataset"]["path"] = str(prompts)
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = subprocess.run(
        [*GRPORUN, str(path), "--runs-dir", str(tmp_path / "runs"), "--poll-interval", "0.5"],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path,
    )
    run_dir = tmp_path / "runs" / "tiny-agentic"
    learner_log = (run_dir / "logs" / "tiny-agentic-learner-0.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + learner_log[-3000:]
    assert "phase: Succeeded  reason: EpochBoundReached" in result.stdout
    for index in range(GUESS_SERVERS):  # every server took episodes: the learner spreads them over the pool
        server_log = (run_dir / "logs" / f"tiny-agentic-env-guess-{index}.log").read_text()
        assert "guess environment serving on" in server_log and FIRST_EPISODE_LINE in server_log, (index, server_log)
    for index in range(OPENENV_SERVERS):  # and every OpenEnv server took sessions
        server_log = (run_dir / "logs" / f"tiny-agentic-env-{openenv['name']}-{index}.log").read_text()
        assert "guess environment (openenv) serving on" in server_log and FIRST_EPISODE_LINE in server_log, (
            index, server_log)
    assert f"environment {openenv['name']!r} (openenv): tools guess" in learner_log  # the server's own tool

    report = parse_progress((run_dir / "termination-log").read_text())
    groups = 8 * manifest["spec"]["training"]["epochs"]
    assert report.groups_consumed == report.groups_total == groups
    assert report.groups_trained + report.dropped_total == groups  # every group once: trained or dropped
    episodes = report.episodes
    assert episodes is not None and episodes.environment_failures == {}  # no episode lost to another server
    # Every group that reached the learner brought its 8 episodes; those past the bound are counted too.
    assert episodes.episodes % 8 == 0 and episodes.episodes >= 8 * (report.groups_trained + report.dropped["no_signal"])
    assert episodes.tool_calls > 0 and episodes.rows >= episodes.episodes  # a fork adds rows; none go missing
    # A tool call, then the closing turn (maxToolCallingIterations 1); or the closing turn alone, without a guess.
    assert 1.0 < episodes.turns_per_episode <= 2.0
    # The tool call is trained, not context: TRL's re-render extends what the policy generated. A policy that
    # generated a rendering the re-render rewrites realigned every turn (1.0 on every step); a garbled tool call may
    # still realign now and then.
    realigned = [float(value) for value in re.findall(r"'rollout/realign_frac': '([^']+)'", learner_log)]
    assert realigned and sum(realigned) / len(realigned) < 0.5, realigned
    # The environments' reward, as the learner logs it per step (over the rows of the groups it trained, each row
    # scored by the environment it played), rises over the run: the policy, taught to play in a third of its
    # episodes, learns that playing pays on every prompt, over HTTP and over OpenEnv alike.
    rewards = step_rewards(learner_log, ["GuessEnvironment", "OpenguessOpenEnv"])
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    assert len(rewards) >= 10 and last > first, (first, last, rewards)
    slope = statistics.linear_regression(range(len(rewards)), rewards).slope
    assert slope * (len(rewards) - 1) >= REWARD_RISE, (slope, rewards)



def step_rewards(learner_log: str, columns: list[str]) -> list[float]:
    """Per logged step, the environments' reward over its rows: each row played one environment, whose column
    (`rewards/<class>`) holds its reward and the others' none, so the step's `reward` less its constant reward is
    their mean over every row. Each environment's column must have been logged at some step."""
    steps, seen = [], set()
    for line in learner_log.splitlines():
        total, constant = re.search(r"'reward': '([^']+)'", line), re.search(r"'rewards/constant': '([^']+)'", line)
        if total and constant:
            steps.append(float(total[1]) - float(constant[1]))
            seen |= {column for column in columns if f"'rewards/{column}': " in line}
    assert seen == set(columns), (seen, columns)
    return steps
