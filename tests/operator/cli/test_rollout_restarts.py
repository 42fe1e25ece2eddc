"""`grporun local` replaces a rollout server that exits, or that its liveness probes find hung, through the operator's
own state machine: its own counter and `runPolicy.rolloutRestartLimit`, the learner left running, and the engine's
error line (or why the probes stopped it) in the restart event and the final failure.

Real child processes stand in for vLLM here (they exit on cue, as a server whose engine died does); the restart of a
real vLLM server under a running learner is in tests/trainer/rollout/test_replicas.py.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import time

from rich.console import Console

from grpo_operator.api import parse_spec
from grpo_operator.local.plan import ProcessPlan
from grpo_operator.local.processes import LocalProcess
from grpo_operator.local.rollout_restarts import Liveness, exit_line
from grpo_operator.local.supervise import LocalPort, LocalRun, tick
from grpo_operator.status import Decision
from grpo_trainer.contract.rollout_pod import EXIT_LINE_PREFIX
from tests.support.paths import COMPLETIONS_SERVER
from tests.support.ports import free_port
from tests.support.specs import minimal_spec

SERVER = COMPLETIONS_SERVER

ENGINE_ERROR = "RuntimeError: CPU Generator does not use offset"
DIES = f"""
import sys
print("nanobind: leaked 12 instances!")
print("{EXIT_LINE_PREFIX}vLLM exited with code 0: {ENGINE_ERROR}", file=sys.stderr)
"""


def one_pass(local: LocalRun, log) -> Decision:
    """One tick of `grporun local`'s loop (the kubelet's step, the engine's pass through the local port), the
    learner's report unread."""
    outcome = asyncio.run(tick(local, LocalPort(local, log, read_progress=lambda url: None)))
    assert outcome is not None
    return outcome.decision


def _wait_exit(process: LocalProcess) -> None:
    deadline = time.monotonic() + 30
    while process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_exited_server_is_replaced_until_its_limit_then_fails_the_run_with_the_engine_error(tmp_path):
    spec = parse_spec(minimal_spec(runPolicy={"rolloutRestartLimit": 2, "backoffLimit": 0}))
    server = LocalProcess(ProcessPlan("tiny-rollout-0", "rollout", [sys.executable, "-c", DIES], {},
                                      url="http://127.0.0.1:9"), tmp_path / "rollout.log")
    learner = LocalProcess(ProcessPlan("tiny-learner-0", "learner",
                                       [sys.executable, "-c", "import time; time.sleep(120)"], {}),
                           tmp_path / "learner.log")
    local = LocalRun("tiny", "default", spec, tmp_path, {p.plan.name: p for p in (server, learner)})
    output = io.StringIO()
    console = Console(file=output, width=200)
    events = []
    try:
        for _ in range(20):
            if server.popen is not None:
                _wait_exit(server)
            events += one_pass(local, console.log).events
            if local.status["phase"] == "Failed":
                break
        learner_pid = learner.popen.pid
    finally:
        local.stop_all()
    status = local.status
    assert status["phase"] == "Failed" and status.get("restarts", 0) == 0
    assert status["failure"] == {"role": "rollout", "pod": "tiny-rollout-0", "exitCode": 0,
                                 "reason": "RolloutRestartLimitExceeded", "message": ENGINE_ERROR}
    restarts = [e.message for e in events if e.reason == "RolloutRestarted"]
    assert len(restarts) == 2 and "restart 1/2" in restarts[0] and "restart 2/2" in restarts[1]
    assert ENGINE_ERROR in restarts[0] and "nanobind" not in str(status)
    assert output.getvalue().count("started tiny-rollout-0") == 3  # started, then replaced twice
    assert output.getvalue().count("started tiny-learner-0") == 1 and learner_pid  # the learner went on
    assert exit_line(server.log_path) == f"{EXIT_LINE_PREFIX}vLLM exited with code 0: {ENGINE_ERROR}"


def _hang_run(tmp_path, server_args: list[str]) -> tuple[LocalRun, LocalProcess, LocalProcess, Liveness]:
    """A run of the stand-in server (`server_args` after its name and port) and a learner that only waits, under
    liveness probes fast enough for a test."""
    spec = parse_spec(minimal_spec(runPolicy={"rolloutRestartLimit": 2}))
    port = free_port()
    server = LocalProcess(ProcessPlan("tiny-rollout-0", "rollout",
                                      [sys.executable, str(SERVER), "s", str(port), *server_args], {},
                                      url=f"http://127.0.0.1:{port}"), tmp_path / "rollout.log")
    learner = LocalProcess(ProcessPlan("tiny-learner-0", "learner",
                                       [sys.executable, "-c", "import time; time.sleep(120)"], {}),
                           tmp_path / "learner.log")
    liveness = Liveness("m", period_s=0.1, failure_threshold=2, timeout_s=0.5, startup_poll_s=0.1)
    local = LocalRun("tiny", "default", spec, tmp_path, {p.plan.name: p for p in (server, learner)}, liveness=liveness)
    return local, server, learner, liveness


def _tick_until(local: LocalRun, console: Console, events: list, condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, console.file.getvalue()
        events.extend(one_pass(local, console.log).events)  # its kubelet step runs the liveness probes
        time.sleep(0.05)


def test_a_hung_server_is_stopped_by_its_liveness_probes_and_replaced_by_the_state_machine(tmp_path):
    # A SIGSTOPped server still holds its port and accepts connections: only a generated token tells it is hung.
    local, server, learner, liveness = _hang_run(tmp_path, [])
    console = Console(file=io.StringIO(), width=200)
    events = []
    try:
        _tick_until(local, console, events, lambda: "tiny-rollout-0" in liveness._started)
        stopped = server.popen.pid
        learner_pid = learner.popen.pid
        os.kill(stopped, signal.SIGSTOP)
        _tick_until(local, console, events, lambda: server.popen is not None and server.popen.pid != stopped)
        _tick_until(local, console, events, lambda: "tiny-rollout-0" in liveness._started)  # the new one is up
        restarted = [e.message for e in events if e.reason == "RolloutRestarted"]
        assert len(restarted) == 1 and "hung: no token from 2 liveness probes in a row" in restarted[0]
        assert "RolloutUnresponsive: tiny-rollout-0" in console.file.getvalue()
        assert local.status["phase"] != "Failed" and learner.popen.pid == learner_pid  # the learner went on
    finally:
        local.stop_all()


def test_a_server_that_hangs_before_any_liveness_probe_got_a_token_from_it_is_restarted(tmp_path):
    # As the pod's liveness probe, counted from the moment /health answered (the startup probe passed): a server
    # frozen before one of the probes, every period or so apart, caught a token from it is hung all the same. Here
    # it answers /health and never a completion.
    local, server, learner, liveness = _hang_run(tmp_path, ["--hang", "/v1/completions"])
    console = Console(file=io.StringIO(), width=200)
    events = []
    try:
        _tick_until(local, console, events, lambda: any(e.reason == "RolloutRestarted" for e in events))
        [restarted] = [e.message for e in events if e.reason == "RolloutRestarted"]
        assert "restart 1/2" in restarted and "hung: no token from 2 liveness probes in a row" in restarted
    finally:
        local.stop_all()
