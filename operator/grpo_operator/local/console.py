"""What `grporun local` prints: event lines, the progress bar and the final summary.

On a terminal, rich draws a live bar and timestamps each line. Written to a file or a pipe, every event is one
plain line (no wrapping at rich's assumed 80 columns, no source-file column) and there is no bar: the summary at
the end carries the progress.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..eta import format_duration

EVENT_DISPLAY_CHARS = 300
#: While a server loads (minutes on a CPU), a line this often says what the run waits for; off a terminal, where
#: there is no bar, a progress line this often while the run trains.
PERIODIC_LINE_S = 30.0


def make_console() -> Console:
    """The console for everything but the summary: stderr, without rich's `file.py:NNN` column."""
    return Console(stderr=True, log_path=False)


def event_logger(console: Console) -> Callable[[str], None]:
    """One call per event line: rich's timestamped log on a terminal, one unwrapped plain line elsewhere."""
    if console.is_terminal:
        return console.log

    def log(message: str) -> None:
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        console.print(f"[{stamp}] {message}", soft_wrap=True, markup=False, highlight=False)

    return log


@dataclass
class Periodic:
    """At most one round of lines per `period_s` while a condition holds, the first `period_s` after it began."""

    period_s: float = PERIODIC_LINE_S
    clock: Callable[[], float] = time.monotonic
    _next_at: float | None = field(default=None)

    def due(self, holds: bool) -> bool:
        now = self.clock()
        if not holds:
            self._next_at = None  # the next wait is a new one: its first line comes a period after it starts
            return False
        if self._next_at is None:
            self._next_at = now + self.period_s
            return False
        if now < self._next_at:
            return False
        self._next_at = now + self.period_s
        return True


def one_line(text: str, limit: int = EVENT_DISPLAY_CHARS) -> str:
    """An event as one console line: a crash's message is the log tail (as with FallbackToLogsOnError)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def final_summary(status: dict[str, Any], logs: Mapping[str, Path] | None = None) -> str:
    """The lines printed when the run ends: phase, reason, progress, where the exported model is, and for a failed
    pod the log to read."""
    phase = status.get("phase", "Unknown")
    failure = status.get("failure") or {}
    reason = failure.get("reason") or next(
        (cond["reason"] for cond in status.get("conditions", []) if cond["type"] == phase and cond["status"] == "True"),
        "",
    )
    lines = [f"phase: {phase}" + (f"  reason: {reason}" if reason else "")]
    if status.get("message"):
        lines.append(f"message: {status['message']}")
    progress = status.get("progress")
    if progress:
        dropped = {k: v for k, v in (progress.get("dropped") or {}).items() if v}
        reward = progress.get("rewardMean")
        lines.append(
            f"progress: epoch {progress.get('epoch', 0)}/{_number(progress.get('epochs'))}, groups consumed "
            f"{progress.get('groupsConsumed', 0)}/{progress.get('groupsTotal', 0)}, "
            f"trained {progress.get('groupsTrained', 0)}, "
            f"dropped {progress.get('groupsDropped', 0)}" + (f" {dropped}" if dropped else "")
            + f", steps {progress.get('globalStep', 0)}" + (f", reward {reward:.3f}" if reward is not None else "")
        )
    output = status.get("output")
    if output:
        uri = output.get("uri", "")
        where = uri.removeprefix("file://") if uri.startswith("file://") else uri
        lines.append(f"model: {where} (step {output.get('step')}, {output.get('bytes')} bytes, manifest sha256 "
                     f"{output.get('sha256')})")
    failed_pod = failure.get("pod")
    if phase == "Failed" and failed_pod and logs and failed_pod in logs:
        lines.append(f"log: {logs[failed_pod]}")
    return "\n".join(lines)


def progress_line(status: dict[str, Any]) -> str:
    """The bar's numbers as one line, for a log file."""
    f = bar_fields(status)
    return (f"{f['phase']}: {f['completed']}/{f['total']} groups, epoch {f['epoch']}, trained {f['trained']}, "
            f"dropped {f['dropped']}, stall {f['stall']}, reward {f['reward']}, ETA {f['eta']}")


def bar_fields(status: dict[str, Any]) -> dict[str, Any]:
    progress = status.get("progress") or {}
    reward = progress.get("rewardMean")
    return {
        "total": max(progress.get("groupsTotal") or 0, 1),
        "completed": progress.get("groupsConsumed") or 0,
        "phase": status.get("phase") or "Pending",
        "epoch": f"{progress.get('epoch', 0)}/{_number(progress.get('epochs', '?'))}",
        "trained": progress.get("groupsTrained") or 0,
        "dropped": progress.get("groupsDropped") or 0,
        "stall": f"{progress.get('stallStreak', 0)}/{progress.get('stallLimit', 0)}",
        "reward": "-" if reward is None else f"{reward:.3f}",
        "eta": format_duration(progress.get("estimatedRemainingSeconds")),
    }


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Progress]:
    columns = (
        TextColumn("[bold]{task.fields[phase]}"), BarColumn(bar_width=16),
        TextColumn("{task.completed}/{task.total} groups, epoch {task.fields[epoch]}, trained {task.fields[trained]}, "
                   "dropped {task.fields[dropped]}, stall {task.fields[stall]}, reward {task.fields[reward]}, "
                   "ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    # Off a terminal a live bar cannot redraw: its one frame at the end would be cut at 80 columns.
    with Progress(*columns, console=console, transient=False, refresh_per_second=2,
                  disable=not console.is_terminal) as bar:
        yield bar
