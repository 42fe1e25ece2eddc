"""A local run: prepare it (validate, resolve the config, plan the processes), then supervise it like the operator.

Each tick is what a cluster does, in its order: the user's edit lands in the spec (a scale request), the kubelet
does its part to the processes (local/kubelet.py: liveness, in-place restarts), then one pass of the engine
(engine.run_pass) through a LocalPort: the processes observed as pods (reads only), the status derived by the
operator's own state machine, its actions carried out on the processes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from grpo_trainer.contract.config import RunConfig, load_run_config
from grpo_trainer.contract.pod_env import MODEL_DIGEST_ENV
from grpo_trainer.contract.report import ProgressReport

from .. import builders
from .. import status as st
from ..api import GRPORunSpec
from ..engine import Observed, Outcome, run_pass
from ..exit_codes import ExitCode
from ..manifest import read_grporun
from ..model_config import HUB_ENDPOINT_ENV, HubAccess
from ..resolve import RunPlacement, resolve_run_config
from ..run_ref import RunRef
from ..run_status import FINISHED_PHASES, Phase, dump_status, parse_status
from ..status import revision
from ..status.decision import rank
from . import kubelet
from .console import Periodic, bar_fields, one_line, progress_bar, progress_line
from .environments import CRASH_LOOP_BACK_OFF, InPlaceRestarts, probe_passes
from .plan import (
    LOCAL_HOST,
    LocalError,
    LocalPorts,
    ProcessPlan,
    check_rewards,
    cpu_bind,
    local_environment_urls,
    local_output,
    localize_spec,
    observe,
    pin_revisions,
    plan_processes,
    plan_rollout,
)
from .processes import LocalProcess, find_rollout_python, free_port, http_ok, read_progress_blocking, tail
from .rollout_restarts import Liveness, exit_line
from .scaling import RolloutScaling, scale_bounds


@dataclass
class LocalRun:
    name: str
    namespace: str
    spec: GRPORunSpec
    run_dir: Path
    processes: dict[str, LocalProcess]
    external_rollout_urls: list[str] = field(default_factory=list)
    termination_path: Path | None = None
    status: dict[str, Any] | None = None
    liveness: Liveness | None = None
    hung: dict[str, str] = field(default_factory=dict)  # rollout server -> why its liveness probes stopped it
    scaling: RolloutScaling | None = None  # `grporun local scale` while the run runs
    plan_server: Callable[[int, int], ProcessPlan] | None = None  # (ordinal, port) -> an added rollout server
    notes: list[str] = field(default_factory=list)  # said once at the start: how the manifest maps to this machine
    in_place: InPlaceRestarts = field(default_factory=InPlaceRestarts)  # the environment servers' kubelet

    @property
    def ref(self) -> RunRef:
        """The run as the derivation sees it: no GRPORun object, so no uid, and one generation (a scale request
        changes only rollout.replicas, which a running run may change)."""
        return RunRef(self.name, self.namespace, uid="local")

    def learner(self) -> LocalProcess:
        return next(p for p in self.processes.values() if p.plan.role == "learner")

    def observations(self) -> list[st.PodObservation]:
        pods = []
        for index, url in enumerate(self.external_rollout_urls):
            pods.append(st.PodObservation(builders.rollout_pod_name(self.name, index), "rollout", "Running",
                                          http_ok(f"{url}/health")))
        for process in self.processes.values():
            if process.popen is None:
                continue  # not created (yet, or again after a restart): derive_status asks for it
            code = process.poll()
            plan = process.plan
            if plan.role == "environment":
                pods.append(self._environment_observation(process))
                continue
            if code is None:
                ready = http_ok(f"{plan.url}/health") if plan.role == "rollout" else True
                pods.append(observe(plan, None, ready=ready, message=None))
                continue
            message = None
            if plan.role == "learner" and self.termination_path and self.termination_path.is_file():
                message = self.termination_path.read_text(errors="replace")
            if plan.role == "rollout":  # the termination message a pod would have
                message = self.hung.get(plan.name) or exit_line(process.log_path)
            pods.append(observe(plan, code, ready=False, message=message or tail(process.log_path)))
        return pods

    def _environment_observation(self, process: LocalProcess) -> st.PodObservation:
        """An environment server as its pod: Running (restarted in place when it exits), Ready while its readiness
        probe passes, its in-place restarts counted; between an exit and its restart, waiting in CrashLoopBackOff
        with its log's tail as the message."""
        name = process.plan.name
        restarts = self.in_place.restarts[name]
        if process.poll() is None:
            return st.PodObservation(name, "environment", "Running", probe_passes(process.plan),
                                     container_restarts=restarts)
        return st.PodObservation(name, "environment", "Running", False, waiting_reason=CRASH_LOOP_BACK_OFF,
                                 message=one_line(tail(process.log_path)), container_restarts=restarts)

    def take_scale_request(self, log: Callable[[str], None]) -> None:
        """A new count in the run folder's scale request becomes spec.rollout.replicas, as an edit of the spec: the
        state machine scales to it."""
        if self.scaling is not None and (replicas := self.scaling.follow(log)) is not None:
            self.spec.rollout.replicas = replicas

    def run_kubelet(self, log: Callable[[str], None]) -> None:
        """The kubelet's step (local/kubelet.py): decided from the processes and the probes, then carried out."""
        actions = kubelet.decide(self.processes.values(), self.liveness, self.in_place)
        kubelet.act(actions, self.processes, self.in_place, self.hung, log)

    def start_missing(self, log: Callable[[str], None], model_digest: str | None = None) -> None:
        """CreateChildren: start every planned process that is not running (new, or stopped to be recreated). A
        rollout server or learner started once the run is pinned to its model's content (`model_digest`, from the
        learner's first report) is held to it, as a pod created then is."""
        pinned = {} if model_digest is None else {MODEL_DIGEST_ENV: model_digest}
        for process in self.processes.values():
            if process.popen is None:
                process.start(pinned if process.plan.role in ("rollout", "learner") else {})
                self.hung.pop(process.plan.name, None)
                self.in_place.started(process.plan.name)
                if self.liveness is not None:
                    self.liveness.forget(process.plan.name)
                log(f"started {process.plan.name} (pid {process.popen.pid}, log {process.log_path})")

    def stop(self, names: tuple[str, ...], *, recreate: bool) -> None:
        """DeletePods (recreate=False) and RecreatePods: stop the processes; a recreated one counts as missing, so
        the next CreateChildren starts it again. A rollout server past spec.rollout.replicas (drained after a
        scale-down) is gone afterwards, as its deleted pod would be."""
        for name in names:
            process = self.processes.get(name)
            if process is not None and process.plan.role == "rollout" and rank(name) >= self.spec.rollout.replicas:
                process.stop()
                del self.processes[name]
                self.forget_server(name)
            elif process is not None and process.plan.role == "environment":
                # Its pod deleted (cleanPodPolicy, a suspend) or ended: gone, so not restarted in place; created
                # again, it starts with no restarts.
                process.stop()
                process.popen = None
                self.in_place.forget(name)
            elif process is not None and process.popen is not None:
                process.stop()
                if recreate:
                    process.popen = None
                    if process.plan.role == "learner" and self.termination_path:
                        self.termination_path.unlink(missing_ok=True)

    def configure_rollout(self, replicas: int, log: Callable[[str], None]) -> None:
        """ConfigureRollout: run.json lists the first `replicas` servers, in ordinal order. A server not planned yet
        (a scale-up) is planned first, so that its URL is in the config before CreateChildren starts it."""
        if self.scaling is None:
            return  # no run.json of this run's own to rewrite
        urls = []
        for ordinal in range(replicas):
            if ordinal < len(self.external_rollout_urls):
                urls.append(self.external_rollout_urls[ordinal])
                continue
            name = builders.rollout_pod_name(self.name, ordinal)
            if name not in self.processes and self.plan_server is not None:
                plan = self.plan_server(ordinal, free_port())
                self.processes[name] = LocalProcess(plan, self.run_dir / "logs" / f"{name}.log")
            if name in self.processes:  # (none without a Python to start it: the scale bounds keep the count)
                urls.append(self.processes[name].plan.url)
        if self.scaling.configure(urls):
            log(f"run config: rollout.urls now lists {len(urls)} server(s)")

    def waiting_for(self, pods: list[st.PodObservation]) -> list[str]:
        """What the run waits for while a rollout server is up but not ready (a model load takes minutes)."""
        external = {builders.rollout_pod_name(self.name, index): url
                    for index, url in enumerate(self.external_rollout_urls)}
        lines = []
        for pod in pods:
            if pod.role == "environment" and pod.phase == "Running" and not pod.ready:
                process = self.processes[pod.name]
                lines.append(f"waiting for {pod.name}: its readiness probe does not pass yet "
                             f"(log: {process.log_path})")
            if pod.role != "rollout" or pod.phase != "Running" or pod.ready:
                continue
            process = self.processes.get(pod.name)
            where = f"log: {process.log_path}" if process is not None else f"the server at {external.get(pod.name)}"
            lines.append(f"waiting for {pod.name}: /health does not answer yet ({where})")
        return lines

    def logs(self) -> dict[str, Path]:
        return {name: process.log_path for name, process in self.processes.items()}

    def forget_server(self, name: str) -> None:
        """A rollout server that left the run's set: no liveness verdict, no restart, for it any more."""
        self.hung.pop(name, None)
        if self.liveness is not None:
            self.liveness.forget(name)

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.stop()
        if self.scaling is not None:
            self.scaling.end()


def prepare(args: argparse.Namespace) -> LocalRun:
    """Everything before a process starts. Raises ManifestError/ManifestInvalid/LocalError (user mistakes)."""
    manifest_path = Path(args.manifest)
    run = read_grporun(manifest_path)
    spec = localize_spec(run.spec, manifest_path.resolve().parent)
    check_rewards(spec)
    limit = getattr(args, "rollout_restart_limit", None)
    if limit is not None:  # the flag overrides the manifest's runPolicy.rolloutRestartLimit
        spec.run_policy.rollout_restart_limit = limit
    run_dir = Path(args.runs_dir).resolve() / run.name
    if run_dir.exists() and not (args.resume or args.fresh):
        raise LocalError(f"{run_dir} exists (config, logs, checkpoints of an earlier run): pass --resume to continue "
                         "from its newest checkpoint or --fresh to delete it and start over", ExitCode.USAGE)
    if run_dir.exists() and args.fresh:
        shutil.rmtree(run_dir)
    earlier = _earlier_config(run_dir / "run.json") if args.resume else None
    pins = pin_revisions(spec, HubAccess(endpoint=os.environ.get(HUB_ENDPOINT_ENV)), earlier)
    run_dir.mkdir(parents=True, exist_ok=True)
    external = list(args.rollout_url or [])
    if external:
        rollout_ports: list[int] = []
        urls = [url.rstrip("/") for url in external]
        # The servers given are the run's rollout replicas, however many the manifest asks for.
        spec.rollout.replicas = len(urls)
    else:
        rollout_ports = [free_port() for _ in range(spec.rollout.replicas)]
        urls = [f"http://{LOCAL_HOST}:{port}" for port in rollout_ports]
    if external:
        try:  # only to start more servers if the run is scaled up
            rollout_python: str | None = find_rollout_python(args.rollout_python)
        except LocalError:
            rollout_python = None
    else:
        rollout_python = find_rollout_python(args.rollout_python)
    termination_path = run_dir / "termination-log"
    output = local_output(run.name, spec, run_dir)
    environment_ports = {environment.name: [free_port() for _ in range(environment.replicas)]
                         for environment in spec.environments or []}
    config = resolve_run_config(run.name, run.namespace, revision.pinned_spec(spec, pins), RunPlacement(
        rollout_urls=urls, output_dir=str(run_dir / "output"),
        checkpoint_dir=str(run_dir / "checkpoints"),
        weight_sync_dir=str(run_dir / "weights") if spec.rollout.weight_sync.mode == "filesystem" else None,
        termination_message_path=str(termination_path),
        output=None if output is None else (str(output[0]), output[1]),
        environment_urls=local_environment_urls(spec, environment_ports),
    ))
    learner_port = free_port()
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"http_port": learner_port})})
    config_path = run_dir / "run.json"
    config_path.write_text(config.model_dump_json(by_alias=True, indent=2))
    cpu_count = None if "OMP_NUM_THREADS" in os.environ else os.cpu_count()  # the user's setting wins
    plans = plan_processes(
        run.name, run.namespace, spec, str(config_path), rollout_python=rollout_python or sys.executable,
        learner_python=sys.executable, ports=LocalPorts(rollout_ports, learner_port, free_port(), environment_ports),
        cpu_count=cpu_count,
    )
    processes = {plan.name: LocalProcess(plan, run_dir / "logs" / f"{plan.name}.log") for plan in plans}
    ref = RunRef(run.name, run.namespace, uid="local")

    def plan_server(ordinal: int, port: int):
        return plan_rollout(ref, spec, ordinal, port, str(config_path), rollout_python,
                            cpu_bind(spec, ordinal, ordinal + 1, cpu_count))

    bounds = scale_bounds(config, external=len(external), can_start=rollout_python is not None,
                          cpu_count=os.cpu_count())
    local = LocalRun(run.name, run.namespace, spec, run_dir, processes, [url for url in urls if external],
                     termination_path, liveness=Liveness(config.model),
                     scaling=RolloutScaling(run_dir, config_path, config, bounds), plan_server=plan_server,
                     notes=[*([output[2]] if output is not None and output[2] else []), *environment_notes(spec)])
    local.scaling.begin()
    if pins.model is not None or pins.dataset is not None:  # before the first pass, which would wait for them
        local.status = dump_status(pins)
    return local


def _earlier_config(path: Path) -> RunConfig | None:
    """The run config a resumed run was started with; None when there is none to read."""
    try:
        return load_run_config(path.read_text())
    except (OSError, ValueError):
        return None


def environment_notes(spec: GRPORunSpec) -> list[str]:
    """How each environment maps to this machine, where it differs from a cluster: its command runs here, not its
    image, each server on a port of its own (the learner's URL lists them all)."""
    notes = []
    for environment in spec.environments or []:
        name = environment.name
        notes.append(f"environment {name}: {environment.replicas} server(s) run their command on this machine "
                     f"(image {environment.image} is a cluster's), each on a free loopback port in $PORT")
        for item in environment.env or []:
            if item.value_from is not None:
                notes.append(f"environment {name}: {item.name} ({', '.join(sorted(item.value_from))}) comes from "
                             "this machine's environment, if set")
    return notes


class LocalPort:
    """The engine's port for a local run: processes observed as pods, the status kept in memory (and drawn), the
    actions carried out on the processes and the run folder's run.json. A local run names no Kueue queue: this is
    no QueuedRunPort (its observation names no Workload, so the state machine decides no Workload action)."""

    def __init__(self, local: LocalRun, log: Callable[[str], None], waiting: Periodic | None = None,
                 read_progress: Callable[[str], ProgressReport | None] = read_progress_blocking,
                 now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)):
        self.local, self.log, self.waiting = local, log, waiting or Periodic()
        self.read_progress = read_progress  # the learner's /progress, by its URL
        self.now = now

    async def observe(self) -> Observed[None]:
        local = self.local
        pods = local.observations()
        learner = local.learner()
        alive = learner.popen is not None and learner.poll() is None
        report = self.read_progress(learner.plan.url) if alive else None
        configured = None if local.scaling is None else local.scaling.configured
        seen = st.Observation(pods, report, self.now(), configured_servers=configured, work_kept_locally=True)
        return Observed(local.spec, local.status, seen, None)

    async def write(self, observed: Observed[None], decision: st.Decision) -> bool:
        """Keep the status, print its events, and (now and then) what the run waits for."""
        self.local.status = decision.status
        for event in decision.events:
            self.log(f"{event.type} {event.reason}: {one_line(event.message)}")
        waits = self.local.waiting_for(observed.seen.pods)
        if self.waiting.due(bool(waits)):
            for line in waits:
                self.log(line)
        return True

    async def configure_rollout(self, observed: Observed[None], replicas: int) -> None:
        self.local.configure_rollout(replicas, self.log)

    async def record_images(self, observed: Observed[None], images: Mapping[str, Sequence[str]]) -> None:
        """A local run's processes run from this machine's environments, not images: nothing to record."""

    async def create_children(self, observed: Observed[None], status: dict[str, Any]) -> None:
        self.local.start_missing(self.log, revision.pinned_digest(self.local.spec, parse_status(status)))

    async def delete_pods(self, observed: Observed[None], pods: tuple[str, ...], reason: str) -> None:
        self.local.stop(pods, recreate=False)

    async def recreate_pods(self, observed: Observed[None], pods: tuple[str, ...]) -> None:
        self.local.stop(pods, recreate=True)

    async def delete_run(self, observed: Observed[None]) -> None:
        """ttlSecondsAfterFinished: a local run has no object to delete; its folder is the user's to keep."""


async def tick(local: LocalRun, port: LocalPort) -> Outcome[None] | None:
    """One tick of a local run: the scale request into the spec, the kubelet's step, then the engine's pass."""
    local.take_scale_request(port.log)
    local.run_kubelet(port.log)
    return await run_pass(local.ref, port)


def supervise(local: LocalRun, console: Console, log: Callable[[str], None], poll_interval_s: float,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Tick until the run finishes (the scale request, the kubelet's step, the engine's pass: observe, derive the
    status like the operator, act), drawing after each tick."""
    waiting, training = Periodic(clock=clock), Periodic(clock=clock)
    port = LocalPort(local, log, waiting)
    with progress_bar(console) as bar, asyncio.Runner() as runner:
        task = bar.add_task("run", **bar_fields({}))
        while True:
            runner.run(tick(local, port))
            status = local.status or {}  # the pass's write: a local run's status is kept in memory
            bar.update(task, **bar_fields(status))
            running = status.get("phase") == Phase.RUNNING.value
            if training.due(running and not console.is_terminal):  # a terminal has the bar
                log(progress_line(status))
            if Phase(status["phase"]) in FINISHED_PHASES:
                return status
            time.sleep(poll_interval_s)
