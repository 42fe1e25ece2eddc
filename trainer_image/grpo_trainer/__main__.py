"""`python -m grpo_trainer {rollout,learner} --config run.json`: the entrypoint of both pods.

Imports stay lazy: the rollout role runs in the vLLM image, which has neither trl nor the learner's transformers.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from . import contract as c
from .validation import first_error


def config_error_line(error: ValidationError) -> str:
    """The first validation error as one line naming the field: `training.epochs: input should be greater than 0`."""
    where, message = first_error(error, prefix="")
    more = error.error_count() - 1
    return f"{where or 'config'}: {message}" + (f" (and {more} more)" if more else "")


def read_config(path: str) -> c.RunConfig:
    with open(path, encoding="utf-8") as f:
        return c.load_run_config(f.read())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    rollout = sub.add_parser("rollout", help="run the vLLM rollout server for the run")
    rollout.add_argument("--config", required=True, help="the resolved run config (run.json)")
    rollout.add_argument("--port", type=int, default=c.ROLLOUT_HTTP_PORT)
    learner = sub.add_parser("learner", help="train: the GRPO learner (one process; accelerate launches several)")
    learner.add_argument("--config", required=True, help="the resolved run config (run.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = read_config(args.config)
    except OSError as error:
        print(f"grpo {args.role}: cannot read config {args.config}: {error.strerror}", file=sys.stderr)
        return c.EXIT_INVALID_CONFIG
    except ValidationError as error:
        print(f"grpo {args.role}: invalid config {args.config}: {config_error_line(error)}", file=sys.stderr)
        return c.EXIT_INVALID_CONFIG
    if args.role == "rollout":
        from .rollout import main as rollout_main

        return rollout_main(config, port=args.port)
    from .learner_main import main as learner_main

    return learner_main(config)


if __name__ == "__main__":
    sys.exit(main())
