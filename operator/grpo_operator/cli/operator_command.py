"""`grporun operator`: run the controller (kopf) against the cluster in the current kube context."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any

from .. import metric_names
from ..builders import TRAINER_IMAGE_ENV, default_trainer_image
from ..cluster.leader import DEFAULT_LEASE_NAME, LeaseTimings
from ..exit_codes import ExitCode
from .output import problem

EXAMPLES = """examples:
  grporun operator --all-namespaces
  grporun operator -n team-a -n team-b --leader-elect --lease-namespace grpo-system
"""


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
    parser.add_argument("--read-gpu-nodes", action="store_true",
                        help="let the fit check list the nodes labelled by NVIDIA's GPU feature discovery, to know "
                             "the GPU of a run whose nodeSelector does not name it (needs list on nodes)")
    election = parser.add_argument_group("leader election (run several replicas, one active)")
    election.add_argument("--leader-elect", action="store_true",
                          help="reconcile only while holding a coordination.k8s.io Lease; wait for it otherwise")
    election.add_argument("--lease-name", default=DEFAULT_LEASE_NAME, help="the Lease's name")
    election.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or "default",
                          help="the Lease's namespace (default: $POD_NAMESPACE, else 'default')")
    defaults = LeaseTimings()
    election.add_argument("--lease-duration", type=float, default=defaults.lease_duration, metavar="SECONDS",
                          help="a standby takes the Lease once it has not been renewed for this long")
    election.add_argument("--renew-deadline", type=float, default=defaults.renew_deadline, metavar="SECONDS",
                          help="the leader exits when it could not renew for this long (< --lease-duration)")
    election.add_argument("--retry-period", type=float, default=defaults.retry_period, metavar="SECONDS",
                          help="seconds between renewals, and between a standby's attempts")


def main(args: argparse.Namespace) -> int:
    if not args.namespace and not args.all_namespaces:
        problem("operator", "pass --namespace NAME (repeatable) or --all-namespaces")
        return ExitCode.USAGE
    try:
        timings = LeaseTimings(args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as error:
        problem("operator", str(error))
        return ExitCode.USAGE
    from .preflight import cluster_problem

    unusable = cluster_problem()
    if unusable is not None:
        problem("operator", unusable)
        return ExitCode.FAILED
    import kopf

    from ..cluster import handlers  # noqa: F401  (registers the handlers with kopf)
    from ..cluster.fit_check import GpuNodes
    from ..cluster.reconcile import OperatorContext

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    liveness = args.liveness or (f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None)
    context = OperatorContext(trainer_image=args.trainer_image, reconcile_interval=args.reconcile_interval,
                              gpu_nodes=GpuNodes() if args.read_gpu_nodes else None)
    if args.metrics_port:
        context.metrics.serve(args.metrics_port)
    # standalone: no kopf peering objects; with --leader-elect, the Lease decides which replica runs kopf at all.
    operator = kopf.operator(standalone=True, clusterwide=args.all_namespaces, namespaces=args.namespace,
                             memo=kopf.Memo(context=context), liveness_endpoint=liveness)
    if not args.leader_elect:
        asyncio.run(operator)
        return ExitCode.OK
    return asyncio.run(_lead(operator, args, timings, liveness))


async def _lead(operator: Coroutine[Any, Any, None], args: argparse.Namespace, timings: LeaseTimings,
                liveness: str | None) -> int:
    """Wait for the Lease (answering the liveness probe meanwhile), then run kopf while renewing it."""
    import kopf

    from ..cluster.leader import LeaderElector, LeadershipLost, LeaseClient, default_identity
    from .standby import standby_liveness

    logger = logging.getLogger("grpo_operator.cluster.leader")
    settings = kopf.OperatorSettings()
    settings.networking.request_timeout = timings.renew_deadline / 2
    elector = LeaderElector(LeaseClient(args.lease_namespace, args.lease_name, settings, logger),
                            default_identity(), timings, logger)
    async with standby_liveness(liveness):
        await elector.acquire()
    running = asyncio.create_task(operator, name="kopf operator")
    holding = asyncio.create_task(elector.hold(), name="lease renewal")
    await asyncio.wait({running, holding}, return_when=asyncio.FIRST_COMPLETED)
    if holding.done() and isinstance(holding.exception(), LeadershipLost):
        # Stop acting now: a standby may take the Lease once lease_duration has passed since the last renewal.
        logger.error("lost leadership: %s; exiting", holding.exception())
        logging.shutdown()
        os._exit(ExitCode.LOST_LEADERSHIP)  # at once, before a standby can take over
    holding.cancel()
    await elector.release()
    running.result()
    return ExitCode.OK
