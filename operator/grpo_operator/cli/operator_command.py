"""`grporun operator`: run the controller (kopf) against the cluster in the current kube context."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .. import metric_names
from ..builders import TRAINER_IMAGE_ENV, default_trainer_image


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NAME",
                       help="watch GRPORuns in this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch GRPORuns in every namespace")
    parser.add_argument("--metrics-port", type=int, default=metric_names.OPERATOR_METRICS_PORT,
                        help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help=f"liveness endpoint, e.g. http://0.0.0.0:{metric_names.OPERATOR_LIVENESS_PORT}/healthz")
    parser.add_argument("--liveness-port", type=int, default=None,
                        help="shorthand for --liveness=http://0.0.0.0:PORT/healthz")
    parser.add_argument("--trainer-image", default=default_trainer_image(),
                        help=f"image for rollout and learner pods whose spec names none (${TRAINER_IMAGE_ENV})")
    parser.add_argument("--reconcile-interval", type=float, default=5.0, metavar="SECONDS",
                        help="seconds between passes over each run (progress polls, deadlines)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(args: argparse.Namespace) -> int:
    if not args.namespace and not args.all_namespaces:
        print("grporun operator: pass --namespace NAME (repeatable) or --all-namespaces")
        return 2
    from .preflight import cluster_problem

    problem = cluster_problem()
    if problem is not None:
        print(f"grporun operator: {problem}", file=sys.stderr)
        return 1
    import kopf

    from .. import handlers  # noqa: F401  (registers the handlers with kopf)
    from ..reconcile import OperatorContext

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    liveness = args.liveness or (f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None)
    context = OperatorContext(trainer_image=args.trainer_image, reconcile_interval=args.reconcile_interval)
    if args.metrics_port:
        context.metrics.serve(args.metrics_port)
    # standalone: one replica, no peering objects (the chart runs one, with a Recreate strategy).
    asyncio.run(kopf.operator(
        standalone=True, clusterwide=args.all_namespaces, namespaces=args.namespace,
        memo=kopf.Memo(context=context), liveness_endpoint=liveness))
    return 0
