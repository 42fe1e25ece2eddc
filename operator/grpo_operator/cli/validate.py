"""`grporun validate MANIFEST...`: the API server's verdict on GRPORun manifests, without a cluster, and the
operator's: the rules the CRD cannot hold (a built-in reward's name) too.

Prints `OK PATH` on stdout for a manifest the operator would run; on stderr, `PATH: FIELD: PROBLEM` once per
problem and `PATH: warning: FIELD: PROBLEM` for what is valid but likely wrong in a cluster (no checkpoint volume,
a path on this machine). A user mistake never shows a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..manifest import ManifestError, cluster_warnings, read_grporun
from .exit_codes import ExitCode
from .output import manifest_lines, warning_line

EXAMPLES = """examples:
  grporun validate examples/gpu.yaml
  grporun validate --strict runs/*.yaml      # warnings fail too (exit 4)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST", help="GRPORun YAML files")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")


def check(path: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the manifest at `path`, one line each, naming the file; ([], []) when all is well."""
    try:
        run = read_grporun(path)
    except ManifestError as error:
        return manifest_lines(path, error), []
    return [], [warning_line(path, line) for line in cluster_warnings(run.spec)]


def main(args: argparse.Namespace) -> int:
    failed = False
    for path in args.manifests:
        errors, warnings = check(path)
        for line in errors + warnings:
            print(line, file=sys.stderr)
        failed = failed or bool(errors) or (args.strict and bool(warnings))
        if not errors:
            print(f"OK {path}" + (f" ({len(warnings)} warning{'s' * (len(warnings) > 1)})" if warnings else ""))
    return ExitCode.INVALID if failed else ExitCode.OK
