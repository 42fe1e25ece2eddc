"""The local run's processes: ports, the rollout interpreter, starting and stopping process groups, HTTP reads."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

from grpo_trainer.contract.codes import PROGRESS_PATH
from grpo_trainer.contract.report import ProgressReport, parse_progress
from grpo_trainer.contract.rollout_pod import ROLLOUT_PYTHON_ENV

from .plan import LOCAL_HOST, LocalError, ProcessPlan

#: SIGTERM, then this long for the process group to exit before SIGKILL. vLLM's CPU engine core needs a few seconds.
STOP_GRACE_S = 15.0
LOG_TAIL_CHARS = 2000  # what Kubernetes keeps of a log as the termination message (FallbackToLogsOnError: 2 KiB)
ROLLOUT_VENV = ".venv-rollout"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL_HOST, 0))
        return sock.getsockname()[1]


def find_rollout_python(explicit: str | None) -> str:
    """`--rollout-python`, else $GRPO_ROLLOUT_PYTHON, else the repo's .venv-rollout (vLLM lives in its own venv)."""
    candidates = [explicit, os.environ.get(ROLLOUT_PYTHON_ENV)]
    here = Path(__file__).resolve()
    candidates += [str(parent / ROLLOUT_VENV / "bin" / "python") for parent in here.parents]
    candidates.append(str(Path.cwd() / ROLLOUT_VENV / "bin" / "python"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise LocalError(
        f"no Python with vLLM found: pass --rollout-python, set {ROLLOUT_PYTHON_ENV}, or build {ROLLOUT_VENV} "
        "(make setup-rollout); or reuse a running server with --rollout-url"
    )


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class LocalProcess:
    plan: ProcessPlan
    log_path: Path
    popen: subprocess.Popen | None = None
    exit_code: int | None = None

    def start(self, extra_env: Mapping[str, str] | None = None) -> None:
        """Start the planned command, with `extra_env` over the plan's environment (what the run learned since the
        plan was made)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing after this returns
        # Own session = own process group: stopping it reaches vLLM's engine core and TRL's rollout worker too.
        self.popen = subprocess.Popen(
            self.plan.argv, env={**os.environ, **self.plan.env, **(extra_env or {})}, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self.exit_code = None

    def poll(self) -> int | None:
        if self.popen is not None and self.exit_code is None:
            self.exit_code = self.popen.poll()
        return self.exit_code

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`. Leaves no orphans."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may be gone while children (engine core, rollout worker) linger in its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the killed members are gone from the process table
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.poll()


def http_get(url: str, timeout: float = 2.0) -> str | None:
    """The body of a 200 answer, else None (not up yet, gone, gone mid-answer, or an error status)."""
    try:
        with urlopen(url, timeout=timeout) as response:  # noqa: S310 - our own local servers
            return response.read().decode() if response.status == 200 else None
    except (URLError, OSError, ValueError, HTTPException):  # HTTPException: a process killed mid-answer
        return None


def http_ok(url: str) -> bool:
    return http_get(url) is not None


def read_progress_blocking(url: str) -> ProgressReport | None:
    """The learner's /progress at `url`, or None (blocking; the operator's own poller is async)."""
    body = http_get(f"{url}{PROGRESS_PATH}")
    try:
        return parse_progress(body) if body else None
    except ValueError:
        return None
