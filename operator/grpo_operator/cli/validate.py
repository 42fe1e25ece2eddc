"""`grporun validate MANIFEST...`: the API server's verdict on GRPORun manifests, without a cluster.

Prints `OK PATH` for a manifest the API server would admit and `PATH: FIELD: PROBLEM` once per problem otherwise;
exits 1 if any manifest has a problem. A user mistake never shows a traceback.
"""

from __future__ import annotations

import argparse

from grpo_operator.manifest import ManifestError, ManifestInvalid, read_grporun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST", help="GRPORun YAML files")


def check(path: str) -> list[str]:
    """One line per problem with the manifest at `path`, each naming the file; [] when it is valid."""
    try:
        read_grporun(path)
    except ManifestInvalid as invalid:
        return [f"{path}: {line}" for line in invalid.errors]
    except ManifestError as error:  # its message already names the file
        return [str(error)]
    return []


def main(args: argparse.Namespace) -> int:
    failed = False
    for path in args.manifests:
        problems = check(path)
        failed = failed or bool(problems)
        for problem in problems:
            print(problem)
        if not problems:
            print(f"OK {path}")
    return 1 if failed else 0
