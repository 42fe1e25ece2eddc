"""What the operator knows of a rollout server's pod: its probes' timing, the line its entrypoint prints when the
server exits and the root error line out of a dead vLLM server's log, and the variable that names the Python with
vLLM in it. And what the learner's generation requests and the server's weight-version gate say to each other.

When vLLM's engine dies the server prints the root error once (`RuntimeError: CPU Generator does not use offset`), then
a wrapper per worker and process (`RuntimeError: Worker failed with error ...`, `EngineDeadError: EngineCore
encountered an issue. See stack trace (above) ...` once per open request) and at exit a nanobind reference-leak dump.
The run's failure message must carry the root line, not that tail.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: The last line the rollout entrypoint prints when the server exits; `grporun local` and the operator read it.
EXIT_LINE_PREFIX = "grpo rollout: "
#: Names the interpreter that has vLLM when it is not the one running this entrypoint: the trainer image keeps vLLM
#: in its own venv (vLLM 0.32 pins transformers<5.20, the learner needs 5.24); `grporun local` reads it too.
ROLLOUT_PYTHON_ENV = "GRPO_ROLLOUT_PYTHON"

#: A learner's generation request names the weight version (`vN`) the server must hold at least. A server that holds
#: an older one, or is loading weights, answers WEIGHT_REFUSED_STATUS with SERVED_WEIGHT_VERSION_HEADER: the version
#: it holds, or LOADING_WEIGHTS (grpo_trainer.server.version_gate); the learner sends the request elsewhere
#: (grpo_trainer.rollout.router). A request without the header is served whatever the server holds.
MIN_WEIGHT_VERSION_HEADER = "x-grpo-min-weight-version"
SERVED_WEIGHT_VERSION_HEADER = "x-grpo-weight-version"
WEIGHT_REFUSED_STATUS = 409
LOADING_WEIGHTS = "loading"

#: The generation probe's wait for its one token (grpo_trainer.server.health).
PROBE_TIMEOUT_S = 30.0
#: The rollout server's liveness (the pod's probe, and `grporun local`'s): one generation probe every
#: LIVENESS_PERIOD_S; LIVENESS_FAILURE_THRESHOLD failures in a row (a minute and more without a token) mean hung,
#: and the server is restarted. A weight sync holds a server paused for seconds, far below that.
LIVENESS_PERIOD_S = 20
LIVENESS_FAILURE_THRESHOLD = 3
#: The pod's startup probe waits this long for `/health` inside one run, so a model load costs one failure (one
#: Warning event) per 5 min. The kubelet lets 25 Warnings per pod through, then one per 5 min: a plain 10 s probe
#: spent them all in a 5 min load, and the liveness failures of a server that hung later were never shown.
STARTUP_WAIT_S = 290
#: How often the startup probe asks `/health` while it waits, and how long one ask may take: a loading server
#: answers at once or refuses the connection, so a slow answer is a busy machine, not a verdict.
STARTUP_POLL_S = 1.0
HEALTH_REQUEST_TIMEOUT_S = 5.0

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
