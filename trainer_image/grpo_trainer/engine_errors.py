"""The line that says why a vLLM server died, out of its log.

When vLLM's engine dies the server prints the root error once (`RuntimeError: CPU Generator does not use offset`), then
a wrapper per worker and process (`RuntimeError: Worker failed with error ...`, `EngineDeadError: EngineCore
encountered an issue. See stack trace (above) ...` once per open request) and at exit a nanobind reference-leak dump.
The run's failure message must carry the root line, not that tail. Torch-free: the rollout entrypoint uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: vLLM prefixes each line with the process (`(Worker pid=3196) `) and a log header (`ERROR 11-30 17:15:11 [x.py:1] `).
_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
_ERROR = re.compile(r"^((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)): (.+)$")
#: Wrappers that only point at the root error printed before them.
_WRAPPERS = (
    "EngineDeadError", "Worker failed with error", "See stack trace (above)", "EngineCore encountered an issue",
)


def engine_error_line(lines: Iterable[str]) -> str | None:
    """The first `SomeError: message` line that is not a wrapper, without vLLM's prefixes; None if there is none."""
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip("\n")).strip()
        match = _ERROR.match(line)
        if match and not any(wrapper in line for wrapper in _WRAPPERS):
            return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"[:500]
    return None
