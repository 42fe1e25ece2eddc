"""`grporun render MANIFEST`: print, as YAML, the objects the operator would create for a GRPORun.

The same validation and defaulting as `grporun validate`, then the same pure builders the operator calls, so what
this prints is what a cluster gets. The run's uid only exists once the API server stores the run; the
ownerReferences carry `--uid` (a placeholder by default), so the output is for reading, not for `kubectl apply`.
"""

from __future__ import annotations

import argparse

import yaml

from ..builders import TRAINER_IMAGE_ENV, build_children, default_trainer_image
from ..exit_codes import ExitCode
from ..manifest import ManifestError, read_grporun
from ..run_ref import RunRef
from .output import manifest_problem

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
EXAMPLES = """examples:
  grporun render examples/tiny.yaml > objects.yaml
  grporun render run.yaml -n team-a --trainer-image registry.example.com/grpo-trainer:cuda
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST", help="a GRPORun YAML file")
    parser.add_argument("-n", "--namespace", default="default",
                        help="namespace for a manifest that names none (default: default)")
    parser.add_argument("--trainer-image", default=default_trainer_image(),
                        help=f"image for pods whose spec names none, as the operator's own flag (${TRAINER_IMAGE_ENV})")
    parser.add_argument("--uid", default=PLACEHOLDER_UID, help="the GRPORun's uid for the ownerReferences")


def render(path: str, *, namespace: str, trainer_image: str, uid: str) -> str:
    run = read_grporun(path, default_namespace=namespace)
    objects = build_children(RunRef(run.name, run.namespace, uid), run.spec, trainer_image=trainer_image)
    return yaml.safe_dump_all(objects, sort_keys=False)


def main(args: argparse.Namespace) -> int:
    try:
        objects = render(args.manifest, namespace=args.namespace, trainer_image=args.trainer_image, uid=args.uid)
    except ManifestError as error:
        return manifest_problem(args.manifest, error)
    print(objects, end="")
    return ExitCode.OK
