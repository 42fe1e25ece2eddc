"""The cluster's port for the engine's pass (engine.run_pass): a GRPORun observed through the API server and the pod
index, its status written to the status subresource, its actions carried out on Kubernetes objects.

The kopf handlers (handlers.py) call `reconcile_run` from one task per run (run_loops.py), so passes of one run
never overlap and no lock is needed. Everything decided comes from status.derive_status; this module only reads the
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

from .. import builders, fit
from ..api import (
    API_VERSION,
    FINISHED_PHASES,
    KIND,
    ROLE_LABEL,
    GRPORunSpec,
    SpecError,
    parse_status,
    parse_stored_spec,
)
from ..engine import Observed, run_pass
from ..events import EventRecorder
from ..operator_metrics import OperatorMetrics
from ..pod_overrides import OverrideError
from ..pods import PodFacts
from ..progress_poller import DEFAULT_TIMEOUT_SECONDS, ProgressUrlFn, pod_progress_url, poll_progress
from ..run_loops import RunLoops
from ..run_ref import RunRef
from ..status import (
    CreateRejection,
    Decision,
    Observation,
    PodObservation,
    admission,
    scaling,
    urgency,
)
from ..status.children import child_patch
from . import kueue
from .kube import PERMANENT_REJECTIONS, APIClientError, Kube, merge_patch_between

Logger = logging.Logger | logging.LoggerAdapter


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass
class RunMemory:
    """What the operator remembers about a run between passes (lost on restart, by design: nothing here is
    needed for correctness after a restart, only to avoid redundant work and stale reads)."""

    last_status: dict[str, Any] | None = None  # the status this process last derived (fresher than a lagging watch)
    written_status: dict[str, Any] | None = None  # what it last wrote: progress-only changes wait for the interval
    written_at: datetime.datetime | None = None
    deleted_uids: set[str] = dataclasses.field(default_factory=set)  # pods deleted, until the index drops them
    children_created: bool = False
    kueue_finished: bool = False  # the run's Kueue Workload is marked Finished
    workload_error: str | None = None  # why creating the run's Kueue Workload failed last time (retried)
    progress_failures: int = 0  # consecutive passes the running learner's /progress could not be read
    progress_error: str | None = None
    progress_invalid: bool = False  # the last answer was a report that breaks the contract
    create_error: str | None = None  # why creating children failed last time (transient; retried with backoff)
    create_failures: int = 0
    create_retry_at: datetime.datetime | None = None
    warned_unknown_fields: bool = False
    fit_checked: bool = False  # the fit check ran for this run's pods-to-be (once per operator process)
    fit_error: str | None = None  # what the fit check found past the GPU's memory (the run fails as InvalidSpec)
    rejection: CreateRejection | None = None  # an object of the run the API server refused as invalid
    rollout_urls: list[str] | None = None  # what the run config in the ConfigMap lists, as last read or written


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
    events: EventRecorder = dataclasses.field(default_factory=EventRecorder)
    loops: RunLoops = dataclasses.field(default_factory=RunLoops)  # one task per run (handlers.py)
    managed_elsewhere: set[str] = dataclasses.field(default_factory=set)  # uids whose spec.managedBy is not ours

    def memory(self, uid: str) -> RunMemory:
        return self.runs.setdefault(uid, RunMemory())


#: Consecutive unreadable polls before the run's progress counts as unknown (one slow answer is not an outage).
PROGRESS_UNKNOWN_AFTER = 3
#: Backoff between attempts to create children after a transient API error (quota, throttling, conflicts).
CREATE_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
#: PodSecurity admission answers 403 Forbidden, as quota does, but only a different pod (or namespace label) passes
#: it; its message is the one sign that tells the two apart (`pods "x" is forbidden: violates PodSecurity ...`).
POD_SECURITY_REFUSAL = "violates PodSecurity"


def _permanent(error: APIClientError) -> bool:
    """A refusal that the same object would meet again: invalid (400, 422), or against the namespace's PodSecurity
    level. Anything else (quota, throttling, conflicts, the server's own errors) may pass on a later try."""
    return error.status in PERMANENT_REJECTIONS or (
        error.status == 403 and POD_SECURITY_REFUSAL in str(error.message or ""))


class ChildRejected(Exception):
    """The API server refused a child object as invalid: its fields come from the spec (volumes, resources)."""

    def __init__(self, message: str, created_pods: list[str]):
        super().__init__(message)
        self.created_pods = created_pods  # pods this pass created before the refusal (not in the index yet)


async def reconcile_run(context: OperatorContext, body: kopf.Body,
                        indexed_pods: list[tuple[PodObservation, PodFacts]], logger: Logger) -> bool:
    """One pass (engine.run_pass through a ClusterRun). Returns False when the run needs no more passes until its
    spec changes (finished, cleaned up, no TTL pending)."""
    port = ClusterRun(context, body, indexed_pods, logger)
    decision = await run_pass(port.run, port)
    if decision is None:
        return False  # the run is gone
    spec = port.spec
    if spec is not None:
        context.metrics.observe_run(port.run.namespace, port.run.name, spec.model,
                                    spec.progress.progress_deadline_seconds, decision.status,
                                    rollout_wanted=spec.rollout.replicas)
    finished = decision.status.get("phase") in {p.value for p in FINISHED_PHASES}
    ttl = spec.run_policy.ttl_seconds_after_finished if spec is not None else None
    return not (finished and not decision.actions and ttl is None)


class ClusterRun:
    """The engine's port for one pass of a GRPORun in the cluster: observes the pod index, the learner's /progress,
    the run config and Kueue's admission; writes the status subresource; acts through the API server. One is made
    per pass: what it observed is what its actions use."""

    def __init__(self, context: OperatorContext, body: kopf.Body,
                 indexed_pods: list[tuple[PodObservation, PodFacts]], logger: Logger):
        self.context, self.body, self.logger = context, body, logger
        self.run = RunRef.of(body.get("metadata", {}))
        self.memory = context.memory(self.run.uid)
        self.kube = Kube(context.settings, logger)
        self.indexed_pods = indexed_pods
        self.base_status: dict[str, Any] = {}
        self.live: list[tuple[PodObservation, PodFacts]] = []
        self.present: set[str] = set()
        self.spec: GRPORunSpec | None = None  # as run: within what Kueue admitted, a refused scale at the count in
        # effect; None when the stored spec cannot be parsed
        self.asked: GRPORunSpec | None = None  # as written: what the run's Workload is created and resized to
        self.queue: str | None = None
        self.gate: kueue.Gate | None = None
        self.workload: dict[str, Any] | None = None  # the Workload as read this pass

    async def observe(self) -> Observed:
        context, memory, kube, body, logger, run = (self.context, self.memory, self.kube, self.body, self.logger,
                                                    self.run)
        metadata = body.get("metadata", {})
        base_status = memory.last_status if memory.last_status is not None else dict(body.get("status") or {})
        self.base_status = base_status
        now = context.clock()

        # Only the pods this run controls: a run re-created under the same name must not adopt the old run's pods.
        owned = [(obs, facts) for obs, facts in self.indexed_pods if facts.owner_uid == run.uid]
        memory.deleted_uids &= {facts.uid for _, facts in owned}  # forget pods the index has dropped
        observed = [dataclasses.replace(obs, terminating=True) if facts.uid in memory.deleted_uids else obs
                    for obs, facts in owned]
        live = [(obs, facts) for obs, (_, facts) in zip(observed, owned, strict=True) if not obs.terminating]
        self.live, self.present = live, {obs.name for obs in observed}

        was_finished = base_status.get("phase") in {p.value for p in FINISHED_PHASES}
        self.queue = queue = kueue.queue_name(metadata)
        try:
            spec, ignored = parse_stored_spec(dict(body.get("spec") or {}))
        except SpecError as error:  # the state machine fails the run as InvalidSpec
            workload = None
            if queue and not memory.kueue_finished:
                gate, workload = await kueue.observe(kube, run, queue, None)
                self.workload = gate.workload
            seen = Observation(observed, None, now, spec_error=str(error), workload=workload)
            return Observed(None, base_status, seen)
        if ignored and not memory.warned_unknown_fields:  # a newer CRD than this operator: run with what it knows
            memory.warned_unknown_fields = True
            logger.warning(f"ignoring spec fields this operator version does not know: {', '.join(ignored)}")

        progress = None
        fit_warnings: tuple[str, ...] = ()
        if not was_finished and not live and not memory.children_created and not memory.fit_checked:
            fit_warnings = _check_fit(memory, spec, logger)
        if not was_finished:
            progress = await _poll(context, memory, run.namespace, builders.learner_pod_name(run.name, 0), live,
                                   logger)
        self.asked = spec
        gate, workload = None, None
        if queue and not (was_finished and memory.kueue_finished):
            gate, workload = await kueue.observe(kube, run, queue, spec, create_error=memory.workload_error)
            self.workload = gate.workload
            if was_finished:
                gate = None  # nothing holds a finished run: only its Workload's finish may be left
        self.gate = gate
        refused, configured = None, None
        if gate is not None and gate.admitted:  # with pods or without: no role runs more than Kueue admitted
            spec, refused = admission.within_admission(spec, gate.admitted, kueue.workload_name(run.name))
        if live and not was_finished:
            urls = await _configured_urls(kube, run, memory)
            configured = None if urls is None else len(urls)
            if refused is None:
                spec, refused = scaling.gang_scale_in_effect(spec, configured)
        self.spec = spec
        seen = Observation(observed, progress, now, children_exist=memory.children_created,
                           progress_error=memory.progress_error,
                           progress_lost=memory.progress_invalid or memory.progress_failures >= PROGRESS_UNKNOWN_AFTER,
                           create_error=memory.create_error, hold=gate.hold if gate else None,
                           scale_refused=refused, configured_servers=configured, workload=workload,
                           spec_error=memory.fit_error, create_rejected=memory.rejection, fit_warnings=fit_warnings)
        return Observed(spec, base_status, seen)

    async def write(self, decision: Decision) -> bool:
        interval = self.spec.progress.status_interval_seconds if self.spec is not None else 0
        return await _write(self.context, self.kube, self.body, self.base_status, decision, self.logger,
                            interval=interval)

    async def configure_rollout(self, replicas: int) -> None:
        await _configure_rollout(self.kube, self.run, self.memory, replicas, self.logger)

    async def create_children(self, status: dict[str, Any]) -> None:
        try:
            await _create_children(self.context, self.kube, self.run, self.spec, status, self.present, self.logger,
                                   self.gate)
        except ChildRejected as error:  # the next pass fails the run as InvalidSpec
            self.memory.rejection = CreateRejection(str(error), tuple(error.created_pods))

    async def delete_pods(self, pods: tuple[str, ...], reason: str) -> None:
        uids = {obs.name: facts.uid for obs, facts in self.live}
        for pod in pods:
            await self.kube.delete("v1", "Pod", self.run.namespace, pod)
            if pod in uids:
                self.memory.deleted_uids.add(uids[pod])

    async def recreate_pods(self, pods: tuple[str, ...]) -> None:
        await self.delete_pods(pods, "recreated")

    async def delete_run(self) -> None:
        self.logger.info("ttlSecondsAfterFinished elapsed: deleting the run")
        await self.kube.delete(API_VERSION, KIND, self.run.namespace, self.run.name)

    async def create_workload(self) -> None:
        if self.queue is not None and self.asked is not None:  # status.admission asks only for a queued run
            try:
                self.memory.workload_error = await kueue.create(self.kube, self.run, self.queue, self.asked,
                                                                trainer_image=self.context.trainer_image)
            except kueue.WorkloadRejected as error:  # the next pass fails the run as InvalidSpec
                self.memory.rejection = CreateRejection(str(error))

    async def release_quota(self) -> None:
        if self.workload is not None:
            await kueue.release(self.kube, self.run, self.workload, self.context.clock())

    async def resize_workload(self) -> None:
        if self.queue is not None and self.asked is not None and self.workload is not None:
            await kueue.resize(self.kube, self.run, self.queue, self.asked, self.workload,
                               trainer_image=self.context.trainer_image)

    async def finish_workload(self, status: dict[str, Any]) -> None:
        await kueue.finish(self.kube, self.run.name, self.run.namespace, status, self.context.clock())
        self.memory.kueue_finished = True


def _check_fit(memory: RunMemory, spec: GRPORunSpec, logger: Logger) -> tuple[str, ...]:
    """Before a run's pods start: a model that cannot fit the GPU its nodeSelector names is kept as the run's spec
    error, with the numbers (grpo_operator.fit: the state machine fails the run as InvalidSpec); a likely misfit's
    warnings are returned, for the pass's events; a skipped check is logged."""
    memory.fit_checked = True
    report, skipped = fit.operator_check(spec)
    if skipped:
        logger.info(f"fit check skipped: {skipped}")
    if report.errors:
        memory.fit_error = report.errors[0]
    for note in report.notes:
        logger.info(f"fit: {note}")
    return tuple(report.warnings)


async def _configured_urls(kube: Kube, run: RunRef, memory: RunMemory) -> list[str] | None:
    """The `rollout.urls` of the run config in the run's ConfigMap (read once per operator process, then kept)."""
    if memory.rollout_urls is None:
        config_map = await _owned(kube, "v1", "ConfigMap", run, builders.config_map_name(run.name))
        memory.rollout_urls = builders.rollout_urls_of(config_map) if config_map is not None else None
    return memory.rollout_urls


async def _configure_rollout(kube: Kube, run: RunRef, memory: RunMemory, replicas: int, logger: Logger) -> None:
    """Make the run config list `replicas` servers (ConfigureRollout). The learner watches the file: the kubelet
    refreshes the mounted ConfigMap in place, so no pod restarts for it."""
    urls = builders.rollout_urls(run.name, run.namespace, replicas)
    if memory.rollout_urls == urls:
        return
    name = builders.config_map_name(run.name)
    config_map = await _owned(kube, "v1", "ConfigMap", run, name)
    if config_map is None:
        return  # not created yet (CreateChildren renders it with these URLs), or an earlier run's
    try:
        data = builders.with_rollout_urls(config_map, urls)
    except ValueError as error:
        logger.warning(f"cannot set rollout.urls in the run config: {error}")
        return
    if data is not None:
        if await kube.patch("v1", "ConfigMap", run.namespace, name, {"data": data}) is None:
            return
        logger.info(f"run config: rollout.urls now lists {len(urls)} server(s)")
    memory.rollout_urls = urls


async def _poll(context: OperatorContext, memory: RunMemory, namespace: str, leader_name: str,
                live: list[tuple[PodObservation, PodFacts]], logger: Logger) -> ProgressReport | None:
    leader = next(((obs, facts) for obs, facts in live if obs.name == leader_name), None)
    if leader is None or leader[0].phase != "Running" or not leader[1].ip:
        memory.progress_failures, memory.progress_error, memory.progress_invalid = 0, None, False
        return None
    if context.session is None:
        # No cap on open connections (aiohttp's default is 100 for the whole session): at 1,000 runs, 100 learners
        # that do not answer would hold every slot for the poll timeout and starve the polls of the other runs.
        context.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = context.progress_url(namespace, leader[0].name, leader[1].ip)
    read = await poll_progress(context.session, url, timeout=context.progress_timeout, logger=logger)
    memory.progress_failures = 0 if read.error is None else memory.progress_failures + 1
    memory.progress_error, memory.progress_invalid = read.error, read.invalid
    return read.report


async def _write(context: OperatorContext, kube: Kube, body: kopf.Body, base_status: dict[str, Any],
                 decision: Decision, logger: Logger, *, interval: float = 0) -> bool:
    """Write the status difference, then post the events. A difference in progress alone waits until `interval`
    seconds after the last write; phase, condition, restart and failure changes are written at once."""
    metadata = body["metadata"]
    memory = context.memory(metadata["uid"])
    written_base = memory.written_status if memory.written_status is not None else base_status
    patch = merge_patch_between(written_base, decision.status)
    now = context.clock()
    recent = memory.written_at is not None and (now - memory.written_at).total_seconds() < interval
    if patch and recent and not urgency.urgent_change(written_base, decision.status):
        patch = {}  # progress only, and written recently: the metrics carry it meanwhile
    elif patch:
        written = await kube.patch_status(API_VERSION, KIND, metadata["namespace"],
                                          metadata["name"], patch)
        if written is None:
            return False
        memory.written_status, memory.written_at = decision.status, now
    memory.last_status = decision.status
    for event in decision.events:
        await context.events.record(kube, body, event, now, logger)
        (logger.warning if event.type == "Warning" else logger.info)(f"{event.reason}: {event.message}")
    return True


async def _create_children(context: OperatorContext, kube: Kube, run: RunRef, spec: GRPORunSpec,
                           status: dict[str, Any], present: set[str], logger: Logger,
                           gate: kueue.Gate | None = None) -> None:
    """Create what is missing. An invalid child fails the run (ChildRejected); anything else the API server
    answers (quota, throttling, a name still held by an earlier run's object) is retried with backoff."""
    memory = context.memory(run.uid)
    now = context.clock()
    if memory.create_retry_at is not None and now < memory.create_retry_at:
        return
    attempt = int(status.get("restarts", 0)) + int(status.get("disruptions", 0))
    rollout = parse_status(status).rollout
    rollout_restarts = {server.replica: server.restarts for server in rollout.servers} if rollout else {}
    problem, created_pods = None, []
    try:
        children = builders.build_children(run, spec, trainer_image=context.trainer_image, attempt=attempt,
                                           rollout_restarts=rollout_restarts)
    except OverrideError as error:  # a managed field the API server's rules let through
        raise ChildRejected(str(error), []) from None
    if present:  # a live run: new servers are in the run config before their pods exist
        await _configure_rollout(kube, run, memory, spec.rollout.replicas, logger)
    if gate is not None:  # Kueue admitted the run: its flavours' node labels and tolerations
        placed = await kueue.placements(kube, gate.flavors)
        children = [kueue.place(child, *placed[pod_set]) if child["kind"] == "Pod" and (
            pod_set := kueue.pod_set_of(child)) in placed else child
            for child in children]
        topologies = kueue.role_topologies(spec)
        children = [kueue.topology_gated(child, run.name, role, topologies[role]) if child["kind"] == "Pod" and (
            role := child["metadata"]["labels"].get(ROLE_LABEL)) in topologies else child
            for child in children]
    for child in children:
        child_name = f"{child['kind']} {child['metadata']['name']}"
        if child["kind"] == "Pod" and child["metadata"]["name"] in present:
            continue
        try:
            created = await kube.create(child)
        except APIClientError as error:
            if _permanent(error):
                raise ChildRejected(f"{child_name} was rejected by the API server: {error.message or error}",
                                    created_pods) from None
            problem = f"creating {child_name} failed (HTTP {error.status}): {error.message or error}; retrying"
            break
        if created and child["kind"] == "Pod":
            created_pods.append(child["metadata"]["name"])
        if created and child["kind"] == "ConfigMap":
            memory.rollout_urls = builders.rollout_urls_of(child)
        if created:
            continue
        existing = await _existing_of(kube, child, run.uid)
        if existing is None:
            problem = f"{child_name} still belongs to an earlier run of the same name; waiting for it to go"
        elif (patch := child_patch(child, existing, generation=run.generation,
                                   live=bool(present))) is not None:
            await kube.patch(child["apiVersion"], child["kind"], run.namespace, child["metadata"]["name"], patch)
            if child["kind"] == "ConfigMap":
                memory.rollout_urls = builders.rollout_urls_of(child)
    if problem is None:
        memory.children_created, memory.create_error, memory.create_failures = True, None, 0
        memory.create_retry_at = None
        return
    logger.warning(problem)
    memory.children_created, memory.create_error = False, problem
    delay = CREATE_BACKOFF_SECONDS[min(memory.create_failures, len(CREATE_BACKOFF_SECONDS) - 1)]
    memory.create_failures += 1
    memory.create_retry_at = now + datetime.timedelta(seconds=delay)


async def _existing_of(kube: Kube, child: dict[str, Any], uid: str) -> dict[str, Any] | None:
    """The existing object under the child's name, when the run `uid` controls it; None otherwise."""
    meta = child["metadata"]
    existing = await kube.read(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
    return existing if _controlled_by(existing, uid) else None


async def _owned(kube: Kube, api_version: str, kind: str, run: RunRef, name: str) -> dict[str, Any] | None:
    existing = await kube.read(api_version, kind, run.namespace, name)
    return existing if _controlled_by(existing, run.uid) else None


def _controlled_by(existing: dict[str, Any] | None, uid: str) -> bool:
    owners = ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in owners)
