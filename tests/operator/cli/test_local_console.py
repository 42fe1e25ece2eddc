"""What `grporun local` prints reads well in a terminal and in a file: no source-file column, one unwrapped line
per event off a terminal, a line every ~30 s while a server loads, and the failed pod's log after a failed
summary."""

from __future__ import annotations

import io
import sys

import pytest

from grpo_operator.local.console import Periodic, event_logger, final_summary, make_console, progress_line
from grpo_operator.local.plan import ProcessPlan
from grpo_operator.local.processes import LocalProcess
from grpo_operator.local.supervise import LocalRun, supervise
from grpo_operator.manifest import read_grporun
from grpo_operator.status import PodObservation
from tests.support.paths import REPO

LONG = "Normal Starting: pods are running; waiting for the rollout servers and the learner " + "x" * 150


def test_off_a_terminal_each_event_is_one_whole_line_without_a_source_column():
    console = make_console()
    console.file = io.StringIO()
    assert not console.is_terminal
    event_logger(console)(LONG)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(LONG) and lines[0].startswith("[")
    assert ".py:" not in lines[0]


def test_on_a_terminal_rich_logs_without_the_source_column(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    console = make_console()
    console.file = io.StringIO()
    assert console.is_terminal
    event_logger(console)("Normal Created: creating 1 rollout and 1 learner pods")
    assert ".py:" not in console.file.getvalue()


def test_waiting_lines_come_once_per_period_from_a_period_after_the_wait_began():
    now = [0.0]
    waiting = Periodic(period_s=30, clock=lambda: now[0])
    seen = []
    for now[0], wait in [(0, True), (29, True), (30, True), (31, True), (60, True), (61, False), (62, True),
                         (91, True), (92, True)]:
        seen.append(waiting.due(wait))
    assert seen == [False, False, True, False, True, False, False, False, True]


def _local_run(tmp_path, learner_argv: list[str]) -> LocalRun:
    spec = read_grporun(REPO / "examples" / "tiny.yaml").spec
    learner = ProcessPlan("tiny-learner-0", "learner", learner_argv, {}, "http://127.0.0.1:9")
    rollout = ProcessPlan("tiny-rollout-0", "rollout", ["true"], {}, "http://127.0.0.1:9")
    processes = {plan.name: LocalProcess(plan, tmp_path / "logs" / f"{plan.name}.log") for plan in (rollout, learner)}
    return LocalRun("tiny", "default", spec, tmp_path, processes)


def test_a_server_that_is_up_but_not_ready_is_named_with_its_log(tmp_path):
    local = _local_run(tmp_path, ["true"])
    pods = [PodObservation("tiny-rollout-0", "rollout", "Running", False),
            PodObservation("tiny-learner-0", "learner", "Running", True)]
    assert local.waiting_for(pods) == [
        f"waiting for tiny-rollout-0: /health does not answer yet (log: {tmp_path}/logs/tiny-rollout-0.log)"]
    ready = [PodObservation("tiny-rollout-0", "rollout", "Running", True)]
    assert local.waiting_for(ready) == []
    local.processes.pop("tiny-rollout-0")
    local.external_rollout_urls = ["http://127.0.0.1:9"]
    assert local.waiting_for(pods) == [
        "waiting for tiny-rollout-0: /health does not answer yet (the server at http://127.0.0.1:9)"]


def test_supervise_says_what_it_waits_for_while_a_server_loads(tmp_path):
    """The real loop: the rollout server (a process that never answers /health) loads while each tick is 10 s."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    local = _local_run(tmp_path, sleeper)
    local.processes["tiny-rollout-0"].plan = ProcessPlan("tiny-rollout-0", "rollout", sleeper, {}, "http://127.0.0.1:9")
    ticks = iter(range(0, 10_000, 10))
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if sum(line.startswith("waiting for") for line in lines) == 2:
            raise KeyboardInterrupt  # two rounds seen: enough

    console = make_console()
    console.file = io.StringIO()
    try:
        with pytest.raises(KeyboardInterrupt):
            supervise(local, console, log, poll_interval_s=0, clock=lambda: next(ticks))
    finally:
        local.stop_all()
    waits = [line for line in lines if line.startswith("waiting for")]
    assert waits == [
        f"waiting for tiny-rollout-0: /health does not answer yet (log: {tmp_path}/logs/tiny-rollout-0.log)"] * 2
    assert any(line.startswith("started tiny-rollout-0") for line in lines[:lines.index(waits[0])])


def test_off_a_terminal_a_running_run_gets_a_progress_line_instead_of_the_bar():
    status = {"phase": "Running", "progress": {"groupsTotal": 192, "groupsConsumed": 80, "epoch": 5, "epochs": 12,
                                               "groupsTrained": 79, "groupsDropped": 1, "stallStreak": 0,
                                               "stallLimit": 16, "rewardMean": 0.3214}}
    assert progress_line(status) == ("Running: 80/192 groups, epoch 5/12, trained 79, dropped 1, stall 0/16, "
                                     "reward 0.321, ETA -")


def test_a_failed_summary_ends_with_the_failed_pods_log(tmp_path):
    log_path = tmp_path / "logs" / "tiny-learner-0.log"
    failed = {"phase": "Failed", "message": "learner exited with code 1",
              "failure": {"reason": "BackoffLimitExceeded", "pod": "tiny-learner-0"}}
    assert final_summary(failed, {"tiny-learner-0": log_path}).splitlines()[-1] == f"log: {log_path}"
    succeeded = {"phase": "Succeeded", "failure": None}
    assert "log:" not in final_summary(succeeded, {"tiny-learner-0": log_path})


def test_a_summary_says_where_the_exported_model_is():
    output = {"uri": "file:///data/models/tiny", "step": 9, "bytes": 2048, "sha256": "ab" * 32,
              "time": "2026-01-01T12:00:00Z"}
    assert final_summary({"phase": "Succeeded", "output": output}).splitlines()[-1] == (
        f"model: /data/models/tiny (step 9, 2048 bytes, manifest sha256 {'ab' * 32})")
    claim = {**output, "uri": "pvc://models/tiny"}
    assert "model: pvc://models/tiny (step 9" in final_summary({"phase": "Succeeded", "output": claim})
    stored = {**output, "uri": "s3://models/runs/tiny"}
    assert "model: s3://models/runs/tiny (step 9" in final_summary({"phase": "Succeeded", "output": stored})
    assert "model:" not in final_summary({"phase": "Succeeded"})
