"""`grporun local MANIFEST`: run a GRPORun on this machine, no cluster.

The manifest is validated like the API server would (grpo_operator.manifest), the run config is resolved like the
operator's ConfigMap (grpo_operator.resolve), the processes are started with the commands and environment of the
operator's pods (grpo_operator.builders, with local paths, ports and interpreters swapped in), and the run's status
comes from the operator's own pure state machine (grpo_operator.status.derive_status), fed with the local processes
as pods. So a run that succeeds here exercises the same entrypoints, exit codes and status rules as in a cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from grpo_trainer import contract as c
from grpo_trainer.rollout import ROLLOUT_PYTHON_ENV

from . import builders
from . import status as st
from .eta import format_duration
from .manifest import ManifestError, ManifestInvalid, read_grporun
from .pod_overrides import local_env_notes
from .resolve import resolve_run_config
from .spec import FINISHED_PHASES, GRPORunSpec, Phase

#: SIGTERM, then this long for the process group to exit before SIGKILL. vLLM's CPU engine core needs a few seconds.
STOP_GRACE_S = 15.0
LOG_TAIL_CHARS = 2000  # what Kubernetes keeps of a log as the termination message (FallbackToLogsOnError: 2 KiB)
EVENT_DISPLAY_CHARS = 300
ROLLOUT_VENV = ".venv-rollout"
LOCAL_HOST = "127.0.0.1"


class LocalError(Exception):
    """A user mistake found before anything starts; one line naming the field."""


# ---------------------------------------------------------------------------------------------------------------------
# Pure: manifest -> local run plan
# ---------------------------------------------------------------------------------------------------------------------
def localize_path(value: str, base: Path) -> str:
    """`./x` and `../x` in a manifest are relative to the manifest's folder (so examples run from anywhere)."""
    if value.startswith(("./", "../")):
        return str((base / value).resolve())
    return value


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~"))


def localize_spec(spec: GRPORunSpec, manifest_dir: Path) -> GRPORunSpec:
    """The spec with local paths made absolute and checked. Raises LocalError naming the field."""
    spec = spec.model_copy(deep=True)
    spec.model = localize_path(spec.model, manifest_dir)
    if _looks_local(spec.model) and not Path(spec.model).expanduser().is_dir():
        raise LocalError(f"spec.model: {spec.model}: no such directory")
    if spec.dataset.path is not None:
        spec.dataset.path = localize_path(spec.dataset.path, manifest_dir)
        if not Path(spec.dataset.path).expanduser().exists():
            raise LocalError(f"spec.dataset.path: {spec.dataset.path}: no such file or directory")
    if spec.learner.nodes != 1:
        raise LocalError(f"spec.learner.nodes: grporun local runs on one machine; got {spec.learner.nodes}, use 1")
    return spec


def check_rewards(spec: GRPORunSpec) -> None:
    """Built-in names and `module:function` imports are checked here, before minutes of server start-up."""
    from grpo_trainer.rewards import RewardError, load_reward

    for index, reward in enumerate(spec.rewards):
        try:
            load_reward(reward)
        except RewardError as error:
            field_name = "name" if reward.name is not None else "function"
            raise LocalError(f"spec.rewards[{index}].{field_name}: {error}") from None


@dataclass(frozen=True)
class ProcessPlan:
    name: str  # the pod's name: status derivation keys replicas and ranks by it
    role: st.Role
    argv: list[str]
    env: dict[str, str]
    url: str | None = None  # rollout: where /health answers; learner: where /progress answers


def _pod_env(pod: dict[str, Any], config_path: str) -> dict[str, str]:
    """The pod's literal environment, minus what only makes sense in a container (paths of its volumes)."""
    env = {item["name"]: item["value"] for item in pod["spec"]["containers"][0]["env"] if "value" in item}
    env.pop("HOME", None)
    env.pop("HF_HOME", None)
    env["GRPO_CONFIG"] = config_path
    return env


def _swap(argv: list[str], old: str, new: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        out.extend(new if arg == old else [arg])
    return out


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    return argv


def plan_processes(
    run: str, namespace: str, spec: GRPORunSpec, config_path: str, *, rollout_python: str, learner_python: str,
    rollout_ports: list[int], learner_http_port: int, main_process_port: int, cpu_count: int | None = None,
) -> list[ProcessPlan]:
    """The operator's pods as local processes: its commands and env, with local interpreter, config and ports.

    With `cpu_count`, a CPU learner gets its share of the cores as OpenMP threads: torch's default (one thread per
    core) on cores shared with the vLLM server made training 4.5x slower on 2 cores (BENCHMARKS.md, section 5),
    since OpenMP's threads wait on each other whenever one is descheduled.
    """
    pod_config = f"{builders.CONFIG_DIR}/{builders.CONFIG_FILE}"
    plans = []
    for index, port in enumerate(rollout_ports):
        pod = builders.build_rollout_pod(run, namespace, "local", spec, index, trainer_image="local")
        argv = _swap(_swap(pod["spec"]["containers"][0]["command"], "python", [rollout_python]), pod_config,
                     [config_path])
        plans.append(ProcessPlan(pod["metadata"]["name"], "rollout", [*argv, "--port", str(port)],
                                 _pod_env(pod, config_path), f"http://{LOCAL_HOST}:{port}"))
    pod = builders.build_learner_pod(run, namespace, "local", spec, 0, trainer_image="local")
    argv = _swap(pod["spec"]["containers"][0]["command"], "python", [learner_python])
    argv = _swap(argv, pod_config, [config_path])
    argv = _set_flag(_set_flag(argv, "--main_process_ip", LOCAL_HOST), "--main_process_port", str(main_process_port))
    env = _pod_env(pod, config_path)
    if cpu_count is not None and spec.learner.device == "cpu":
        sharers = spec.learner.processes_per_node + spec.rollout.replicas
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count // sharers))
    plans.append(ProcessPlan(pod["metadata"]["name"], "learner", argv, env, f"http://{LOCAL_HOST}:{learner_http_port}"))
    return plans


def observe(plan: ProcessPlan, exit_code: int | None, *, ready: bool, message: str | None) -> st.PodObservation:
    """A local process as the pod the operator would see: running, or exited with a code and a message."""
    if exit_code is None:
        return st.PodObservation(plan.name, plan.role, "Running", ready)
    phase = "Succeeded" if exit_code == 0 else "Failed"
    reason = "Completed" if exit_code == 0 else ("Killed" if exit_code < 0 else "Error")
    return st.PodObservation(plan.name, plan.role, phase, False, exit_code=exit_code, reason=reason, message=message)


def one_line(text: str, limit: int = EVENT_DISPLAY_CHARS) -> str:
    """An event as one console line: a crash's message is the log tail (as with FallbackToLogsOnError)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def final_summary(status: dict[str, Any]) -> str:
    """The lines printed when the run ends: phase, reason, progress."""
    phase = status.get("phase", "Unknown")
    failure = status.get("failure") or {}
    reason = failure.get("reason") or next(
        (cond["reason"] for cond in status.get("conditions", []) if cond["type"] == phase and cond["status"] == "True"),
        "",
    )
    lines = [f"phase: {phase}" + (f"  reason: {reason}" if reason else "")]
    if status.get("message"):
        lines.append(f"message: {status['message']}")
    progress = status.get("progress")
    if progress:
        dropped = {k: v for k, v in (progress.get("dropped") or {}).items() if v}
        reward = progress.get("rewardMean")
        lines.append(
            f"progress: epoch {progress.get('epoch', 0)}/{_number(progress.get('epochs'))}, groups consumed "
            f"{progress.get('groupsConsumed', 0)}/{progress.get('groupsTotal', 0)}, trained {progress.get('groupsTrained', 0)}, "
            f"dropped {progress.get('groupsDropped', 0)}" + (f" {dropped}" if dropped else "")
            + f", steps {progress.get('globalStep', 0)}" + (f", reward {reward:.3f}" if reward is not None else "")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# I/O: ports, interpreters, processes, HTTP
# ---------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL_HOST, 0))
        return sock.getsockname()[1]


def find_rollout_python(explicit: str | None) -> str:
    """`--rollout-python`, else $GRPO_ROLLOUT_PYTHON, else the repo's .venv-rollout (vLLM lives in its own venv)."""
    candidates = [explicit, os.environ.get(ROLLOUT_PYTHON_ENV)]
    here = Path(__file__).resolve()
    candidates += [str(parent / ROLLOUT_VENV / "bin" / "python") for parent in here.parents]
    candidates.append(str(Path.cwd() / ROLLOUT_VENV / "bin" / "python"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise LocalError(
        f"no Python with vLLM found: pass --rollout-python, set {ROLLOUT_PYTHON_ENV}, or build {ROLLOUT_VENV} "
        "(make setup-rollout); or reuse a running server with --rollout-url"
    )


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class LocalProcess:
    plan: ProcessPlan
    log_path: Path
    popen: subprocess.Popen | None = None
    exit_code: int | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing after this returns
        # Own session = own process group: stopping it reaches vLLM's engine core and TRL's rollout worker too.
        self.popen = subprocess.Popen(
            self.plan.argv, env={**os.environ, **self.plan.env}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self.exit_code = None

    def poll(self) -> int | None:
        if self.popen is not None and self.exit_code is None:
            self.exit_code = self.popen.poll()
        return self.exit_code

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`. Leaves no orphans."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may be gone while children (engine core, rollout worker) linger in its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the killed members are gone from the process table
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.poll()


def http_get(url: str, timeout: float = 2.0) -> str | None:
    """The body of a 200 answer, else None (not up yet, gone, or an error status)."""
    try:
        with urlopen(url, timeout=timeout) as response:  # noqa: S310 - our own local servers
            return response.read().decode() if response.status == 200 else None
    except (URLError, OSError, ValueError):
        return None


def http_ok(url: str) -> bool:
    return http_get(url) is not None


def fetch_progress(url: str) -> c.ProgressReport | None:
    body = http_get(f"{url}{c.PROGRESS_PATH}")
    try:
        return c.parse_progress(body) if body else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------
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
            if code is None:
                ready = http_ok(f"{plan.url}/health") if plan.role == "rollout" else True
                pods.append(observe(plan, None, ready=ready, message=None))
                continue
            message = None
            if plan.role == "learner" and self.termination_path and self.termination_path.is_file():
                message = self.termination_path.read_text(errors="replace")
            pods.append(observe(plan, code, ready=False, message=message or tail(process.log_path)))
        return pods

    def act(self, actions: list[st.Action], console: Console) -> None:
        for action in actions:
            if isinstance(action, st.CreateChildren):
                for process in self.processes.values():
                    if process.popen is None:
                        process.start()
                        console.log(f"started {process.plan.name} (pid {process.popen.pid}, log {process.log_path})")
            elif isinstance(action, st.DeletePods | st.RecreatePods):
                for name in action.pods:
                    process = self.processes.get(name)
                    if process is not None and process.popen is not None:
                        process.stop()
                        if isinstance(action, st.RecreatePods):
                            process.popen = None  # missing now: the next CreateChildren starts it again
                            if process.plan.role == "learner" and self.termination_path:
                                self.termination_path.unlink(missing_ok=True)

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.stop()


def prepare(args: argparse.Namespace) -> LocalRun:
    """Everything before a process starts. Raises ManifestError/ManifestInvalid/LocalError (user mistakes)."""
    manifest_path = Path(args.manifest)
    run = read_grporun(manifest_path)
    spec = localize_spec(run.spec, manifest_path.resolve().parent)
    check_rewards(spec)
    run_dir = Path(args.runs_dir).resolve() / run.name
    if run_dir.exists() and not args.resume:
        shutil.rmtree(run_dir)
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
    rollout_python = find_rollout_python(args.rollout_python) if not external else sys.executable
    termination_path = run_dir / "termination-log"
    config = resolve_run_config(
        run.name, run.namespace, spec, rollout_urls=urls, output_dir=str(run_dir / "output"),
        checkpoint_dir=str(run_dir / "checkpoints"),
        weight_sync_dir=str(run_dir / "weights") if spec.rollout.weight_sync.mode == "filesystem" else None,
        termination_message_path=str(termination_path),
    )
    learner_port = free_port()
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"http_port": learner_port})})
    config_path = run_dir / "run.json"
    config_path.write_text(config.model_dump_json(by_alias=True, indent=2))
    plans = plan_processes(
        run.name, run.namespace, spec, str(config_path), rollout_python=rollout_python,
        learner_python=sys.executable, rollout_ports=rollout_ports, learner_http_port=learner_port,
        main_process_port=free_port(),
        cpu_count=None if "OMP_NUM_THREADS" in os.environ else os.cpu_count(),  # the user's setting wins
    )
    processes = {plan.name: LocalProcess(plan, run_dir / "logs" / f"{plan.name}.log") for plan in plans}
    return LocalRun(run.name, run.namespace, spec, run_dir, processes, [url for url in urls if external],
                    termination_path)


def _bar_fields(status: dict[str, Any]) -> dict[str, Any]:
    progress = status.get("progress") or {}
    reward = progress.get("rewardMean")
    return {
        "total": max(progress.get("groupsTotal") or 0, 1),
        "completed": progress.get("groupsConsumed") or 0,
        "phase": status.get("phase") or "Pending",
        "epoch": f"{progress.get('epoch', 0)}/{_number(progress.get('epochs', '?'))}",
        "trained": progress.get("groupsTrained") or 0,
        "dropped": progress.get("groupsDropped") or 0,
        "stall": f"{progress.get('stallStreak', 0)}/{progress.get('stallLimit', 0)}",
        "reward": "-" if reward is None else f"{reward:.3f}",
        "eta": format_duration(progress.get("estimatedRemainingSeconds")),
    }


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Progress]:
    columns = (
        TextColumn("[bold]{task.fields[phase]}"), BarColumn(bar_width=16),
        TextColumn("{task.completed}/{task.total} groups, epoch {task.fields[epoch]}, trained {task.fields[trained]}, "
                   "dropped {task.fields[dropped]}, stall {task.fields[stall]}, reward {task.fields[reward]}, "
                   "ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False, refresh_per_second=2) as bar:
        yield bar


def supervise(local: LocalRun, console: Console, poll_interval_s: float) -> dict[str, Any]:
    """Tick until the run finishes: observe, derive the status like the operator, act, draw."""
    with progress_bar(console) as bar:
        task = bar.add_task("run", **_bar_fields({}))
        while True:
            pods = local.observations()
            learner = local.learner()
            report = fetch_progress(learner.plan.url) if learner.popen is not None and learner.poll() is None else None
            decision = st.derive_status(
                local.spec, local.status, pods, report, datetime.datetime.now(datetime.UTC), generation=1,
            )
            local.status = decision.status
            for event in decision.events:
                console.log(f"{event.type} {event.reason}: {one_line(event.message)}")
            local.act(decision.actions, console)
            bar.update(task, **_bar_fields(local.status))
            if Phase(local.status["phase"]) in FINISHED_PHASES:
                return local.status
            time.sleep(poll_interval_s)


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST", help="a GRPORun YAML file")
    parser.add_argument("--runs-dir", default="runs", help="where runs/<name>/ (config, logs, checkpoints) go")
    parser.add_argument("--resume", action="store_true",
                        help="keep runs/<name>/ from an earlier run and resume from its newest checkpoint")
    parser.add_argument("--rollout-url", action="append", metavar="URL",
                        help="use this running vLLM server (started with VLLM_SERVER_DEV_MODE=1 on the same model) "
                             "instead of starting one; repeat for several")
    parser.add_argument("--rollout-python", metavar="PATH",
                        help="the Python that has vLLM (default: $GRPO_ROLLOUT_PYTHON, else .venv-rollout)")
    parser.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS")


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        local = prepare(args)
    except ManifestInvalid as invalid:
        for line in invalid.errors:
            print(f"grporun local: {args.manifest}: {line}", file=sys.stderr)
        return 2
    except (ManifestError, LocalError) as error:
        print(f"grporun local: {error}", file=sys.stderr)
        return 2
    console.log(f"run {local.name}: config, logs and checkpoints in {local.run_dir}")
    for role, role_spec in (("rollout", local.spec.rollout), ("learner", local.spec.learner)):
        for note in local_env_notes(role, role_spec.pod_template_override, os.environ):
            console.log(note)
    interrupted = False
    try:
        status = supervise(local, console, args.poll_interval)
    except KeyboardInterrupt:
        interrupted = True
        status = local.status or {}
    finally:
        local.stop_all()
    if interrupted:
        print("grporun local: interrupted; stopped the rollout and learner processes", file=sys.stderr)
        return 130
    print(final_summary(status))
    return 0 if status.get("phase") == Phase.SUCCEEDED.value else 1
