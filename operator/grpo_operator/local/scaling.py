"""Scaling a local run's rollout servers while it runs, through the same actions as in a cluster.

The run folder's `rollout-replicas` file holds the count wanted (one integer; `grporun local scale NAME N` writes it
in one step). Before each pass the supervisor reads it (`RolloutScaling.follow`) into spec.rollout.replicas, as an edit;
the state machine then decides, as for pods: ConfigureRollout rewrites `rollout.urls` in run.json (the file the
learner watches; URLs in ordinal order, so the highest ordinals leave first), CreateChildren starts the added servers,
and a removed server keeps running, draining, until status.scaling lets DeletePods stop it (the learner's `/progress`
no longer lists it, or its drain deadline passed). docs/rollout.md ("Scaling a running run") has the design;
docs/cli.md the command.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_trainer.contract.config import RunConfig

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


def scale_bounds(config: RunConfig, *, external: int, can_start: bool, cpu_count: int | None) -> ScaleBounds:
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
class RolloutScaling:
    run_dir: Path
    config_path: Path
    config: RunConfig  # as run.json holds it
    bounds: ScaleBounds
    _seen: str | None = None  # the request file's text last acted on
    _problem: str | None = None

    @property
    def request_path(self) -> Path:
        return self.run_dir / REPLICAS_FILE

    @property
    def configured(self) -> int:
        """How many servers run.json's `rollout.urls` lists."""
        return len(self.config.rollout.urls)

    def begin(self) -> None:
        """At the start: a request left by an earlier run in this folder does not apply; the record says who runs."""
        self.request_path.unlink(missing_ok=True)
        self.record()

    def end(self) -> None:
        for path in (self.request_path, self.run_dir / SUPERVISOR_FILE):
            path.unlink(missing_ok=True)

    def record(self) -> None:
        SupervisorRecord(os.getpid(), self.configured, self.bounds).write(self.run_dir)

    def follow(self, log: Callable[[str], None]) -> int | None:
        """A new count in the request file, within bounds; None when there is none (one warning for one that
        cannot be used)."""
        try:
            text = self.request_path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            return self._refuse(f"cannot read it ({error.strerror})", log)
        if text == self._seen:
            return None
        self._seen = text
        try:
            replicas = parse_request(text)
        except ValueError as error:
            return self._refuse(str(error), log)
        if (problem := self.bounds.problem(replicas)) is not None:
            return self._refuse(problem, log)
        self._problem = None
        return replicas

    def _refuse(self, problem: str, log: Callable[[str], None]) -> None:
        if problem != self._problem:
            self._problem = problem
            log(f"Warning ScaleRefused: {self.request_path}: {problem}; keeping {self.configured} "
                "rollout server(s)")

    def configure(self, urls: list[str]) -> bool:
        """ConfigureRollout: run.json's `rollout.urls` becomes `urls`, in one step. False when it listed them."""
        if urls == list(self.config.rollout.urls):
            return False
        self.config = self.config.model_copy(
            update={"rollout": self.config.rollout.model_copy(update={"urls": urls})})
        write_atomically(self.config_path, self.config.model_dump_json(by_alias=True, indent=2))
        self.record()
        return True
