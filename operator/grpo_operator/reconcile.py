"""One reconcile pass of one GRPORun: observe -> derive (pure, the status package) -> write status -> act.

The kopf handlers (handlers.py) call `reconcile_run` from one daemon per run, so passes of one run never overlap
and no lock is needed. Everything decided here comes from status.derive_status; this module only reads the
world (the pod index, the learner's /progress) and carries out the Decision.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf

from grpo_trainer.contract import ProgressReport

from . import builders, kueue
from .api import API_VERSION, FINISHED_PHASES, KIND, ROLE_LABEL, GRPORunSpec, SpecError, parse_spec
from .kube import APIClientError, Kube, merge_patch_between
from .operator_metrics import OperatorMetrics
from .pod_overrides import OverrideError
from .pods import PodFacts
from .progress_poller import DEFAULT_TIMEOUT_SECONDS, ProgressUrlFn, pod_progress_url, poll_progress
from .status import (
    CreateChildren,
    Decision,
    DeletePods,
    DeleteRun,
    PodObservation,
    RecreatePods,
    derive_status,
    invalid_spec_status,
)

Logger = logging.Logger | logging.LoggerAdapter


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass
class RunMemory:
    """What the operator remembers about a run between passes (lost on restart, by design: nothing here is
    needed for correctness after a restart, only to avoid redundant work and stale reads)."""

    last_status: dict[str, Any] | None = None  # the status this process last wrote (fresher than a lagging watch)
    deleted_uids: set[str] = dataclasses.field(default_factory=set)  # pods deleted, until the index drops them
    children_created: bool = False
    kueue_finished: bool = False  # the run's Kueue Workload is marked Finished


@dataclasses.dataclass
class OperatorContext:
    """The operator's configuration and shared state; handed to kopf as its memo (`memo.context`)."""

    trainer_image: str
    reconcile_interval: float = 5.0
    progress_timeout: float = DEFAULT_TIMEOUT_SECONDS
    progress_url: ProgressUrlFn = pod_progress_url
    metrics: OperatorMetrics = dataclasses.field(default_factory=OperatorMetrics)
    clock: Callable[[], datetime.datetime] = _utc_now
    settings: Any = None  # kopf.OperatorSettings, captured at startup (resource handlers do not receive it)
    session: aiohttp.ClientSession | None = None
    runs: dict[str, RunMemory] = dataclasses.field(default_factory=dict)  # by the run's uid

    def memory(self, uid: str) -> RunMemory:
        return self.runs.setdefault(uid, RunMemory())


class ChildRejected(Exception):
    """The API server refused a child object: its fields come from the spec (volumes, resources, tolerations)."""


async def reconcile_run(context: OperatorContext, body: kopf.Body,
                        indexed_pods: list[tuple[PodObservation, PodFacts]], logger: Logger) -> bool:
    """One pass. Returns False when the run needs no more passes (finished, cleaned up, no TTL pending)."""
    metadata = body.get("metadata", {})
    name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
    generation = int(metadata.get("generation") or 1)
    memory = context.memory(uid)
    kube = Kube(context.settings, logger)
    base_status = memory.last_status if memory.last_status is not None else dict(body.get("status") or {})
    now = context.clock()

    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except SpecError as error:
        await _write(context, kube, body, base_status, invalid_spec_status(base_status, error, now,
                                                                           generation=generation), logger)
        raise kopf.PermanentError(str(error)) from None

    live = [(obs, facts) for obs, facts in indexed_pods if facts.uid not in memory.deleted_uids
            and not facts.terminating]
    memory.deleted_uids &= {facts.uid for _, facts in indexed_pods}  # forget pods the index has dropped
    progress = None
    was_finished = base_status.get("phase") in {p.value for p in FINISHED_PHASES}
    if not was_finished:
        progress = await _poll(context, namespace, builders.learner_pod_name(name, 0), live, logger)
    queue = kueue.queue_name(metadata)
    gate = None
    if queue and not was_finished:
        gate = await kueue.gate(kube, name, namespace, uid, queue, spec, trainer_image=context.trainer_image,
                                pods_exist=bool(indexed_pods), now=now)
    decision = derive_status(spec, base_status, [obs for obs, _ in live], progress, now, generation=generation,
                             children_exist=memory.children_created, hold=gate.hold if gate else None)
    if not await _write(context, kube, body, base_status, decision, logger):
        return False  # the run is gone
    if queue and decision.status.get("phase") in {p.value for p in FINISHED_PHASES} and not memory.kueue_finished:
        await kueue.finish(kube, name, namespace, decision.status, context.clock())
        memory.kueue_finished = True
    try:
        await _act(context, kube, body, spec, decision, live, logger, gate)
    except ChildRejected as error:
        failed = invalid_spec_status(decision.status, error, context.clock(), generation=generation)
        await _write(context, kube, body, decision.status, failed, logger)
        raise kopf.PermanentError(str(error)) from None
    context.metrics.observe_run(namespace, name, spec.model, spec.progress.progress_deadline_seconds, decision.status)
    finished = decision.status.get("phase") in {p.value for p in FINISHED_PHASES}
    return not (finished and not decision.actions and spec.run_policy.ttl_seconds_after_finished is None)


async def _poll(context: OperatorContext, namespace: str, leader_name: str,
                live: list[tuple[PodObservation, PodFacts]], logger: Logger) -> ProgressReport | None:
    leader = next(((obs, facts) for obs, facts in live if obs.name == leader_name), None)
    if leader is None or leader[0].phase != "Running" or not leader[1].ip:
        return None
    if context.session is None:
        context.session = aiohttp.ClientSession()
    url = context.progress_url(namespace, leader[0].name, leader[1].ip)
    return await poll_progress(context.session, url, timeout=context.progress_timeout, logger=logger)


async def _write(context: OperatorContext, kube: Kube, body: kopf.Body, base_status: dict[str, Any],
                 decision: Decision, logger: Logger) -> bool:
    metadata = body["metadata"]
    patch = merge_patch_between(base_status, decision.status)
    memory = context.memory(metadata["uid"])
    if patch:
        written = await kube.patch_status(API_VERSION, KIND, metadata["namespace"],
                                          metadata["name"], patch)
        if written is None:
            return False
    memory.last_status = decision.status
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        (logger.warning if event.type == "Warning" else logger.info)(f"{event.reason}: {event.message}")
    return True


async def _act(context: OperatorContext, kube: Kube, body: kopf.Body, spec: GRPORunSpec, decision: Decision,
               live: list[tuple[PodObservation, PodFacts]], logger: Logger, gate: kueue.Gate | None = None) -> None:
    metadata = body["metadata"]
    name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
    memory = context.memory(uid)
    uids = {obs.name: facts.uid for obs, facts in live}
    for action in decision.actions:
        if isinstance(action, CreateChildren):
            present = set(uids)
            attempt = int(decision.status.get("restarts", 0))
            try:
                children = builders.build_children(name, namespace, uid, spec, trainer_image=context.trainer_image,
                                                   attempt=attempt)
            except OverrideError as error:  # a managed field the API server's rules let through
                raise ChildRejected(str(error)) from None
            if gate is not None:  # Kueue admitted the run: its flavours' node labels and tolerations
                placed = await kueue.placements(kube, gate.flavors)
                children = [kueue.place(child, *placed[role]) if child["kind"] == "Pod" and (
                    role := child["metadata"]["labels"].get(ROLE_LABEL)) in placed else child
                    for child in children]
            for child in children:
                if child["kind"] == "Pod" and child["metadata"]["name"] in present:
                    continue
                try:
                    await kube.create(child)
                except APIClientError as error:
                    raise ChildRejected(f"{child['kind']} {child['metadata']['name']} was rejected by the API "
                                        f"server: {error.message or error}") from None
            memory.children_created = True
        elif isinstance(action, (DeletePods, RecreatePods)):
            for pod in action.pods:
                await kube.delete("v1", "Pod", namespace, pod)
                if pod in uids:
                    memory.deleted_uids.add(uids[pod])
        elif isinstance(action, DeleteRun):
            logger.info("ttlSecondsAfterFinished elapsed: deleting the run")
            await kube.delete(API_VERSION, KIND, namespace, name)
