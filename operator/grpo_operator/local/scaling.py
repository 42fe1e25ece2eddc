"""Scaling a local run's rollout servers while it runs, as the operator does in a cluster.

The run folder's `rollout-replicas` file holds the count wanted (one integer; `grporun local scale NAME N` writes it
in one step). Each tick the supervisor reads it. For a new count it plans the added servers (the state machine then
starts them, as it creates the pods it misses), rewrites `rollout.urls` in run.json (the file the learner watches;
URLs in ordinal order, so the highest ordinals leave first) and keeps each removed server running, draining, until
the learner's `/progress` no longer lists it, or its drain deadline passes. docs/rollout.md ("Scaling a running
run") has the design; docs/cli.md the command.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_trainer import contract as c

from .. import builders
from ..status.scaling import DrainEnd, drain_end
from .plan import ProcessPlan
from .processes import STOP_GRACE_S, LocalProcess, free_port

if TYPE_CHECKING:
    from .supervise import LocalRun

_DRAINED_LINES = {
    DrainEnd.NO_LEARNER: "Normal RolloutDrained: {name}: the learner is not running; stopped",
    DrainEnd.DRAINED: "Normal RolloutDrained: {name}: the learner sends it nothing more; stopped",
    DrainEnd.DEADLINE: ("Warning RolloutDrainDeadline: {name}: still draining after {drain_s:.0f}s (the request "
                        "timeout plus the stop grace); stopped anyway, its requests are sent again"),
}

#: In the run folder: the count of rollout servers asked for, and who supervises the run (the scale command reads it).
REPLICAS_FILE = "rollout-replicas"
SUPERVISOR_FILE = "supervisor.json"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` in one step: a reader sees the old file or the new one, never half of it."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)


@dataclass(frozen=True)
class ScaleBounds:
    """The rollout server counts a local run can take, with why the largest is what it is."""

    minimum: int
    maximum: int
    why_maximum: str
    why_minimum: str = "a run needs at least one rollout server"

    def problem(self, replicas: int) -> str | None:
        if replicas < self.minimum:
            return f"{replicas} is below {self.minimum}: {self.why_minimum}"
        if replicas > self.maximum:
            return f"{replicas} is above {self.maximum}, the most for this run: {self.why_maximum}"
        return None


def scale_bounds(config: c.RunConfig, *, external: int, can_start: bool, cpu_count: int | None) -> ScaleBounds:
    """`external`: servers given with --rollout-url (not this run's to stop); `can_start`: a Python with vLLM."""
    current = len(config.rollout.urls)
    minimum, why_minimum = 1, "a run needs at least one rollout server"
    if external:
        minimum, why_minimum = external, f"{external} server(s) came with --rollout-url and are not this run's to stop"
    if config.rollout.weight_sync.mode == "nccl":
        return ScaleBounds(minimum, 1, "rollout.weightSync.mode nccl serves one server", why_minimum)
    if not can_start:
        return ScaleBounds(minimum, max(current, external), "no Python with vLLM to start more (--rollout-python)",
                           why_minimum)
    cores = cpu_count or 1
    return ScaleBounds(minimum, max(cores, current), f"one server per CPU core of this machine ({cores})",
                       why_minimum)


@dataclass(frozen=True)
class SupervisorRecord:
    """What the scale command needs to know of the supervising `grporun local`: it is alive, and the bounds."""

    pid: int
    replicas: int
    bounds: ScaleBounds

    def write(self, run_dir: Path) -> None:
        record = {"pid": self.pid, "replicas": self.replicas, "minReplicas": self.bounds.minimum,
                  "maxReplicas": self.bounds.maximum, "whyMin": self.bounds.why_minimum,
                  "whyMax": self.bounds.why_maximum}
        write_atomically(run_dir / SUPERVISOR_FILE, json.dumps(record))

    @classmethod
    def read(cls, run_dir: Path) -> SupervisorRecord | None:
        """The record of a live supervisor, else None (none ever, or it ended)."""
        try:
            record = json.loads((run_dir / SUPERVISOR_FILE).read_text())
            pid = int(record["pid"])
            bounds = ScaleBounds(int(record["minReplicas"]), int(record["maxReplicas"]), str(record["whyMax"]),
                                 str(record["whyMin"]))
            replicas = int(record["replicas"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
        return cls(pid, replicas, bounds)


def parse_request(text: str) -> int:
    """The count in a `rollout-replicas` file. Raises ValueError saying what is wrong."""
    stripped = text.strip()
    if not stripped.isdigit():
        raise ValueError(f"{stripped[:40]!r} is not a whole number of rollout servers")
    return int(stripped)


@dataclass
class Draining:
    process: LocalProcess
    url: str
    deadline: float


# more than 8: the run's scaling inputs and its live state, built once by `prepare`
@dataclass
class RolloutScaling:
    run_dir: Path
    config_path: Path
    config: c.RunConfig  # as run.json holds it
    bounds: ScaleBounds
    plan_server: Callable[[int, int], ProcessPlan]  # (ordinal, port) -> the server's process
    drain_s: float
    clock: Callable[[], float] = time.monotonic
    draining: dict[str, Draining] = field(default_factory=dict)  # pod name -> the server leaving
    _seen: str | None = None  # the request file's text last acted on
    _problem: str | None = None

    @property
    def request_path(self) -> Path:
        return self.run_dir / REPLICAS_FILE

    def begin(self) -> None:
        """At the start: a request left by an earlier run in this folder does not apply; the record says who runs."""
        self.request_path.unlink(missing_ok=True)
        self.record()

    def end(self) -> None:
        for path in (self.request_path, self.run_dir / SUPERVISOR_FILE):
            path.unlink(missing_ok=True)

    def record(self) -> None:
        SupervisorRecord(os.getpid(), len(self.config.rollout.urls), self.bounds).write(self.run_dir)

    def follow(self, local: LocalRun, log: Callable[[str], None]) -> None:
        """Act on a new count in the request file (one warning for one that cannot be used)."""
        try:
            text = self.request_path.read_text()
        except FileNotFoundError:
            return
        except OSError as error:
            return self._refuse(f"cannot read it ({error.strerror})", log)
        if text == self._seen:
            return
        self._seen = text
        try:
            replicas = parse_request(text)
        except ValueError as error:
            return self._refuse(str(error), log)
        if (problem := self.bounds.problem(replicas)) is not None:
            return self._refuse(problem, log)
        self._problem = None
        if replicas != len(self.config.rollout.urls):
            self.scale(local, replicas, log)

    def _refuse(self, problem: str, log: Callable[[str], None]) -> None:
        if problem != self._problem:
            self._problem = problem
            log(f"Warning ScaleRefused: {self.request_path}: {problem}; keeping {len(self.config.rollout.urls)} "
                "rollout server(s)")

    def scale(self, local: LocalRun, replicas: int, log: Callable[[str], None]) -> None:
        urls = list(self.config.rollout.urls)
        before = len(urls)
        started, drained = [], []
        for ordinal in range(before, replicas):
            name = builders.rollout_pod_name(local.name, ordinal)
            back = self.draining.pop(name, None)
            if back is not None:  # still draining: it serves again (the learner admits it again first)
                local.processes[name] = back.process
                urls.append(back.url)
            else:
                plan = self.plan_server(ordinal, free_port())
                local.processes[name] = LocalProcess(plan, self.run_dir / "logs" / f"{name}.log")
                urls.append(plan.url)
            started.append(name)
        for ordinal in reversed(range(replicas, before)):
            name = builders.rollout_pod_name(local.name, ordinal)
            process = local.processes.pop(name)
            self.draining[name] = Draining(process, urls[ordinal], self.clock() + self.drain_s)
            local.forget_server(name)
            drained.append(name)
        urls = urls[:replicas]
        local.spec.rollout.replicas = replicas  # the state machine starts the servers it now misses
        self.config = self.config.model_copy(
            update={"rollout": self.config.rollout.model_copy(update={"urls": urls})})
        write_atomically(self.config_path, self.config.model_dump_json(by_alias=True, indent=2))
        self.record()
        change = [f"starting {', '.join(started)}"] if started else []
        change += [f"draining {', '.join(drained)} (stopped once the learner no longer reports it)"] if drained else []
        log(f"Normal RolloutScaled: {before} -> {replicas} rollout servers: {'; '.join(change)}")

    def configure(self, local: LocalRun, replicas: int) -> None:
        """ConfigureRollout: run.json's `rollout.urls` lists the first `replicas` servers, in ordinal order; a server
        not planned yet (a scale-up) is planned first, so its URL is known before its process starts."""
        urls = []
        for ordinal in range(replicas):
            if ordinal < len(local.external_rollout_urls):
                urls.append(local.external_rollout_urls[ordinal])
                continue
            name = builders.rollout_pod_name(local.name, ordinal)
            if name not in local.processes:
                plan = self.plan_server(ordinal, free_port())
                local.processes[name] = LocalProcess(plan, self.run_dir / "logs" / f"{name}.log")
            urls.append(local.processes[name].plan.url)
        if urls == list(self.config.rollout.urls):
            return
        self.config = self.config.model_copy(
            update={"rollout": self.config.rollout.model_copy(update={"urls": urls})})
        write_atomically(self.config_path, self.config.model_dump_json(by_alias=True, indent=2))
        self.record()

    def finish_drains(self, report: c.ProgressReport | None, learner_alive: bool, log: Callable[[str], None]) -> None:
        """Stop each draining server the learner is done with: absent from its report, or the learner is not
        running (a restarted learner reads run.json afresh), or past its drain deadline (then a warning)."""
        for name, leaving in list(self.draining.items()):
            end = drain_end(exited=leaving.process.popen is None or leaving.process.poll() is not None,
                            learner_running=learner_alive,
                            still_reported=None if report is None else any(
                                server.url == leaving.url for server in report.rollout),
                            past_deadline=self.clock() > leaving.deadline)
            if end is None:
                continue
            leaving.process.stop()
            del self.draining[name]
            if end is not DrainEnd.EXITED:  # never started, or gone by itself: nothing to say
                log(_DRAINED_LINES[end].format(name=name, drain_s=self.drain_s))

    def stop_all(self) -> None:
        for leaving in self.draining.values():
            leaving.process.stop()
        self.draining.clear()


def drain_seconds(config: c.RunConfig) -> float:
    """How long a removed server may drain: its requests' timeout, then the stop's grace (the cluster's rule with
    `grporun local`'s grace in place of the pod's)."""
    return c.request_timeout_seconds(config.training.extra_args) + STOP_GRACE_S
