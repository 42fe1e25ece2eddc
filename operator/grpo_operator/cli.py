"""`grporun`: one command line for the operator, local runs and manifest checks.

Each subcommand lives in its own module and is imported only when chosen, so `grporun validate` starts fast and
`grporun operator` never imports what it does not run.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module exposes `add_arguments(parser)` and `main(args) -> int`.
SUBCOMMANDS = {
    "operator": ("grpo_operator.main", "run the operator (kopf) against the current cluster"),
    "local": ("grpo_operator.local", "run a GRPORun manifest on this machine, no cluster"),
    "validate": ("grpo_operator.validate", "check GRPORun manifests against the CRD schema and rules"),
    "render": ("grpo_operator.render", "print the Kubernetes objects the operator would create for a manifest"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grporun", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name) if name in sys.argv[1:2] else None
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if module is not None:
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.argv[1:] = argv
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
