"""`grporun local scale NAME N`: ask the `grporun local` running run NAME for N rollout servers.

It checks the request against the running run's bounds, then writes N into the run folder's `rollout-replicas`
file, which the supervising `grporun local` follows (local/scaling.py): it starts the added servers, rewrites the
run config the learner watches, and stops each removed server once the learner has drained it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...exit_codes import ExitCode
from ...local.scaling import REPLICAS_FILE, SupervisorRecord, write_atomically
from ..output import problem

COMMAND = "local scale"
HELP = "change the number of rollout servers of a run that `grporun local` is running"
EXAMPLES = """examples:
  grporun local scale tiny 2                    # a second vLLM server for runs/tiny/, admitted at the current weights
  grporun local scale tiny 1                    # back to one: the removed server drains, then stops
  grporun local scale tiny 2 --runs-dir /tmp/runs
"""


def replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}: a run needs a rollout server")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the run's name (its folder under --runs-dir)")
    parser.add_argument("replicas", metavar="N", type=replica_count, help="rollout servers wanted (at least 1)")
    parser.add_argument("--runs-dir", default="runs", help="the --runs-dir the run was started with (default runs)")


def main(args: argparse.Namespace) -> int:
    runs_dir = Path(args.runs_dir)
    run_dir = runs_dir / args.name
    if not (run_dir / "run.json").is_file():
        problem(COMMAND, f"NAME: no run {args.name!r} in {runs_dir}/ (grporun local MANIFEST --runs-dir {runs_dir} "
                         "makes its folder)")
        return ExitCode.USAGE
    record = SupervisorRecord.read(run_dir)
    if record is None:
        problem(COMMAND, f"run {args.name!r} is not running: no grporun local supervises {run_dir}/")
        return ExitCode.FAILED
    if (why := record.bounds.problem(args.replicas)) is not None:
        problem(COMMAND, f"N: {why}")
        return ExitCode.USAGE
    write_atomically(run_dir / REPLICAS_FILE, f"{args.replicas}\n")
    if args.replicas == record.replicas:
        print(f"run {args.name}: {args.replicas} rollout server(s) already")
    else:
        print(f"run {args.name}: {record.replicas} -> {args.replicas} rollout servers asked; grporun local "
              f"(pid {record.pid}) starts the new ones and stops removed ones once they drained")
    return ExitCode.OK
