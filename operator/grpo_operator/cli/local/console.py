"""What `grporun local` prints: event lines, the progress bar and the final summary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ...eta import format_duration

EVENT_DISPLAY_CHARS = 300


def one_line(text: str, limit: int = EVENT_DISPLAY_CHARS) -> str:
    """An event as one console line: a crash's message is the log tail (as with FallbackToLogsOnError)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def final_summary(status: dict[str, Any]) -> str:
    """The lines printed when the run ends: phase, reason, progress."""
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
    return "\n".join(lines)


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
    with Progress(*columns, console=console, transient=False, refresh_per_second=2) as bar:
        yield bar
