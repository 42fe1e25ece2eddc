"""How every `grporun` command speaks: results on stdout, problems on stderr, one line each.

A manifest's problem is `PATH: FIELD: PROBLEM` (a warning: `PATH: warning: FIELD: PROBLEM`), the same line
whichever command found it; any other problem is `grporun COMMAND: PROBLEM`. So `grporun render run.yaml > out.yaml`
leaves errors on the terminal, not in the file.
"""

from __future__ import annotations

import sys

from ..exit_codes import ExitCode
from ..manifest import ManifestError, ManifestInvalid


def problem(command: str, text: str) -> None:
    print(f"grporun {command}: {text}", file=sys.stderr)


def manifest_lines(path: str, error: ManifestError) -> list[str]:
    """The lines for a manifest that could not be read or is invalid: each names the file."""
    if isinstance(error, ManifestInvalid):
        return [f"{path}: {line}" for line in error.errors]
    return [str(error)]  # its message already names the file


def manifest_problem(path: str, error: ManifestError) -> ExitCode:
    """Print a manifest's problems on stderr; the exit code for them."""
    for line in manifest_lines(path, error):
        print(line, file=sys.stderr)
    return ExitCode.INVALID


def warning_line(path: str, text: str) -> str:
    return f"{path}: warning: {text}"
