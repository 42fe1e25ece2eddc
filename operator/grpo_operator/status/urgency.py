"""Which status changes are written to the API server at once, and which may wait for the status interval
(`spec.progress.statusIntervalSeconds`): a change in progress counters, clocks or a running message alone waits (the
metrics carry it meanwhile); everything a user or a controller acts on is written at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Top-level status fields whose change is written at once.
URGENT_FIELDS = ("phase", "observedGeneration", "startTime", "completionTime", "restarts", "disruptions", "failure")


def urgent_fields(status: Mapping[str, Any]) -> tuple:
    """What of `status` must reach the API server at once: everything but progress counters, clocks and running
    messages (a message appearing or going is urgent; its text changing is not)."""
    conditions = tuple((c.get("type"), c.get("status"), c.get("reason")) for c in status.get("conditions") or [])
    # A rollout restart is written at once: the next pod is created from the count (its annotation).
    rollout_restarts = [s.get("restarts") for s in (status.get("rollout") or {}).get("servers") or []]
    return (*(repr(status.get(key)) for key in URGENT_FIELDS), conditions, status.get("message") is None,
            rollout_restarts)


def urgent_change(written: Mapping[str, Any], derived: Mapping[str, Any]) -> bool:
    """Whether the status `derived` this pass differs from the one last `written` in something urgent."""
    return urgent_fields(written) != urgent_fields(derived)
