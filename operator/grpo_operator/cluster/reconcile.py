"""The cluster's port for the engine's pass (engine.run_pass): a GRPORun observed through the API server and the pod
index, its status written to the status subresource, its actions carried out on Kubernetes objects.

The kopf handlers (handlers.py) call `reconcile_run` from one task per run (run_loops.py), so passes of one run
never overlap and no lock is needed. Everything decided comes from status.derive_status; this module only reads the
world (the pod index, the learner's /progress, the run config, the Kueue Workload) and carries out the Decision.
What a pass read is one value (`ClusterPass`, in the engine's `Observed`) that its write and actions work from; what
the operator keeps of a run between passes is its `RunMemory`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import kopf

from grpo_trainer.contract.report import ProgressReport

from .. import builders
from ..api import API_VERSION, KIND, GRPORunSpec, SpecError, parse_stored_spec
from ..engine import Observed, run_pass
from ..run_ref import RunRef
from ..run_status import FINISHED_PHASES, parse_status
from ..status import CreateRejection, Decision, Observation, PodObservation, admission, revision, scaling, urgency
from . import kueue
from .children import ChildRejected, Children, ChildrenMemory
from .events import EventRecorder
from .fit_check import GpuNodes, ModelConfigs, check_run
from .kube import Kube, merge_patch_between
from .operator_metrics import OperatorMetrics
from .pods import PodFacts
from .probe_events import ProbeEvents, ProbeFailureMemory
from .progress_poller import DEFAULT_TIMEOUT_SECONDS, ProgressUrlFn, pod_progress_url, poll_progress
from .revisions import HubAnswer, PinMemory, RevisionPinner
from .run_loops import RunLoops

Logger = logging.Logger | logging.LoggerAdapter


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass
class StatusMemory:
    """The run's status as this process last derived and wrote it."""

    derived: dict[str, Any] | None = None  # the last pass's status (fresher than a lagging watch)
    written: dict[str, Any] | None = None  # what it last wrote: progress-only changes wait for the interval
    written_at: datetime.datetime | None = None


@dataclasses.dataclass
class ProgressMemory:
    """The last reads of the running learner's /progress."""

    failures: int = 0  # consecutive passes it could not be read
    error: str | None = None
    invalid: bool = False  # the last answer was a report that breaks the contract


@dataclasses.dataclass
class SpecMemory:
    """What the operator found wrong with the run's spec (the state machine fails the run as InvalidSpec for it)."""

    warned_unknown_fields: bool = False
    fit_checked: bool = False  # the fit check ran for this run's pods-to-be (once per operator process)
    fit_error: str | None = None  # what the fit check found past the GPU's memory
    pins: PinMemory = dataclasses.field(default_factory=PinMemory)  # the hub's last answer for the run's commits
    rejection: CreateRejection | None = None  # an object of the run the API server refused as invalid


@dataclasses.dataclass
class WorkloadMemory:
    """The run's Kueue Workload, as the operator last acted on it."""

    finished: bool = False  # marked Finished
    create_error: str | None = None  # why creating it failed last time (retried)


@dataclasses.dataclass
class RunMemory:
    """What the operator remembers about a run between passes (lost on restart, by design: nothing here is
    needed for correctness after a restart, only to avoid redundant work and stale reads)."""

    status: StatusMemory = dataclasses.field(default_factory=StatusMemory)
    children: ChildrenMemory = dataclasses.field(default_factory=ChildrenMemory)
    progress: ProgressMemory = dataclasses.field(default_factory=ProgressMemory)
    spec: SpecMemory = dataclasses.field(default_factory=SpecMemory)
    workload: WorkloadMemory = dataclasses.field(default_factory=WorkloadMemory)
    probes: ProbeFailureMemory = dataclasses.field(default_factory=ProbeFailureMemory)


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
    gpu_nodes: GpuNodes | None = None  # the fit check reads the GPU nodes' labels (grporun operator --read-gpu-nodes)
    model_configs: ModelConfigs = dataclasses.field(default_factory=ModelConfigs)  # the fit check's config.json reads
    revisions: RevisionPinner = dataclasses.field(default_factory=RevisionPinner)  # the hub's commits for new runs
    probe_events: ProbeEvents = dataclasses.field(default_factory=ProbeEvents)  # why a server is not ready

    def memory(self, uid: str) -> RunMemory:
        return self.runs.setdefault(uid, RunMemory())


#: Consecutive unreadable polls before the run's progress counts as unknown (one slow answer is not an outage).
PROGRESS_UNKNOWN_AFTER = 3


async def reconcile_run(context: OperatorContext, body: kopf.Body,
                        indexed_pods: list[tuple[PodObservation, PodFacts]], logger: Logger) -> bool:
    """One pass (engine.run_pass through a ClusterRun). Returns False when the run needs no more passes until its
    spec changes (finished, cleaned up, no TTL pending)."""
    port = ClusterRun(context, body, indexed_pods, logger)
    outcome = await run_pass(port.run, port)
    if outcome is None:
        return False  # the run is gone
    spec, status = outcome.observed.spec, outcome.decision.status
    if spec is not None:
        context.metrics.observe_run(port.run.namespace, port.run.name, spec.model,
                                    spec.progress.progress_deadline_seconds, status,
                                    rollout_wanted=spec.rollout.replicas)
    finished = status.get("phase") in {p.value for p in FINISHED_PHASES}
    ttl = spec.run_policy.ttl_seconds_after_finished if spec is not None else None
    return not (finished and not outcome.decision.actions and ttl is None)


@dataclasses.dataclass(frozen=True)
class ClusterPass:
    """What one pass read of a GRPORun besides its Observation: what the pass's write and actions work from."""

    #: The uids of the run's pods not being deleted, by name (a pod deleted is remembered until the index drops it).
    pod_uids: Mapping[str, str]
    #: Every pod name the run holds, those being deleted included (their names are not free yet).
    present: frozenset[str]
    #: The spec as written (the Observed's is as run: within what Kueue admitted): what the Workload is created and
    #: resized to. None when it cannot be parsed.
    asked: GRPORunSpec | None = None
    queue: str | None = None  # the Kueue LocalQueue the run names
    gate: kueue.Gate | None = None  # Kueue's admission of a run that may have pods
    workload: dict[str, Any] | None = None  # the run's Workload as read


class ClusterRun:
    """The engine's port (a RunPort, and a QueuedRunPort) for one pass of a GRPORun in the cluster: observes the pod
    index, the learner's /progress, the run config and Kueue's admission; writes the status subresource; acts
    through the API server. One is made per pass, with its collaborators; what it observed is a value
    (Observed[ClusterPass]) the engine hands to its write and actions."""

    def __init__(self, context: OperatorContext, body: kopf.Body,
                 indexed_pods: list[tuple[PodObservation, PodFacts]], logger: Logger):
        self.context, self.body, self.logger = context, body, logger
        self.indexed_pods = indexed_pods
        self.run = RunRef.of(body.get("metadata", {}))
        self.memory = context.memory(self.run.uid)
        self.kube = Kube(context.settings, logger)
        self.children = Children(self.kube, self.run, self.memory.children, context.trainer_image, context.clock)

    async def observe(self) -> Observed[ClusterPass]:
        memory, run = self.memory, self.run
        base_status = memory.status.derived if memory.status.derived is not None else dict(
            self.body.get("status") or {})
        now = self.context.clock()
        was_finished = base_status.get("phase") in {p.value for p in FINISHED_PHASES}
        owned = self._owned_pods()
        if not was_finished:
            owned = await self._with_probe_failures(owned, now)
        observed = [obs for obs, _ in owned]
        live = [(obs, facts) for obs, facts in owned if not obs.terminating]
        read = ClusterPass({obs.name: facts.uid for obs, facts in live}, frozenset(obs.name for obs in observed),
                           queue=kueue.queue_name(self.body.get("metadata", {})))
        try:
            asked, ignored = parse_stored_spec(dict(self.body.get("spec") or {}))
        except SpecError as error:  # the state machine fails the run as InvalidSpec
            gate, workload = None, None
            if read.queue and not memory.workload.finished:
                gate, workload = await kueue.observe(self.kube, run, read.queue, None)
            read = dataclasses.replace(read, workload=gate.workload if gate else None)
            return Observed(None, base_status, Observation(observed, None, now, spec_error=str(error),
                                                           workload=workload), read)
        if ignored and not memory.spec.warned_unknown_fields:  # a newer CRD than this operator: run what it knows
            memory.spec.warned_unknown_fields = True
            self.logger.warning(f"ignoring spec fields this operator version does not know: {', '.join(ignored)}")
        fit_warnings: tuple[str, ...] = ()
        if not was_finished and not live and not memory.children.created and not memory.spec.fit_checked:
            fit_warnings = await self._check_fit(asked)
        progress = None if was_finished else await self._progress(live)
        gate, workload = None, None
        if read.queue and not (was_finished and memory.workload.finished):
            gate, workload = await kueue.observe(self.kube, run, read.queue, asked,
                                                 create_error=memory.workload.create_error)
        read = dataclasses.replace(read, asked=asked, workload=gate.workload if gate else None,
                                   gate=None if was_finished else gate)  # a finished run's Workload: only its finish
        hub = None
        if not was_finished and not live and not asked.run_policy.suspend and not (read.gate and read.gate.hold):
            hub = await self._ask_hub(asked, base_status)
        in_effect, configured = admission.InEffect(asked), None
        if read.gate is not None and read.gate.admitted:  # with pods or without: no more than Kueue admitted
            in_effect = admission.within_admission(asked, read.gate.admitted, kueue.workload_name(run.name))
        spec, refused = in_effect.spec, in_effect.refused
        images = None
        if live and not was_finished:
            urls, images = await self.children.configured()
            configured = None if urls is None else len(urls)
            if refused is None:
                spec, refused = scaling.gang_scale_in_effect(spec, configured)
        seen = Observation(observed, progress, now, children_exist=memory.children.created,
                           progress_error=memory.progress.error,
                           progress_lost=memory.progress.invalid or memory.progress.failures >= PROGRESS_UNKNOWN_AFTER,
                           create_error=memory.children.error, hold=read.gate.hold if read.gate else None,
                           scale_refused=refused, environment_scale_refused=in_effect.environments_refused,
                           configured_servers=configured, configured_images=images, workload=workload,
                           spec_error=memory.spec.fit_error or (hub.refused if hub else None),
                           create_rejected=memory.spec.rejection, fit_warnings=fit_warnings,
                           pins=hub.pins if hub else None)
        return Observed(spec, base_status, seen, read)

    def _owned_pods(self) -> list[tuple[PodObservation, PodFacts]]:
        """The pods this run controls (a run re-created under the same name must not adopt the old run's pods),
        those the operator deleted marked `terminating` until the index drops them."""
        owned = [(obs, facts) for obs, facts in self.indexed_pods if facts.owner_uid == self.run.uid]
        deleted = self.memory.children.deleted_uids
        deleted &= {facts.uid for _, facts in owned}  # forget pods the index has dropped
        return [(dataclasses.replace(obs, terminating=True) if facts.uid in deleted else obs, facts)
                for obs, facts in owned]

    async def _with_probe_failures(self, owned: list[tuple[PodObservation, PodFacts]],
                                   now: datetime.datetime) -> list[tuple[PodObservation, PodFacts]]:
        """The pods, each running server that is not ready with the kubelet's latest probe failure."""
        failures = await self.context.probe_events.failures(self.kube, self.run.namespace, owned,
                                                             self.memory.probes, now)
        return [(dataclasses.replace(obs, probe_failure=failures[obs.name]) if obs.name in failures else obs, facts)
                for obs, facts in owned]

    async def _check_fit(self, spec: GRPORunSpec) -> tuple[str, ...]:
        """Before a run's pods start: a run the fit check finds past its GPU's or its learner pod's memory keeps the
        numbers as the run's spec error (grpo_operator.fit, `spec.fitCheck: refuse`: the state machine fails the run
        as InvalidSpec); a likely misfit's warnings (or any, with `warn`) are returned, for the pass's events; a
        skipped check, or part of one, is logged with why."""
        memory = self.memory.spec
        memory.fit_checked = True
        checked = await check_run(spec, self.kube, self.context.model_configs, self.context.gpu_nodes)
        for why in checked.skipped:
            self.logger.info(f"fit check skipped: {why}")
        report = checked.report
        if report.errors:
            memory.fit_error = report.errors[0]
        for note in report.notes:
            self.logger.info(f"fit: {note}")
        return tuple(report.warnings)

    async def _ask_hub(self, spec: GRPORunSpec, status: dict[str, Any]) -> HubAnswer | None:
        """The hub's commits for the run's revisions not pinned yet (status/revision.py); None when all are."""
        requests = revision.unresolved(spec, parse_status(status))
        if not requests:
            return None
        return await self.context.revisions.answer(self.kube, self.run.namespace, spec, requests,
                                                   self.memory.spec.pins)

    async def _progress(self, live: list[tuple[PodObservation, PodFacts]]) -> ProgressReport | None:
        """The running leader learner's /progress, its failures to answer counted in the run's memory."""
        memory, context = self.memory.progress, self.context
        leader_name = builders.learner_pod_name(self.run.name, 0)
        leader = next(((obs, facts) for obs, facts in live if obs.name == leader_name), None)
        if leader is None or leader[0].phase != "Running" or not leader[1].ip:
            memory.failures, memory.error, memory.invalid = 0, None, False
            return None
        if context.session is None:
            # No cap on open connections (aiohttp's default is 100 for the whole session): at 1,000 runs, 100
            # learners that do not answer would hold every slot for the poll timeout and starve the other runs' polls.
            context.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = context.progress_url(self.run.namespace, leader_name, leader[1].ip)
        read = await poll_progress(context.session, url, timeout=context.progress_timeout, logger=self.logger)
        memory.failures = 0 if read.error is None else memory.failures + 1
        memory.error, memory.invalid = read.error, read.invalid
        return read.report

    async def write(self, observed: Observed[ClusterPass], decision: Decision) -> bool:
        """Write the status difference, then post the events. A difference in progress alone waits until the
        spec's status interval after the last write; phase, condition, restart and failure changes are written at
        once."""
        memory, now = self.memory.status, self.context.clock()
        interval = observed.spec.progress.status_interval_seconds if observed.spec is not None else 0
        written_base = memory.written if memory.written is not None else observed.status or {}
        patch = merge_patch_between(written_base, decision.status)
        recent = memory.written_at is not None and (now - memory.written_at).total_seconds() < interval
        if patch and recent and not urgency.urgent_change(written_base, decision.status):
            patch = {}  # progress only, and written recently: the metrics carry it meanwhile
        elif patch:
            if await self.kube.patch_status(API_VERSION, KIND, self.run.namespace, self.run.name, patch) is None:
                return False
            memory.written, memory.written_at = decision.status, now
        memory.derived = decision.status
        for event in decision.events:
            await self.context.events.record(self.kube, self.body, event, now, self.logger)
            (self.logger.warning if event.type == "Warning" else self.logger.info)(f"{event.reason}: {event.message}")
        return True

    async def configure_rollout(self, observed: Observed[ClusterPass], replicas: int) -> None:
        await self.children.configure_rollout(replicas)

    async def record_images(self, observed: Observed[ClusterPass], images: Mapping[str, Sequence[str]]) -> None:
        await self.children.record_images(images)

    async def create_children(self, observed: Observed[ClusterPass], status: dict[str, Any]) -> None:
        if observed.spec is None:
            return  # the state machine creates nothing for a spec it cannot parse
        try:
            await self.children.create(observed.spec, status, observed.state.present, observed.state.gate)
        except ChildRejected as error:  # the next pass fails the run as InvalidSpec
            self.memory.spec.rejection = CreateRejection(str(error), tuple(error.created_pods))

    async def delete_pods(self, observed: Observed[ClusterPass], pods: tuple[str, ...], reason: str) -> None:
        for pod in pods:
            await self.kube.delete("v1", "Pod", self.run.namespace, pod)
            if pod in observed.state.pod_uids:
                self.memory.children.deleted_uids.add(observed.state.pod_uids[pod])

    async def recreate_pods(self, observed: Observed[ClusterPass], pods: tuple[str, ...]) -> None:
        await self.delete_pods(observed, pods, "recreated")

    async def delete_run(self, observed: Observed[ClusterPass]) -> None:
        self.logger.info("ttlSecondsAfterFinished elapsed: deleting the run")
        await self.kube.delete(API_VERSION, KIND, self.run.namespace, self.run.name)

    async def create_workload(self, observed: Observed[ClusterPass]) -> None:
        read = observed.state
        if read.queue is None or read.asked is None:
            return  # status.admission asks only for a queued run
        try:
            self.memory.workload.create_error = await kueue.create(self.kube, self.run, read.queue, read.asked,
                                                                   trainer_image=self.context.trainer_image)
        except kueue.WorkloadRejected as error:  # the next pass fails the run as InvalidSpec
            self.memory.spec.rejection = CreateRejection(str(error))

    async def release_quota(self, observed: Observed[ClusterPass]) -> None:
        if observed.state.workload is not None:
            await kueue.release(self.kube, self.run, observed.state.workload, self.context.clock())

    async def resize_workload(self, observed: Observed[ClusterPass]) -> None:
        read = observed.state
        if read.queue is not None and read.asked is not None and read.workload is not None:
            await kueue.resize(self.kube, self.run, read.queue, read.asked, read.workload,
                               trainer_image=self.context.trainer_image)

    async def finish_workload(self, observed: Observed[ClusterPass], status: dict[str, Any]) -> None:
        await kueue.finish(self.kube, self.run.name, self.run.namespace, status, self.context.clock())
        self.memory.workload.finished = True
