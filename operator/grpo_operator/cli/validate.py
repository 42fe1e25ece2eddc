"""`grporun validate MANIFEST...`: the API server's verdict on GRPORun manifests, without a cluster, and the
operator's: the rules the CRD cannot hold (a built-in reward's name) too.

Prints `OK PATH` on stdout for a manifest the operator would run; on stderr, `PATH: FIELD: PROBLEM` once per
problem and `PATH: warning: FIELD: PROBLEM` for what is valid but likely wrong in a cluster (no checkpoint volume,
a path on this machine). The fit check (grpo_operator.fit) adds its refusals and warnings there, and its estimates
(or why it was skipped) on stdout as `PATH: fit: ...`; a hub model's config.json is fetched from the hub that
HF_ENDPOINT names (huggingface.co without it), with HF_TOKEN (or a saved login) for a gated one. A user mistake never
shows a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

from ..exit_codes import ExitCode
from ..fit import FitReport, ModelConfigError, check_spec_fit
from ..manifest import GRPORun, ManifestError, cluster_warnings, read_grporun
from ..model_config import HUB_ENDPOINT_ENV, HubAccess, read_model_config
from .output import manifest_lines, warning_line

EXAMPLES = """examples:
  grporun validate examples/gpu.yaml
  grporun validate --strict runs/*.yaml      # warnings fail too (exit 4)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST", help="GRPORun YAML files")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")


class Verdict(NamedTuple):
    errors: list[str]
    warnings: list[str]
    notes: list[str]  # the fit check's estimates, or why it was skipped


def fit_report(run: GRPORun, manifest_dir: str) -> FitReport:
    """The fit check for a manifest, its model's config.json read from a local path (relative to the manifest's
    folder) or the hub. The GPU is the one the nodeSelector names: no cluster's nodes are read."""
    if run.spec.learner.device != "cuda" and run.spec.rollout.device != "cuda":
        return FitReport([], [], [])
    config, why = read_model_config(run.spec.model, HubAccess(endpoint=os.environ.get(HUB_ENDPOINT_ENV)), manifest_dir)
    if config is not None:
        try:
            return check_spec_fit(run.spec, config)
        except ModelConfigError as error:
            why = f"spec.model {run.spec.model}: {error}"
    return FitReport([], [], [f"check skipped: {why}"])


def check(path: str) -> Verdict:
    """Errors, warnings and notes for the manifest at `path`, one line each, naming the file."""
    try:
        run = read_grporun(path)
    except ManifestError as error:
        return Verdict(manifest_lines(path, error), [], [])
    fit = fit_report(run, os.path.dirname(os.path.abspath(path)))
    warnings = [warning_line(path, line) for line in cluster_warnings(run.spec) + fit.warnings]
    return Verdict([f"{path}: {line}" for line in fit.errors], warnings, [f"{path}: fit: {line}" for line in fit.notes])


def main(args: argparse.Namespace) -> int:
    failed = False
    for path in args.manifests:
        errors, warnings, notes = check(path)
        for line in errors + warnings:
            print(line, file=sys.stderr)
        failed = failed or bool(errors) or (args.strict and bool(warnings))
        if not errors:
            print(f"OK {path}" + (f" ({len(warnings)} warning{'s' * (len(warnings) > 1)})" if warnings else ""))
        for line in notes:
            print(line)
    return ExitCode.INVALID if failed else ExitCode.OK
