"""grporun: one command line for the operator, local runs and manifest checks.

Each subcommand lives in its own module and is imported only when chosen, so `grporun validate` starts fast and
`grporun operator` never imports what it does not run. Every command speaks the same way (cli/output.py) and exits
with the same codes (grpo_operator/exit_codes.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from ..exit_codes import summary as exit_code_summary

DISTRIBUTION = "grpo-operator"

# subcommand -> (module, help). Each module exposes `add_arguments(parser)`, `main(args) -> int` and `EXAMPLES`.
SUBCOMMANDS = {
    "operator": ("grpo_operator.cli.operator_command", "run the operator (kopf) against the current cluster"),
    "local": ("grpo_operator.cli.local", "run a GRPORun manifest on this machine, no cluster"),
    "validate": ("grpo_operator.cli.validate", "check GRPORun manifests against the CRD schema and rules"),
    "render": ("grpo_operator.cli.render", "print the Kubernetes objects the operator would create for a manifest"),
    "export": ("grpo_operator.cli.export_command",
               "export a run's model again from its newest checkpoint (a local run, or --cluster)"),
}

EXAMPLES = """examples:
  grporun validate examples/tiny.yaml
  grporun local examples/tiny.yaml
  grporun operator --all-namespaces
"""


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: only the subcommand it names (its first word) gets its module imported and flags."""
    parser = argparse.ArgumentParser(
        prog="grporun", description=__doc__.splitlines()[0].removeprefix("grporun: ").capitalize(),
        epilog=f"{EXAMPLES}\n{exit_code_summary()}\n\nEach command: grporun COMMAND --help. Docs: docs/cli.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"grporun {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name) if name in argv[:1] else None
        # A command's own subcommand (`grporun local scale`), named by the second word: `NESTED` in its module.
        nested = getattr(module, "NESTED", {}).get(argv[1]) if module is not None and argv[1:2] else None
        sub_parser = sub.add_parser(name, help=help_text, description=help_text,
                                    epilog=f"{module.EXAMPLES}\n{exit_code_summary()}" if module else None,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        if nested is not None:
            inner = sub_parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
            nested_module = importlib.import_module(nested)
            nested_parser = inner.add_parser(argv[1], help=nested_module.HELP, description=nested_module.HELP,
                                             epilog=f"{nested_module.EXAMPLES}\n{exit_code_summary()}",
                                             formatter_class=argparse.RawDescriptionHelpFormatter)
            nested_module.add_arguments(nested_parser)
            nested_parser.set_defaults(handler=nested_module.main)
        elif module is not None:
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.handler(args) or 0)
