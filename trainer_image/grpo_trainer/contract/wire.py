"""What every model on the wire shares: camelCase aliases, the counts and names a report may carry, and a pydantic
validation error as one line naming the field (for the learner's config and the operator's spec alike).

A field is named as it is written on the wire (camelCase, list items as `[0]`), so a user finds it in the manifest or
`run.json` they wrote.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    """camelCase on the wire (like the CRD), snake_case in Python; unknown fields are an error, not a silent no-op."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


#: The largest integer the Kubernetes API stores (int64): the operator copies the report's counts into status.
INT64_MAX = 2**63 - 1
#: A count in a report: within what the API server stores.
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


#: A reason, phase or state named in a report: a newer learner may name one this version does not know, which is
#: carried as its text (bounded like a label value: it reaches status keys and messages).
REPORTED_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
#: The most drop or mask reasons one report may name (this version knows 7 and 2).
MAX_REPORTED_REASONS = 32
_Name = TypeVar("_Name", bound=Enum)


def reported_name(value: object) -> str:
    if not isinstance(value, str):  # no coercion: `7` or `true` is no name
        raise ValueError(f"input should be a string, not {type(value).__name__}")
    if not REPORTED_NAME.fullmatch(value):
        raise ValueError(f"{value[:70]!r} is not a name (a letter, then up to 62 letters, digits or underscores)")
    return value


def known_or_text(names: type[_Name]) -> Any:
    """A report field of enum `names` that keeps a name this version does not know as text: a learner image
    upgraded before the operator must not make every report unreadable."""
    def validate(value: object) -> _Name | str:
        text = reported_name(value)
        try:
            return names(text)
        except ValueError:
            return text
    return Annotated[names | str, PlainValidator(validate),
                     PlainSerializer(lambda value: getattr(value, "value", value), return_type=str,
                                     when_used="json")]


def reason_counts(known: tuple[str, ...], what: str, value: dict[str, int]) -> dict[str, int]:
    """Counts by reason: every reason this version knows (0 when absent) first, then those only a newer learner
    knows, by name; their sum must fit what the API server stores."""
    newer = [reason for reason in value if reason not in known]
    if len(newer) > MAX_REPORTED_REASONS:
        raise ValueError(f"more than {MAX_REPORTED_REASONS} {what} this version does not know")
    for reason in newer:
        reported_name(reason)
    if sum(value.values()) > INT64_MAX:
        raise ValueError(f"the {what} counts add up to more than {INT64_MAX}")
    return {**{reason: int(value.get(reason, 0)) for reason in known}, **{reason: value[reason] for reason in newer}}


class ReportModel(WireModel):
    """What a learner reports: the operator reads it from a tenant's pod and copies it into the run's status, so
    every number is one the Kubernetes API can carry (JSON has no NaN or Infinity; integers are int64). A field a
    newer learner added is ignored (forward-compatible, as Kubernetes clients are); wrong types are still refused."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


def field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """`prefix` plus a pydantic location: `("rewards", 0, "name")` -> `spec.rewards[0].name`."""
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def error_message(error: dict[str, Any]) -> str:
    """A pydantic error's message, one line, lower-case first letter, without pydantic's `Value error, ` prefix."""
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] == "missing":
        return "required field is missing"
    message = " ".join(str(error["msg"]).removeprefix("Value error, ").split())
    return message[:1].lower() + message[1:]


def first_error(error: ValidationError, prefix: str = "") -> tuple[str, str]:
    """(field path, message) of the first error; the path is `prefix` alone for an error on the whole value."""
    first = error.errors()[0]
    return field_path(prefix, first["loc"]), error_message(first)


def config_error_line(error: ValidationError) -> str:
    """The first validation error as one line naming the field: `training.epochs: input should be greater than 0`."""
    where, message = first_error(error, prefix="")
    more = error.error_count() - 1
    return f"{where or 'config'}: {message}" + (f" (and {more} more)" if more else "")
