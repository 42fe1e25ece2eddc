"""One pydantic validation error as one line naming the field, for the learner's config and the operator's spec.

Torch-free, like `grpo_trainer.contract`: the operator imports it too. The field is named as it is written on the
wire (camelCase, list items as `[0]`), so a user finds it in the manifest or `run.json` they wrote.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


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
