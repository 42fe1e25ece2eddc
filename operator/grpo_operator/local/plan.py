"""Pure planning of a local run: the manifest's spec with local paths, and the operator's pods as local processes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.pod_env import ENVIRONMENT_URL_SEPARATOR, environment_url_variable
from grpo_trainer.contract.store_uri import is_object_store_uri

from .. import builders
from ..api import EnvironmentSpec, GRPORunSpec
from ..exit_codes import ExitCode
from ..manifest import ManifestInvalid
from ..model_config import HubAccess, resolve_commit
from ..run_ref import RunRef
from ..run_status import GRPORunStatus, PinnedRevision
from ..status import PodObservation, Role, revision

LOCAL_HOST = "127.0.0.1"


class LocalError(Exception):
    """A problem found before anything starts that is not in the manifest (the manifest's own raise
    ManifestInvalid): one line, and the exit code for it."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = exit_code


def localize_path(value: str, base: Path) -> str:
    """`./x` and `../x` in a manifest are relative to the manifest's folder (so examples run from anywhere)."""
    if value.startswith(("./", "../")):
        return str((base / value).resolve())
    return value


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~"))


def local_output(run: str, spec: GRPORunSpec, run_dir: Path) -> tuple[Path, str, str | None] | None:
    """Where a local run exports its model (spec.output): the folder, the URI the run reports, and a note when the
    folder is not the spec's own place; None without spec.output.

    A hostPath volume is a folder on this machine: the model goes where a cluster's pod would put it, in a folder
    named after the run (a path starting with ./ or ../ is relative to the manifest, like the others; localize_spec
    made it absolute). Any other volume (a claim) exists only in a cluster: the model goes under the run's folder.
    With spec.output.uri the folder is then uploaded there, as the learner pod does, with the credentials of this
    machine's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or boto3's own chain).
    """
    if spec.output is None:
        return None
    volume = spec.output.volume or {}
    host_path = (volume.get("hostPath") or {}).get("path")
    if isinstance(host_path, str) and host_path:
        folder, note = Path(host_path).expanduser() / run, None
    elif spec.output.volume is None:
        folder, note = run_dir / "model", None  # staged in the run's folder, as in the pod's own
    else:
        folder = run_dir / "model"
        note = f"spec.output.volume is a {next(iter(volume))}, which only a cluster mounts: the model goes to {folder}"
    if spec.output.uri is not None:
        note = f"{note}, then to {spec.output.uri}" if note else None
    return folder, spec.output.uri or folder.as_uri(), note


def localize_spec(spec: GRPORunSpec, manifest_dir: Path) -> GRPORunSpec:
    """The spec with local paths made absolute and checked. Raises ManifestInvalid naming the field."""
    spec = spec.model_copy(deep=True)
    spec.model = localize_path(spec.model, manifest_dir)
    if _looks_local(spec.model) and not Path(spec.model).expanduser().is_dir():
        raise ManifestInvalid([f"spec.model: {spec.model}: no such directory"])
    # An s3:// model or dataset is downloaded by the learner and the server themselves (grpo_trainer.storage.inputs).
    if spec.dataset.path is not None and not is_object_store_uri(spec.dataset.path):
        spec.dataset.path = localize_path(spec.dataset.path, manifest_dir)
        if not Path(spec.dataset.path).expanduser().exists():
            raise ManifestInvalid([f"spec.dataset.path: {spec.dataset.path}: no such file or directory"])
    for index, reward in enumerate(spec.rewards):
        if reward.model is not None:
            reward.model = localize_path(reward.model, manifest_dir)
            if _looks_local(reward.model) and not Path(reward.model).expanduser().is_dir():
                raise ManifestInvalid([f"spec.rewards[{index}].model: {reward.model}: no such directory"])
    host_path = ((spec.output.volume or {}).get("hostPath") or {}) if spec.output is not None else {}
    if isinstance(host_path.get("path"), str):
        host_path["path"] = localize_path(host_path["path"], manifest_dir)
    if spec.learner.nodes != 1:
        nodes = spec.learner.nodes
        raise ManifestInvalid([f"spec.learner.nodes: grporun local runs on one machine; got {nodes}, use 1"])
    for position, environment in enumerate(spec.environments or []):
        if environment.command is None:
            raise ManifestInvalid([f"spec.environments[{position}].command: grporun local runs the server's command "
                                   "on this machine, not its image's entrypoint: set command (and args)"])
        local_probe(environment, f"spec.environments[{position}]")  # refused here, before anything starts
    return spec


def check_rewards(spec: GRPORunSpec) -> None:
    """`module:function` rewards, tools and environment factories must import here, before minutes of server
    start-up (built-in reward names are checked with the spec, `api.check_reward_names`)."""
    from grpo_trainer.agentic.tools import CallBounds, ToolError, load_environment_factory, load_tools
    from grpo_trainer.learner.rewards import RewardError, load_reward

    for index, reward in enumerate(spec.rewards):
        if reward.is_model:
            continue  # loaded by the learner (grpo_trainer.learner.scoring); localize_spec checked a local path
        try:
            load_reward(reward)
        except RewardError as error:
            field_name = "name" if reward.name is not None else "function"
            raise ManifestInvalid([f"spec.rewards[{index}].{field_name}: {error}"]) from None
    for index, tool in enumerate(spec.training.tools):
        try:
            load_tools([tool])
        except ToolError as error:
            raise ManifestInvalid([f"spec.training.tools[{index}]: {error}"]) from None
    training = spec.training
    factories = {f"environmentFactories.{name}": factory for name, factory in
                 (training.environment_factories or {}).items()}
    if training.environment_factory is not None:
        factories["environmentFactory"] = training.environment_factory
    for where, factory in factories.items():
        try:
            load_environment_factory(factory, CallBounds.of(training))
        except ToolError as error:
            raise ManifestInvalid([f"spec.training.{where}: {error}"]) from None


@dataclass(frozen=True)
class LocalProbe:
    """An environment server's readiness probe on this machine (its pod's, `builders.environment_readiness_probe`):
    a TCP connect to the server's port, an HTTP GET of `path` on it (200 to 399 passes, as the kubelet's), or
    `command` run with the server's environment (exit 0 passes)."""

    kind: Literal["tcp", "http", "exec"]
    path: str = "/"
    command: tuple[str, ...] = ()
    timeout_s: float = 1.0


def local_probe(environment: EnvironmentSpec, where: str) -> LocalProbe:
    """The environment's probe as run here. Raises ManifestInvalid for what a local server cannot answer: a probe of
    another port than its own (it has one here, in $PORT), HTTPS, or a gRPC probe."""
    probe = builders.environment_readiness_probe(environment)
    field_path = f"{where}.readinessProbe"
    timeout_s = float(probe.get("timeoutSeconds") or 1)
    if "exec" in probe:
        return LocalProbe("exec", command=tuple(str(part) for part in probe["exec"].get("command") or []),
                          timeout_s=timeout_s)
    action = probe.get("httpGet") or probe.get("tcpSocket")
    if action is None:
        raise ManifestInvalid([f"{field_path}: grporun local runs tcpSocket, httpGet and exec probes only"])
    if action.get("port") not in (environment.port, str(environment.port), "http"):
        raise ManifestInvalid([f"{field_path}: port {action.get('port')!r}: a local server has one port (its "
                               f"port, {environment.port} in a pod), so its probe must use that one"])
    if "httpGet" in probe:
        if str(action.get("scheme", "HTTP")).upper() != "HTTP":
            raise ManifestInvalid([f"{field_path}.httpGet.scheme: grporun local probes over plain HTTP only"])
        return LocalProbe("http", path=str(action.get("path") or "/"), timeout_s=timeout_s)
    return LocalProbe("tcp", timeout_s=timeout_s)


@dataclass(frozen=True)
class ProcessPlan:
    name: str  # the pod's name: status derivation keys replicas and ranks by it
    role: Role
    argv: list[str]
    env: dict[str, str]
    url: str | None = None  # rollout: where /health answers; learner: where /progress answers; environment: its URL
    probe: LocalProbe | None = None  # an environment server's readiness probe


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


#: vLLM's CPU backend's core binding for its worker ("auto", "nobind" or a core list).
VLLM_CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_bind(spec: GRPORunSpec, index: int, servers: int, cpu_count: int | None) -> str | None:
    """The core a CPU rollout server's worker is bound to when several share the machine, else None (vLLM's own)."""
    if cpu_count and spec.rollout.device == "cpu" and servers > 1:
        # vLLM's CPU backend pins each server's worker to the same core by default: two servers on core 0 got
        # 14 % and 30 % of it. One core each, round robin over the machine's.
        return str(index % cpu_count)
    return None


def plan_rollout(owner: RunRef, spec: GRPORunSpec, index: int, port: int, config_path: str, rollout_python: str,
                 bind: str | None = None) -> ProcessPlan:
    """Rollout pod `index` as a local process on `port` (`bind`: see `cpu_bind`)."""
    pod_config = f"{builders.CONFIG_DIR}/{builders.CONFIG_FILE}"
    pod = builders.build_rollout_pod(owner, spec, index, trainer_image="local")
    argv = _swap(_swap(pod["spec"]["containers"][0]["command"], "python", [rollout_python]), pod_config,
                 [config_path])
    env = _pod_env(pod, config_path)
    if bind is not None:
        env.setdefault(VLLM_CPU_BIND_ENV, bind)
    return ProcessPlan(pod["metadata"]["name"], "rollout", [*argv, "--port", str(port)], env,
                       f"http://{LOCAL_HOST}:{port}")


#: `$(NAME)` in a container's command and args: the kubelet puts the container's variable NAME there (`$$` is `$`).
_VARIABLE_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_references(value: str, env: Mapping[str, str]) -> str:
    """`value` with `$(NAME)` replaced as the kubelet does in a command or args: by the container's own variable
    NAME (not this machine's), left as it is when there is none, and `$$` as `$`."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VARIABLE_REFERENCE.sub(replace, value)


def plan_environment(owner: RunRef, spec: GRPORunSpec, position: int, index: int, port: int,
                     python: str) -> ProcessPlan:
    """Server `index` of spec.environments[position] as a local process listening on `port`: its pod's command and
    args (a first word `python` becomes the interpreter `python` names, grporun's own, as the learner's does), with
    its pod's literal env and $PORT set to `port`. A `valueFrom` variable is left to this machine's environment (the
    process inherits it), as for the other roles' overrides."""
    environment = (spec.environments or [])[position]
    where = f"spec.environments[{position}]"
    pod = builders.build_environment_pod(owner, environment, index, where=where)
    container = pod["spec"]["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    env[builders.ENVIRONMENT_PORT_ENV] = str(port)
    argv = [expand_references(part, env) for part in [*container.get("command", []), *container.get("args", [])]]
    if argv and argv[0] == "python":
        argv[0] = python
    return ProcessPlan(pod["metadata"]["name"], "environment", argv, env, f"http://{LOCAL_HOST}:{port}",
                       local_probe(environment, where))


def local_environment_urls(spec: GRPORunSpec, ports: Mapping[str, list[int]]) -> dict[str, str]:
    """Each environment's address on this machine: its servers' URLs, one loopback port each, separated by
    ENVIRONMENT_URL_SEPARATOR (where a cluster's headless Service name resolves to its servers); the learner's
    client pins each episode to one of them. An environment of 0 servers names its spec's port, where no server of
    the run listens (a Service with no server behind it)."""
    return {environment.name: ENVIRONMENT_URL_SEPARATOR.join(
                f"http://{LOCAL_HOST}:{port}" for port in ports.get(environment.name) or [environment.port])
            for environment in spec.environments or []}


@dataclass(frozen=True)
class LocalPorts:
    """The loopback ports a local run's processes listen on: each rollout server's, the learner's HTTP port
    (/progress), accelerate's main process port (its ranks' rendezvous) and each environment's servers' (by its
    name, one per replica)."""

    rollout: list[int]
    learner_http: int
    main_process: int
    environments: dict[str, list[int]] = field(default_factory=dict)


def plan_processes(
    run: str, namespace: str, spec: GRPORunSpec, config_path: str, *, rollout_python: str, learner_python: str,
    ports: LocalPorts, cpu_count: int | None = None,
) -> list[ProcessPlan]:
    """The operator's pods as local processes: its commands and env, with local interpreter, config and ports.

    With `cpu_count`, a CPU learner gets its share of the cores as OpenMP threads: torch's default (one thread per
    core) on cores shared with the vLLM server made training 4.5x slower on 2 cores (BENCHMARKS.md, section 5),
    since OpenMP's threads wait on each other whenever one is descheduled.
    """
    pod_config = f"{builders.CONFIG_DIR}/{builders.CONFIG_FILE}"
    owner = RunRef(run, namespace, uid="local")  # no GRPORun object: only the pods' commands and env are used
    plans = [
        plan_rollout(owner, spec, index, port, config_path, rollout_python,
                     cpu_bind(spec, index, len(ports.rollout), cpu_count))
        for index, port in enumerate(ports.rollout)
    ]
    pod = builders.build_learner_pod(owner, spec, 0, trainer_image="local")
    argv = _swap(pod["spec"]["containers"][0]["command"], "python", [learner_python])
    argv = _swap(argv, pod_config, [config_path])
    argv = _set_flag(_set_flag(argv, "--main_process_ip", LOCAL_HOST), "--main_process_port", str(ports.main_process))
    env = _pod_env(pod, config_path)
    if cpu_count is not None and spec.learner.device == "cpu":
        sharers = spec.learner.processes_per_node + spec.rollout.replicas
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count // sharers))
    for name, url in local_environment_urls(spec, ports.environments).items():
        env[environment_url_variable(name)] = url
    plans.append(ProcessPlan(pod["metadata"]["name"], "learner", argv, env, f"http://{LOCAL_HOST}:{ports.learner_http}"))
    plans += [plan_environment(owner, spec, position, index, port, learner_python)
              for position, environment in enumerate(spec.environments or [])
              for index, port in enumerate(ports.environments.get(environment.name, []))]
    return plans


def observe(plan: ProcessPlan, exit_code: int | None, *, ready: bool, message: str | None) -> PodObservation:
    """A local process as the pod the operator would see: running, or exited with a code and a message."""
    if exit_code is None:
        return PodObservation(plan.name, plan.role, "Running", ready)
    phase = "Succeeded" if exit_code == 0 else "Failed"
    reason = "Completed" if exit_code == 0 else ("Killed" if exit_code < 0 else "Error")
    return PodObservation(plan.name, plan.role, phase, False, exit_code=exit_code, reason=reason, message=message)


def pin_revisions(spec: GRPORunSpec, hub: HubAccess, earlier: RunConfig | None = None) -> GRPORunStatus:
    """The commits a local run loads its hub model and dataset at (status.model, status.dataset; status/revision.py):
    those of the `earlier` run config of a resumed run, so it goes on at the commits it started with, else resolved
    from the hub now, once. Raises ManifestInvalid for a revision the hub refuses, LocalError when it cannot be
    reached (no process starts unpinned)."""
    pinned = GRPORunStatus()
    earlier_commits: dict[str, str | None] = {
        "model": earlier.model_revision if earlier is not None else None,
        "dataset": earlier.dataset.revision if earlier is not None else None}
    for request in revision.pin_requests(spec):
        commit = earlier_commits[request.kind]
        if commit is None:
            access = dataclasses.replace(hub, revision=request.requested)
            commit, failure = resolve_commit(request.name, request.kind, request.field, access)
            if failure is not None and failure.transient:
                raise LocalError(f"{failure.why}: the run does not start unpinned (set {request.field} to a commit, "
                                 "or to `unpinned`, to start without the hub)")
            if failure is not None:
                raise ManifestInvalid([failure.why])
        held = PinnedRevision(name=request.name, requested=request.requested, revision=commit)
        if request.kind == "model":
            pinned.model = held
        else:
            pinned.dataset = held
    return pinned
