"""The learner's rollout supervision (in the test's process) and the worker's router (in a process of its own, as
TRL's worker child runs it), over one route board: what the rollout tests drive."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from grpo_trainer.rollout.route_board import RouteBoard
from grpo_trainer.rollout.run_config_watch import RolloutUrlsWatch
from grpo_trainer.rollout.server_set import ServerSet
from grpo_trainer.rollout.supervisor import RolloutSupervisor, SupervisorTimings
from tests.support.paths import REPO

#: Unready servers probed often and tallies read often, so a test sees admissions and failures within a fraction of
#: a second; no liveness verdict on a server a test holds paused, unless the test's own timings ask for one.
FAST = SupervisorTimings(probe_interval_s=0.1, tally_interval_s=0.05, watch_interval_s=0.1, liveness_interval_s=600)


@dataclass
class Sending:
    """Requests being sent by a router process."""

    process: subprocess.Popen

    def result(self, timeout_s: float = 60.0) -> list[tuple[int, str]]:
        out, err = self.process.communicate(timeout=timeout_s)
        assert self.process.returncode == 0, err[-3000:]
        return [tuple(result) for result in json.loads(out.strip().splitlines()[-1])]

    def stderr_line(self, contains: str, timeout_s: float = 30.0) -> str:
        """The first line of the router's log holding `contains` (read as it comes)."""
        deadline = time.monotonic() + timeout_s
        for line in self.process.stderr:
            if contains in line:
                return line
            assert time.monotonic() < deadline, f"the router never logged {contains!r}"
        raise AssertionError(f"the router exited without logging {contains!r}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@dataclass
class Routing:
    servers: ServerSet
    board: RouteBoard
    supervisor: RolloutSupervisor
    model: str = "m"  # what the router's requests name

    def start_sending(self, count: int, window: int | None = None, *, timeout_s: float = 30.0,
                      wait_s: float = 60.0) -> Sending:
        command = [sys.executable, "-m", "tests.support.router_client", self.board.path, str(count),
                   "--model", self.model, "--timeout", str(timeout_s), "--wait", str(wait_s)]
        if window is not None:
            command += ["--window", str(window)]
        env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'trainer_image'}"}
        return Sending(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))

    def send(self, count: int, window: int | None = None, **kwargs) -> list[tuple[int, str]]:
        return self.start_sending(count, window, **kwargs).result()

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def wait_ready(self, count: int, timeout_s: float = 30.0) -> None:
        self.wait_for(lambda: len(self.servers.ready_urls()) >= count, f"{count} server(s) in the pool", timeout_s)

    def report(self) -> dict:
        self.supervisor.exchange()
        return {replica.url: replica for replica in self.servers.report()}


@contextlib.contextmanager
def routing(urls: list[str], *, admit=None, watch: RolloutUrlsWatch | None = None, timings: SupervisorTimings = FAST,
            model: str = "m") -> Iterator[Routing]:
    servers = ServerSet(urls)
    board = RouteBoard.create()
    supervisor = RolloutSupervisor(servers, board, model, admit=admit, watch=watch, timings=timings).start()
    try:
        yield Routing(servers, board, supervisor, model)
    finally:
        supervisor.stop()
        board.close()
