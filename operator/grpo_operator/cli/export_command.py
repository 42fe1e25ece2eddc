"""`grporun export RUN_DIR`: export a `grporun local` run's model again, from its newest complete checkpoint to the
spec.output its run config names (a folder, an object store), after an export that failed; the manifest is the one
the learner writes. The credentials for an object store come from this machine's environment, as for the run.

In a cluster the same export runs in a pod like the learner's: `python -m grpo_trainer export --config
/etc/grpo/run.json` (docs/cluster.md, "Where your model goes").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..exit_codes import ExitCode

EXAMPLES = """examples:
  grporun export runs/tiny                          # the newest complete checkpoint
  grporun export runs/tiny --checkpoint runs/tiny/checkpoints/checkpoint-8
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (grporun local's runs/NAME)")
    parser.add_argument("--checkpoint", help="a checkpoint folder (default: the run's newest complete one)")


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from grpo_trainer.contract.config import load_run_config
    from grpo_trainer.storage.model_export import ExportError
    from grpo_trainer.storage.reexport import export_from_checkpoint, store_environ

    path = Path(args.run_dir) / "run.json"
    try:
        config = load_run_config(path.read_text(encoding="utf-8"))
    except OSError as error:
        print(f"grporun export: {path}: {error.strerror}", file=sys.stderr)
        return ExitCode.INVALID
    except ValidationError as error:
        print(f"grporun export: {path}: not a run config: {error.errors()[0]['msg']}", file=sys.stderr)
        return ExitCode.INVALID
    os.environ.update(store_environ(config))  # spec.output's endpoint and region, as the run's learner had them
    try:
        exported = export_from_checkpoint(config, args.checkpoint)
    except ExportError as error:
        print(f"grporun export: {error}", file=sys.stderr)
        return ExitCode.FAILED
    print(f"model: {exported.uri} (step {exported.step}, {exported.bytes} bytes, manifest sha256 {exported.sha256})")
    return ExitCode.OK
