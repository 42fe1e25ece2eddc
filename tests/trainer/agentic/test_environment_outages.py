"""The real learner (TRL's worker child playing the real guess game through the learner's transport) while the game's
servers go away: one of three killed mid-run, then all of them down for a while and back, then down past
unavailableSeconds.

The game's servers run in this process (the learner's child reaches them over loopback, as it would a Service), so
the test stops and starts them at chosen moments; the rollout server is the scripted vLLM-shaped one, answering random
tokens (the capability under test is the learner's: its episodes, their accounting and its waits). Rewards vary by the
built-in letter_a_fraction, so groups train; the game's own reward is a second column.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from grpo_trainer.contract.codes import EXIT_STALLED, EXIT_SUCCEEDED, LearnerPhase, StallCause
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.launch import learner_argv
from grpo_trainer.contract.pod_env import ENVIRONMENT_URL_SEPARATOR, environment_url_variable
from grpo_trainer.contract.report import ProgressReport, parse_progress
from grpo_trainer.testing.guess_env import make_server
from tests.support.paths import COMPLETIONS_SERVER, REPO
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

PROMPTS = REPO / "examples" / "tiny-guess.jsonl"  # 8 prompts
EPOCHS = 3
#: The scenario's all-servers-down outage, shorter than its run's unavailableSeconds.
OUTAGE_S = 30
#: The second run's unavailableSeconds.
SHORT_BOUND_S = 5


class GameServers:
    """The guess game's servers, each on a port of its own that it keeps across a stop and a start."""

    def __init__(self, count: int):
        self.ports = [free_port() for _ in range(count)]
        self.servers = [None] * count
        self.opened_before = [0] * count  # episodes the stopped instances of each had opened
        for index in range(count):
            self.start(index)

    @property
    def address(self) -> str:
        return ENVIRONMENT_URL_SEPARATOR.join(f"http://127.0.0.1:{port}" for port in self.ports)

    def start(self, index: int) -> None:
        server = make_server(self.ports[index])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers[index] = server

    def stop(self, index: int) -> None:
        server, self.servers[index] = self.servers[index], None
        self.opened_before[index] += server.game.opened
        server.shutdown()
        server.server_close()

    def opened(self) -> int:
        return sum(self.opened_before) + sum(s.game.opened for s in self.servers if s is not None)

    def wait_opened(self, count: int, learner: subprocess.Popen, log: Path) -> None:
        """Until `count` episodes opened; the learner's start (model, TRL's worker child) comes first."""
        deadline = time.monotonic() + 900
        while self.opened() < count:
            assert learner.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.1)

    def close(self) -> None:
        for index, server in enumerate(self.servers):
            if server is not None:
                self.stop(index)


@pytest.fixture
def rollout_server():
    server = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "s0", "--random-tokens", "10:300",
                               "--delay", "0.2"], stdout=subprocess.PIPE, text=True)
    yield server.stdout.readline().strip()
    server.kill()
    server.wait()


def learner(tmp_path, model_dir: str, rollout_url: str, games: GameServers, *, unavailable_s: int,
            port: int) -> subprocess.Popen:
    config = RunConfig.model_validate({
        "model": model_dir, "dataset": {"path": str(PROMPTS)}, "rewards": [{"name": "letter_a_fraction"}],
        "training": {"environmentFactory": "grpo_trainer.testing.guess_env:make_environment", "epochs": EPOCHS,
                     "numGenerations": 4, "perDeviceTrainBatchSize": 4, "maxCompletionLength": 16, "tokenBudget": 256,
                     "callTimeoutSeconds": 10, "episodeTimeoutSeconds": 30, "maxStaleness": 4},
        "progress": {"stallGroups": 0},
        "learner": {"device": "cpu", "httpPort": port},
        "rollout": {"device": "cpu", "urls": [rollout_url],
                    "weightSync": {"mode": "filesystem", "directory": str(tmp_path / "weights")}},
        "checkpoint": {"directory": str(tmp_path / "checkpoints")},
        "outputDir": str(tmp_path / "out"), "terminationMessagePath": str(tmp_path / "termination-log"),
        "environments": {"guess": games.address},
        "environmentServers": {"guess": {"replicas": len(games.ports), "unavailableSeconds": unavailable_s}},
    })
    path = tmp_path / "run.json"
    path.write_text(config.model_dump_json(by_alias=True))
    log = (tmp_path / "learner.log").open("w")
    env = {**os.environ, environment_url_variable("guess"): games.address}
    return subprocess.Popen(learner_argv(str(path), python=sys.executable, device="cpu"), stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def progress_of(port: int) -> ProgressReport:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as response:
        return parse_progress(response.read().decode())


def ended(process: subprocess.Popen, tmp_path) -> ProgressReport:
    process.wait(timeout=900)
    return parse_progress((tmp_path / "termination-log").read_text())


def test_episodes_an_environment_failed_are_played_again_and_the_run_waits_out_an_outage(
        tiny_tool_model_dir, rollout_server, tmp_path):
    games = GameServers(3)
    port = free_port()
    process = learner(tmp_path, tiny_tool_model_dir, rollout_server, games, unavailable_s=120, port=port)
    try:
        games.wait_opened(8, process, tmp_path / "learner.log")
        games.stop(2)  # killed mid-run: its episodes in flight fail, and none starts there again
        killed_at = games.opened()
        games.wait_opened(killed_at + 16, process, tmp_path / "learner.log")
        games.stop(0)
        games.stop(1)  # every server down: the learner waits, naming it
        time.sleep(3)
        waiting = progress_of(port)
        assert waiting.environment_wait == "waiting for environment guess: 0/3 ready", waiting
        consumed = waiting.groups_consumed
        time.sleep(OUTAGE_S - 3)
        during = progress_of(port)
        assert during.environment_wait == waiting.environment_wait and not during.stalled
        games.start(0)
        games.start(1)
        report = ended(process, tmp_path)
    finally:
        if process.poll() is None:
            process.kill()
        games.close()
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert process.returncode == EXIT_SUCCEEDED, log[-4000:]
    assert report.phase == LearnerPhase.SUCCEEDED and report.environment_wait is None
    groups = 8 * EPOCHS
    assert report.groups_consumed == report.groups_total == groups  # the exact bound
    assert report.groups_trained + report.dropped_total == groups
    # While it waited it consumed no more than what was queued (the stall rules see no streak of drops).
    assert during.groups_consumed <= consumed + 8, (consumed, during.groups_consumed)
    failures = report.episodes.environment_failures
    assert failures.get("make_environment", 0) >= 1, report.episodes  # each failed episode counted
    # The groups the failures left untrained were played again, within the budget: none dropped for them.
    assert report.regenerated_environment >= 1 and report.dropped["unscorable"] == 0, report
    assert report.regenerated >= report.regenerated_environment
    # The worker child's reset waited at the gate (its log is at WARNING).
    assert "environment guess has no ready server (0/3 server(s) accept connections)" in log


def test_an_environment_down_past_unavailable_seconds_ends_the_run_as_stalled_naming_it(
        tiny_tool_model_dir, rollout_server, tmp_path):
    games = GameServers(2)
    port = free_port()
    process = learner(tmp_path, tiny_tool_model_dir, rollout_server, games, unavailable_s=SHORT_BOUND_S, port=port)
    try:
        games.wait_opened(8, process, tmp_path / "learner.log")
        games.stop(0)
        games.stop(1)
        down_at = time.monotonic()
        report = ended(process, tmp_path)
        took = time.monotonic() - down_at
    finally:
        if process.poll() is None:
            process.kill()
        games.close()
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert process.returncode == EXIT_STALLED, log[-4000:]
    assert report.phase == LearnerPhase.STALLED and report.stall_cause == StallCause.ENVIRONMENT_UNAVAILABLE
    assert report.message.startswith("stalled: environment guess had no ready server for "), report.message
    assert f"(spec.environments[].unavailableSeconds {SHORT_BOUND_S};" in report.message
    seconds = int(report.message.split("no ready server for ")[1].split(" s")[0])
    assert SHORT_BOUND_S <= seconds <= SHORT_BOUND_S + 3, report.message  # ended at the bound, within seconds
    print(json.dumps({"exit_after_down_s": round(took, 1)}))
