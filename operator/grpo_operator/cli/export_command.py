"""`grporun export RUN_DIR`: export a `grporun local` run's model again, from its newest complete checkpoint to the
spec.output its run config names (a folder, an object store), after an export that failed; the manifest is the one
the learner writes. The credentials for an object store come from this machine's environment, as for the run.

`grporun export --cluster [-n NAMESPACE] RUN`: the same export for a GRPORun in the cluster of the current kube
context, in a pod like its learner's (cluster/export_runner.py), its result recorded on the run's status.output
(docs/cluster.md, "Where your model goes").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..exit_codes import ExitCode
from .output import problem

EXAMPLES = """examples:
  grporun export runs/tiny                          # the newest complete checkpoint
  grporun export runs/tiny --checkpoint runs/tiny/checkpoints/checkpoint-8
  grporun export --cluster -n team-a tiny           # GRPORun team-a/tiny, in a pod like its learner's
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..builders import TRAINER_IMAGE_ENV, default_trainer_image

    parser.add_argument("run_dir", metavar="RUN_DIR|RUN",
                        help="the run's folder (grporun local's runs/NAME); with --cluster, the GRPORun's name")
    parser.add_argument("--checkpoint", help="a checkpoint folder (default: the run's newest complete one); with "
                        "--cluster, as the learner's pod sees it")
    cluster = parser.add_argument_group("a run in a cluster (the current kube context)")
    cluster.add_argument("--cluster", action="store_true",
                         help="export a GRPORun in the cluster, in a pod like its learner's, and record the model "
                              "on its status.output")
    cluster.add_argument("-n", "--namespace", help="the run's namespace (default: the kube context's, else default)")
    cluster.add_argument("--trainer-image", default=default_trainer_image(),
                         help="the pod's image when spec.learner.image is unset and the learner's pod is gone: the "
                              f"operator's --trainer-image (${TRAINER_IMAGE_ENV})")
    cluster.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                         help="give up waiting for the export pod after this long (it is left running)")


def main(args: argparse.Namespace) -> int:
    if args.cluster:
        return cluster_export(args)
    if args.namespace is not None:
        problem("export", "--namespace names a GRPORun's namespace: it goes with --cluster")
        return ExitCode.USAGE
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


def cluster_export(args: argparse.Namespace) -> int:
    """The export pod of a GRPORun, followed to its end; the model recorded on status.output."""
    from .preflight import cluster_problem

    unusable = cluster_problem()
    if unusable is not None:
        problem("export", unusable)
        return ExitCode.FAILED
    from kubernetes import client

    from ..cluster.export_runner import ClusterExport, ExportProblem, ExportRequest

    request = ExportRequest(namespace=args.namespace or context_namespace(), run=args.run_dir,
                            trainer_image=args.trainer_image, checkpoint=args.checkpoint, timeout_s=args.timeout)
    exporter = ClusterExport(client.CoreV1Api(), client.CustomObjectsApi(), say=lambda line: print(line, flush=True))
    try:
        exported = exporter.export(request)
    except ExportProblem as error:
        problem("export", str(error))
        return ExitCode.FAILED
    report = exported.report
    print(f"model: {report.uri} (step {report.step}, {report.bytes} bytes, manifest sha256 {report.sha256}); "
          f"recorded on GRPORun {request.namespace}/{request.run} status.output")
    return ExitCode.OK


def context_namespace() -> str:
    """The namespace of the kube context in use (in a pod: its own), else `default`."""
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        pass
    try:
        _, active = config.list_kube_config_contexts(
            config_file=(os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")).split(os.pathsep)[0])
    except (ConfigException, OSError, TypeError, ValueError):
        return "default"
    return (active or {}).get("context", {}).get("namespace") or "default"
