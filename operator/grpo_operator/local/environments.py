"""A local run's environment servers (spec.environments): their readiness probes, and the kubelet's in-place restarts
(local/kubelet.py decides them and carries them out).

On a cluster an environment server's pod has `restartPolicy: Always`: the kubelet restarts its container when it
exits, with a back-off, and counts the restart on the pod; the operator's state machine only sees the count
(`status.environments[].restarts`). `grporun local` does the kubelet's part here, so that the same state machine
sees a local server as it would see its pod.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPException
from urllib.error import URLError
from urllib.request import urlopen

from .plan import LOCAL_HOST, ProcessPlan
from .processes import LocalProcess

#: The kubelet's restart back-off, shortened for one machine: the first restart at once, then 1 s doubling up to
#: 60 s; a server that ran this long before it exited starts over at once.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
BACKOFF_RESET_S = 60.0
#: The waiting reason of a container between a crash and its restart (a pod shows the same).
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"


def probe_passes(plan: ProcessPlan) -> bool:
    """Whether the server's readiness probe passes now (a server without a probe is ready once it runs)."""
    probe = plan.probe
    if probe is None:
        return True
    port = urllib.parse.urlsplit(plan.url or "").port
    if probe.kind == "exec":
        try:
            return subprocess.run(list(probe.command), env={**os.environ, **plan.env}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=probe.timeout_s).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    if port is None:
        return False
    if probe.kind == "tcp":
        try:
            with socket.create_connection((LOCAL_HOST, port), timeout=probe.timeout_s):
                return True
        except OSError:
            return False
    try:  # an error status raises HTTPError (a URLError); a redirect is followed, as it passes for the kubelet
        with urlopen(f"http://{LOCAL_HOST}:{port}{probe.path}", timeout=probe.timeout_s) as response:
            return 200 <= response.status < 400
    except (URLError, OSError, ValueError, HTTPException):  # HTTPException: an answer that is not HTTP
        return False


@dataclass
class InPlaceRestarts:
    """`restartPolicy: Always` for local processes: restarts one that exited, after its back-off, and counts it."""

    clock: Callable[[], float] = time.monotonic
    restarts: Counter = field(default_factory=Counter)  # by server: what its pod's restartCount would be
    _backoff: dict = field(default_factory=dict)  # server -> the back-off after its next exit
    _exited_at: dict = field(default_factory=dict)  # server -> when it was seen exited
    _started_at: dict = field(default_factory=dict)  # server -> when it was last started

    def started(self, name: str) -> None:
        self._started_at[name] = self.clock()

    def due(self, process: LocalProcess) -> bool:
        """Whether `process` exited and its back-off is over (the exit is timed from when it is first seen)."""
        if process.popen is None or process.poll() is None:
            return False
        name, now = process.plan.name, self.clock()
        if name not in self._exited_at:
            self._exited_at[name] = now
            if now - self._started_at.get(name, now) >= BACKOFF_RESET_S:
                self._backoff.pop(name, None)  # it had run long enough: this exit is not a crash loop
        return now - self._exited_at[name] >= self._backoff.get(name, 0.0)

    def restart(self, process: LocalProcess, log: Callable[[str], None]) -> None:
        """Start `process` again in place, count it, and double its back-off for the next exit."""
        name, code = process.plan.name, process.poll()
        self._backoff[name] = min(max(self._backoff.get(name, 0.0) * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
        self._exited_at.pop(name, None)
        process.start()
        self.restarts[name] += 1
        self.started(name)
        log(f"restarted {name} in place after it exited with code {code} (restart {self.restarts[name]}, "
            f"log {process.log_path})")

    def waiting(self, name: str) -> bool:
        """Whether the server is between an exit and its restart (CrashLoopBackOff)."""
        return name in self._exited_at

    def forget(self, name: str) -> None:
        """A deleted server's pod is gone: one created again starts with no restarts."""
        for kept in (self.restarts, self._backoff, self._exited_at, self._started_at):
            kept.pop(name, None)
