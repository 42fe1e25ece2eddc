"""metav1.Condition bookkeeping on a GRPORun status."""

from __future__ import annotations

import datetime

from ..apitime import format_time, parse_time
from ..run_status import Condition, ConditionType, GRPORunStatus

__all__ = ["Conditions", "format_time", "parse_time", "seconds_since"]


def seconds_since(now: datetime.datetime, earlier: str | None) -> float:
    """Seconds from a status timestamp to `now`; 0 when the timestamp is unset."""
    return 0.0 if earlier is None else (now - parse_time(earlier)).total_seconds()


_CONDITION_ORDER = [c.value for c in ConditionType]


class Conditions:
    """The conditions of one status: lastTransitionTime moves only when a condition's status value changes."""

    def __init__(self, status: GRPORunStatus, now: datetime.datetime, generation: int):
        self.status, self.now, self.generation = status, now, generation

    def get(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.status.conditions if c.type == kind.value), None)

    def is_true(self, kind: ConditionType) -> bool:
        condition = self.get(kind)
        return condition is not None and condition.status == "True"

    def remove(self, kind: ConditionType) -> None:
        """Drop a condition that no longer applies (EnvironmentsReady of a run whose environments were removed)."""
        self.status.conditions = [c for c in self.status.conditions if c.type != kind.value]

    def set(self, kind: ConditionType, value: str, reason: str, message: str) -> bool:
        """Set a condition; True when its status value changed (a transition)."""
        current = self.get(kind)
        changed = current is None or current.status != value
        updated = Condition(
            type=kind.value, status=value, reason=reason, message=message, observed_generation=self.generation,
            last_transition_time=format_time(self.now) if changed else current.last_transition_time)
        others = [c for c in self.status.conditions if c.type != kind.value]
        self.status.conditions = sorted(
            others + [updated], key=lambda c: _CONDITION_ORDER.index(c.type) if c.type in _CONDITION_ORDER else 99)
        return changed
