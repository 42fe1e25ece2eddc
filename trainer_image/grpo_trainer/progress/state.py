"""ProgressState: what a checkpoint keeps of RolloutProgress, with its own versioned JSON form.

Positions are absolute (prompts x passes), so a resumed worker, whose ids start at 0 again, can be placed. The JSON
carries `version`: a learner refuses a state newer than it understands instead of misreading it, and reads the
states of the versions before. A state without `version` predates it and is version 1 (the same keys). Version 2
has the keys of 1; the checkpoint marker that carries it records each file's SHA-256 beside its size, which a
learner that reads only version 1 would take for a torn marker.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

#: The version this learner writes; it reads every version up to it.
PROGRESS_STATE_VERSION = 2
#: Validation errors named in a message, at most.
_ERRORS_SHOWN = 3


class ProgressStateError(ValueError):
    """A checkpointed progress state that cannot be read; the message says why in one line."""


@dataclass(frozen=True)
class ProgressState:
    #: The first position not consumed: the resumed worker starts there.
    first_unconsumed: int = field(metadata={"ge": 0})
    #: Positions consumed beyond it (trained, dropped or regenerated groups that finished out of order).
    consumed_after: list[int]
    #: Which of those were dropped, by reason (a `DropReason` value; the checkpoint marker's schema checks them).
    dropped_after: dict[str, list[int]]
    #: The length of the run of drops that ends right before `first_unconsumed` (the stall streak carried over).
    prefix_streak: int
    groups_trained: int
    dropped: dict[str, int]
    epochs_done: int
    #: Regenerated groups so far, and the run's bound as moved by their stand-ins (None: unbounded).
    regenerated: int = 0
    bound: int | None = None
    #: Regenerated positions before `first_unconsumed` (counted) and after it (listed).
    transparent_before: int = 0
    transparent_after: list[int] = field(default_factory=list)
    #: Position of a stand-in not settled yet -> how many times its slot was regenerated.
    regeneration_attempts: dict[int, int] = field(default_factory=dict)
    #: Of `regenerated`, the groups regenerated because an environment failed their episodes.
    regenerated_environment: int = 0
    version: int = PROGRESS_STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (string keys, reasons by value)."""
        return _ADAPTER.dump_python(self, mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, payload: Any) -> ProgressState:
        """The state a JSON object holds; keys it does not know (a marker's own, say) are ignored."""
        if not isinstance(payload, dict):
            raise ProgressStateError(f"holds a JSON {type(payload).__name__}, not an object")
        check_version(payload)
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return _ADAPTER.validate_python({"version": 1} | {k: v for k, v in payload.items() if k in known})
        except ValidationError as error:
            problems = [f"{'.'.join(str(p) for p in e['loc']) or 'state'}: {e['msg']}" for e in error.errors()]
            more = f" and {len(problems) - _ERRORS_SHOWN} more" if len(problems) > _ERRORS_SHOWN else ""
            raise ProgressStateError(
                f"is incomplete or malformed ({'; '.join(problems[:_ERRORS_SHOWN])}{more})") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> ProgressState:
        if not text.strip():
            raise ProgressStateError("is empty")
        try:
            payload = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProgressStateError(f"is not valid JSON ({error}): cut short while written or copied?") from None
        return cls.from_dict(payload)


_ADAPTER = TypeAdapter(ProgressState)


def check_version(payload: dict[str, Any]) -> None:
    """Refuse a state written by a newer learner before reading any other key: its keys may mean other things."""
    version = payload.get("version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version > PROGRESS_STATE_VERSION:
        raise ProgressStateError(
            f"has progress state version {version}, newer than this learner reads ({PROGRESS_STATE_VERSION}): "
            "resume it with the learner image that wrote it, or a newer one")
