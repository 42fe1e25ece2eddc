"""kopf wiring, nothing else: which events reach which function. The logic is in reconcile.py (I/O) and
the status package (decisions); the operator's configuration comes in as `memo.context` (reconcile.OperatorContext).

One task per run does every pass for that run (run_loops.py), so passes of one run never overlap (kopf runs timers
and change handlers of one object concurrently, which would race on the status). It is not a `kopf.daemon`: kopf
puts a finalizer on every object with a daemon, and no finalizer is needed here (docs/operator.md, "Deleting a
run"). Pods reach it through an in-memory index fed by one pod watch, so a pass costs no API list.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from ..api import CONTROLLER_NAME, FINALIZER, GROUP, KOPF_ANNOTATION_PREFIX, PLURAL, RUN_LABEL, VERSION, managed_by
from . import events
from .pods import observe_pod, pod_facts
from .reconcile import OperatorContext, reconcile_run
from .run_loops import RunLoops


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf settings that differ from its defaults, and why."""
    # Our own prefixes, not kopf.zalando.org, on everything kopf writes onto a GRPORun. No handler needs a finalizer,
    # so kopf adds none, and it removes this one from runs that still carry it from an operator that used one.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_ANNOTATION_PREFIX, key="last-handled-configuration")
    # The run's events are posted by grpo_operator.cluster.events; these name whatever kopf itself may post.
    settings.posting.reporting_component = events.COMPONENT
    settings.posting.event_name_prefix = f"{events.COMPONENT}-"
    settings.posting.loggers = False  # events are the transitions the status package emits, not log lines
    # The 300 s default holds a reconcile pass hostage to one hung request.
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    # The API server ends each watch after server_timeout; a stream that went silent without closing (a dead
    # load-balancer connection) is abandoned after inactivity_timeout and resumed from its last resourceVersion.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.inactivity_timeout = 330


def _context(memo: Any) -> OperatorContext:
    return memo.context


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure_settings(settings)
    _context(memo).settings = settings
    _context(memo).loops = RunLoops()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    context = _context(memo)
    await context.loops.stop(logger)
    if context.session is not None:
        await context.session.close()
        context.session = None


@kopf.index("v1", "pods", labels={RUN_LABEL: kopf.PRESENT})
def run_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[RUN_LABEL]): (observe_pod(dict(body)), pod_facts(dict(body)))}


async def _one_pass(context: OperatorContext, run_pods: kopf.Index, body: kopf.Body, logger: Any) -> bool:
    """One reconcile pass; False when the run is finished. A failed pass is retried on the next tick."""
    meta = body["metadata"]
    started = time.monotonic()
    try:
        return await reconcile_run(context, body, list(run_pods.get((meta["namespace"], meta["name"]), [])), logger)
    except Exception:  # never in a tight loop: the next pass comes after the reconcile interval
        logger.exception("reconcile pass failed; retrying in %.1f s", context.reconcile_interval)
        context.metrics.reconcile_errors.labels("lifecycle").inc()
        return True
    finally:
        context.metrics.reconcile_seconds.labels("lifecycle").observe(time.monotonic() - started)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def lifecycle(type: str | None, body: kopf.Body, namespace: str, name: str, uid: str, memo: kopf.Memo,
              run_pods: kopf.Index, logger: logging.Logger, **_: Any) -> None:
    """Every event of a run (and each run listed at start-up): feed its loop the latest body, or stop it."""
    context = _context(memo)
    if type == "DELETED":
        context.loops.forget(uid)
        context.metrics.forget_run(namespace, name)
        context.runs.pop(uid, None)
        context.managed_elsewhere.discard(uid)
        return
    controller = managed_by(dict(body))
    if controller != CONTROLLER_NAME:
        # As the Job controller does: no children, no status, nothing written onto the run (its status is the other
        # controller's). The operator's log says it once per run (docs/operator.md, "Runs another controller manages").
        if uid not in context.managed_elsewhere:
            context.managed_elsewhere.add(uid)
            logger.info(f"spec.managedBy is {controller!r}, not {CONTROLLER_NAME!r}: leaving this run to it")
        return

    async def run_pass(latest: kopf.Body, pass_logger: Any) -> bool:
        return await _one_pass(context, run_pods, latest, pass_logger)
    context.loops.observe(uid, body, run_pass, context.reconcile_interval, logger)


@kopf.on.probe(id="runs")
def runs_known(memo: kopf.Memo, **_: Any) -> int:
    return len(_context(memo).runs)
