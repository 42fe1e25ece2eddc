"""The exit codes of every `grporun` command: one meaning each, whichever command exits with it.

docs/cli.md shows this table (tests/docs/test_docs.py holds the two together); `grporun --help` lists it too. It
sits at the package root, not in cli/, because the local adapter's errors carry these codes too (local.plan's
LocalError) and an adapter does not import the command line.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    LOST_LEADERSHIP = 3
    INVALID = 4
    INTERRUPTED = 130


MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "done: the manifests are valid, the objects rendered, the local run Succeeded, the scale asked, "
                 "the model exported",
    ExitCode.FAILED: "the work ran and failed: the local run ended Failed, or the operator cannot use the cluster; "
                     "local scale of a run that is not running; an export that failed (the cause named)",
    ExitCode.USAGE: "the command line is wrong: an unknown flag, a bad value; a run folder that exists, without "
                    "--resume or --fresh; local scale of an unknown run, or to a count out of its bounds",
    ExitCode.LOST_LEADERSHIP: "the operator lost its Lease and stopped (its container restarts as a standby)",
    ExitCode.INVALID: "a manifest, or a file it names, is invalid or unreadable (validate --strict: a warning too); "
                      "a run folder without a readable run.json",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C); a local run's processes are stopped",
}


def summary() -> str:
    """The table as `--help` shows it."""
    return "exit codes:\n" + "\n".join(f"  {int(code):<4} {MEANINGS[code]}" for code in ExitCode)
