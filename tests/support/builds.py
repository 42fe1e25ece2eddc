"""The long builds under hack/ (the control plane, Kueue), run in the background while the tests that need none of
their binaries run.

A `Build` runs one build script with its stderr in a log file and its stdout (the folder it built into, last line)
in another. The scripts say what they build while they build through hack/lib/progress.sh; `Builds` runs its builds
one after another (they share a lock and the machine's cores), hands their progress lines to whoever reports them,
and waits for one build when a test needs its binaries. A failed build raises `BuildFailed` with its log's tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROGRESS_PREFIX = "build: "  # every line hack/lib/progress.sh writes starts with it
LOG_TAIL_LINES = 40
POLL_S = 1.0

Report = Callable[[str], None]


class BuildFailed(RuntimeError):
    """A build script exited non-zero; the message holds its log's tail."""


@dataclass
class Build:
    """One build script: `name` as the tests know it, `script` with the environment `env` it runs in."""

    name: str
    script: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None
    log: Path | None = None
    _out: Path | None = None
    _read: int = 0

    def start(self, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.log, self._out = logs / f"{self.name}.log", logs / f"{self.name}.out"
        with open(self.log, "wb") as err, open(self._out, "wb") as out:
            # A session of its own: stopping the build stops the go build under it too.
            self.process = subprocess.Popen([str(self.script)], stdout=out, stderr=err, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

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

    def result(self) -> Path:
        """The folder the finished build put its binaries in; BuildFailed when it failed."""
        assert self.process is not None and self._out is not None and self.done
        out = self._out.read_text(errors="replace").strip().splitlines()
        if self.process.returncode != 0 or not out:
            raise BuildFailed(f"{self.script} exited with {self.process.returncode} (log: {self.log}); its last "
                              f"lines:\n{self.log_tail()}")
        return Path(out[-1])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@dataclass
class Builds:
    """Builds run in the order given, one at a time, logging into `logs`."""

    logs: Path
    queue: list[Build] = field(default_factory=list)

    def start(self) -> None:
        self.poll()

    def get(self, name: str) -> Build | None:
        return next((build for build in self.queue if build.name == name), None)

    def poll(self, report: Report | None = None) -> None:
        """Start the next build when none runs, and report the progress lines written since the last poll."""
        for build in self.queue:
            if report is not None:
                for line in build.progress():
                    report(line)
        running = any(build.started and not build.done for build in self.queue)
        waiting = next((build for build in self.queue if not build.started), None)
        if not running and waiting is not None:
            waiting.start(self.logs)

    def running(self) -> list[Build]:
        return [build for build in self.queue if build.started and not build.done]

    def wait(self, name: str, report: Report) -> Path:
        """Block until build `name` is done, reporting progress; its folder, or BuildFailed."""
        build = self.get(name)
        assert build is not None, f"no build named {name}"
        while not build.done:
            self.poll(report)
            time.sleep(POLL_S)
        self.poll(report)
        return build.result()

    def stop(self) -> list[Build]:
        """Stop the builds still running (the session ended first); those stopped."""
        stopped = self.running()
        for build in stopped:
            build.stop()
        return stopped
