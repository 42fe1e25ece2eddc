"""The long builds under hack/ (the Go binaries, the images), run in the background while the tests that need none
of their outputs run.

A `Build` runs one build script with its stderr in a log file and its stdout in another; the script's last line of
output is its result (the folder it built into, or an image's "<reference> <archive>"). The scripts say what they
build while they build (hack/lib/progress.sh: every line starts with "build: "). `Builds` runs its builds in lanes,
one build at a time in each lane and in the order given (the Go builds share the Go build cache and the cores; the
image builds share buildah's store), hands their progress lines to whoever reports them, and publishes each
outcome on a `Board`: a folder that any process of the run (pytest-xdist's workers) reads to wait for a build.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROGRESS_PREFIX = "build: "  # every line hack/lib/progress.sh writes starts with it
LOG_TAIL_LINES = 40
POLL_S = 1.0
BUILD_NICENESS = -5  # a build's share of a core beside a test's: 3121 to 1024 (the kernel's CFS weights)

Report = Callable[[str], None]


class Unavailable(Exception):
    """What a build makes cannot exist on this machine (no Go, not root, ...); the message says why (tests skip)."""


class BuildFailed(RuntimeError):
    """A build script exited non-zero; the message holds its log's tail."""


def _raise_session_priority(pid: int) -> None:
    """Give the session of `pid` BUILD_NICENESS. With the kernel's autogroups (Debian's default) the cores are
    shared between sessions first, so a process's own niceness only counts within its session: the build's
    compilers at -5 still had a session's share beside each test's learner and vLLM server (seen: 30% of a core
    each). Where the session's niceness cannot be set (no autogroups, not root) the process's own applies."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(BUILD_NICENESS))


@dataclass
class Build:
    """One build script: `name` as hack/lib/build-times knows it, `command` with the environment `env` it runs in,
    in `lane` (one build at a time per lane)."""

    name: str
    command: list[str]
    env: dict[str, str]
    lane: str = "go"
    process: subprocess.Popen | None = None
    log: Path | None = None
    _out: Path | None = None
    _read: int = 0

    def start(self, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.log, self._out = logs / f"{self.name}.log", logs / f"{self.name}.out"
        with open(self.log, "wb") as err, open(self._out, "wb") as out:
            # A session of its own: stopping the build stops the go build under it too. Ahead of the tests on the
            # cores (where the user may raise priorities; elsewhere `nice` says so in the log and runs it as is):
            # the tests that wait for it are the run's longest path. At equal priority beside two test workers the
            # control plane's cold build took 44 min, 13 alone.
            self.process = subprocess.Popen(["nice", "-n", str(BUILD_NICENESS), *self.command], stdout=out,
                                            stderr=err, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        _raise_session_priority(self.process.pid)

    @property
    def started(self) -> bool:
        return self.process is not None

    @property
    def done(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    @property
    def result_ok(self) -> bool:
        return self.done and self.process.returncode == 0

    def progress(self) -> list[str]:
        """The progress lines written since the last call (complete lines only)."""
        if self.log is None or not self.log.exists():
            return []
        with open(self.log, "rb") as log:
            log.seek(self._read)
            chunk = log.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._read += len(complete)
        lines = complete.decode(errors="replace").splitlines()
        return [line for line in lines if line.startswith(PROGRESS_PREFIX)]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log.read_text(errors="replace") if self.log and self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def result(self) -> str:
        """The finished build's last line of output; BuildFailed when it failed."""
        assert self.process is not None and self._out is not None and self.done
        out = self._out.read_text(errors="replace").strip().splitlines()
        if self.process.returncode != 0 or not out:
            raise BuildFailed(f"{' '.join(self.command)} exited with {self.process.returncode} (log: {self.log}); "
                              f"its last lines:\n{self.log_tail()}")
        return out[-1]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@dataclass(frozen=True)
class Outcome:
    """A build's outcome: its result line, or why it failed, or why it cannot be built here."""

    result: str | None = None
    failed: str | None = None
    unavailable: str | None = None

    def value(self) -> str:
        """The result; BuildFailed or Unavailable otherwise."""
        if self.failed is not None:
            raise BuildFailed(self.failed)
        if self.unavailable is not None:
            raise Unavailable(self.unavailable)
        assert self.result is not None
        return self.result


@dataclass(frozen=True)
class Board:
    """A folder holding each build's outcome as `<name>.json`, written once and atomically."""

    folder: Path

    def publish(self, name: str, outcome: Outcome) -> None:
        partial = self.folder / f".{name}.json.partial"
        partial.write_text(json.dumps({key: value for key, value in vars(outcome).items() if value is not None}))
        os.replace(partial, self.folder / f"{name}.json")

    def outcome(self, name: str) -> Outcome | None:
        path = self.folder / f"{name}.json"
        return Outcome(**json.loads(path.read_text())) if path.exists() else None

    def wait(self, name: str, between: Callable[[], None] = lambda: None) -> Outcome:
        """Block until build `name` has an outcome, calling `between` once a poll."""
        while (outcome := self.outcome(name)) is None:
            between()
            time.sleep(POLL_S)
        return outcome


@dataclass
class Builds:
    """Builds run in lanes, in the order given, logging into `logs` and publishing their outcomes on `board`."""

    logs: Path
    board: Board
    queue: list[Build] = field(default_factory=list)
    _published: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, name: str) -> Build | None:
        return next((build for build in self.queue if build.name == name), None)

    def poll(self, report: Report) -> None:
        """Report the progress lines written since the last poll, publish what finished, and start the next build
        of each lane that has none running."""
        with self._lock:
            for build in self.queue:
                for line in build.progress():
                    report(line)
                if build.done and build.name not in self._published:
                    try:
                        outcome = Outcome(result=build.result())
                    except BuildFailed as failed:
                        outcome = Outcome(failed=str(failed))
                    self.board.publish(build.name, outcome)
                    self._published.add(build.name)
            busy = {build.lane for build in self.queue if build.started and not build.done}
            for build in self.queue:
                if not build.started and build.lane not in busy:
                    build.start(self.logs)
                    busy.add(build.lane)

    def running(self) -> list[Build]:
        return [build for build in self.queue if build.started and not build.done]

    def stop(self) -> list[Build]:
        """Stop the builds still running (the session ended first); those stopped."""
        with self._lock:
            stopped = self.running()
            for build in stopped:
                build.stop()
            return stopped


class Poller:
    """Polls `builds` every POLL_S on a thread of its own, so a build that ends starts the next one at once, whatever
    the tests are doing; `report` gets the progress lines."""

    def __init__(self, builds: Builds, report: Report):
        self.builds, self.report = builds, report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-builds", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.builds.poll(self.report)
            self._stop.wait(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
