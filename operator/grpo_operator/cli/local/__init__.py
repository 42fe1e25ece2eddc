"""`grporun local MANIFEST`: run a GRPORun on this machine, no cluster.

The manifest is validated like the API server would (grpo_operator.manifest), the run config is resolved like the
operator's ConfigMap (grpo_operator.resolve), the processes are started with the commands and environment of the
operator's pods (grpo_operator.builders, with local paths, ports and interpreters swapped in), and the run's status
comes from the operator's own pure state machine (grpo_operator.status.derive_status), fed with the local processes
as pods. So a run that succeeds here exercises the same entrypoints, exit codes and status rules as in a cluster.

The package is split by concern: plan.py (pure: manifest -> processes), processes.py (starting, stopping and
reading them), supervise.py (the run's loop), scaling.py (its rollout servers changed while it runs; the
`grporun local scale NAME N` command is scale_command.py) and console.py (what is printed).
"""

from __future__ import annotations

import argparse
import os
import sys

from ...api import Phase
from ...exit_codes import ExitCode
from ...local.console import event_logger, final_summary, make_console
from ...local.plan import LocalError
from ...local.supervise import prepare, supervise
from ...manifest import ManifestError
from ...pod_overrides import local_env_notes
from ..output import manifest_problem, problem

EXAMPLES = """examples:
  grporun local examples/tiny.yaml                  # starts a vLLM server and the learner; writes runs/tiny/
  grporun local examples/tiny.yaml --fresh          # delete runs/tiny/ from an earlier run and start over
  grporun local examples/tiny.yaml --resume         # continue runs/tiny/ from its newest checkpoint
  grporun local run.yaml --rollout-url http://127.0.0.1:8000   # reuse a running server (same model)
  grporun local scale tiny 2                        # while it runs (another terminal): 2 rollout servers
"""

#: `grporun local WORD ...`: subcommands of their own (a manifest of that name: write it `./WORD`).
NESTED = {"scale": "grpo_operator.cli.local.scale_command"}


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST", help="a GRPORun YAML file")
    parser.add_argument("--runs-dir", default="runs",
                        help="where runs/<name>/ (run.json, logs/<pod>.log, checkpoints/, weights/, output/) go")
    earlier = parser.add_mutually_exclusive_group()
    earlier.add_argument("--resume", action="store_true",
                         help="keep runs/<name>/ from an earlier run and resume from its newest checkpoint")
    earlier.add_argument("--fresh", action="store_true",
                         help="delete runs/<name>/ from an earlier run (its checkpoints too) and start over")
    parser.add_argument("--rollout-url", action="append", metavar="URL",
                        help="use this running vLLM server (started with VLLM_SERVER_DEV_MODE=1 on the same model) "
                             "instead of starting one; repeat for several")
    parser.add_argument("--rollout-python", metavar="PATH",
                        help="the Python that has vLLM (default: $GRPO_ROLLOUT_PYTHON, else .venv-rollout)")
    parser.add_argument("--rollout-restart-limit", type=non_negative, metavar="N",
                        help="restarts of each rollout server that exits (0 counts: a server never ends by itself) "
                             "before its exit fails the run; separate from runPolicy.backoffLimit (default: the "
                             "manifest's runPolicy.rolloutRestartLimit, 3)")
    parser.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between looks at the processes and the learner's progress (default 1)")


def main(args: argparse.Namespace) -> int:
    console = make_console()
    log = event_logger(console)
    try:
        local = prepare(args)
    except ManifestError as error:
        return manifest_problem(args.manifest, error)
    except LocalError as error:
        problem("local", str(error))
        return error.exit_code
    log(f"run {local.name}: config, logs and checkpoints in {local.run_dir}")
    for note in local.notes:
        log(note)
    roles = [("rollout", local.spec.rollout), ("learner", local.spec.learner),
             *((f"environment {environment.name}", environment) for environment in local.spec.environments or [])]
    for role, role_spec in roles:
        for note in local_env_notes(role, role_spec.pod_template_override, os.environ):
            log(note)
    interrupted = False
    try:
        status = supervise(local, console, log, args.poll_interval)
    except KeyboardInterrupt:
        interrupted = True
        status = local.status or {}
    finally:
        local.stop_all()
    if interrupted:
        print("grporun local: interrupted; stopped the run's processes", file=sys.stderr)
        return ExitCode.INTERRUPTED
    print(final_summary(status, local.logs()))
    if local.spec.output is None and status.get("phase") == Phase.SUCCEEDED.value:
        print(f"model: {local.run_dir / 'output' / 'final'} (set spec.output to export it with a manifest)")
    return ExitCode.OK if status.get("phase") == Phase.SUCCEEDED.value else ExitCode.FAILED
