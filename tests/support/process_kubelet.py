"""A kubelet for tests: runs the pods of one namespace as local processes, each in its own network namespace.

Test support, not a product. What it does, in the order a pod lives:
- registers a Node and binds every unscheduled pod of its namespace to it (it is the scheduler too);
- starts the pod's one container: the image is ignored, the command runs with this checkout's interpreters
  (`python` is the learner venv's, `GRPO_ROLLOUT_PYTHON` the vLLM venv's), in a network namespace of its own
  (pod_network.py) and a mount namespace where ConfigMap, emptyDir and hostPath volumes are bind-mounted at their
  mountPaths (empty folders are made on the host as mount points) and a per-pod file over the termination-message
  path. `env` values and the fieldRefs metadata.name, metadata.namespace, status.podIP, spec.nodeName are set;
- reports Running with the pod's IP, Ready from the readiness probe (httpGet) or at once when there is none;
- on exit writes the exit code and the termination message (the file, or the log's tail under
  FallbackToLogsOnError when the file is empty and the code is not 0) to pod status;
- on deletion sends SIGTERM, waits the grace period, SIGKILLs, and confirms the deletion (grace period 0).
Not enforced: securityContext (processes run as this user), resources, image pulls, restarts.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.support.control_plane_client import Client
from tests.support.kube_emulator import CONFIGMAPS, PODS, ApiError
from tests.support.paths import REPO
from tests.support.pod_network import PodNetwork


def _signal(process: subprocess.Popen, signum: int) -> None:
    """Signal the pod's whole process group (the command and everything it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class RunningPod:
    name: str
    uid: str
    process: subprocess.Popen
    netns: str
    ip: str
    folder: Path
    container: dict[str, Any]
    ready: bool = False
    killed_at: float | None = None
    reported: dict[str, Any] = field(default_factory=dict)


class ProcessKubelet:
    def __init__(self, client: Client, namespace: str, workdir: Path, node: str = "process-node"):
        self.client, self.namespace, self.workdir, self.node = client, namespace, workdir, node
        self.network = PodNetwork()
        self.pods: dict[str, RunningPod] = {}  # by uid
        self.finished: set[str] = set()  # uids whose exit has been reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="process-kubelet", daemon=True)
        self.errors: list[str] = []

    # --- life ----------------------------------------------------------------------------------------------------
    def start(self) -> ProcessKubelet:
        self.client.call("POST", "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node",
                                                         "metadata": {"name": self.node}})
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "process kubelet",
                 "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
        self.client.call("PATCH", f"/api/v1/nodes/{self.node}/status", json={"status": {"conditions": [ready]}},
                         headers={"Content-Type": "application/merge-patch+json"})
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for pod in self.pods.values():
            self._kill(pod, grace=5)
        self.network.close()
        self.client.request("DELETE", f"/api/v1/nodes/{self.node}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in self.client.list(PODS, self.namespace):
                    self._sync(pod)
                for pod in list(self.pods.values()):
                    self._watch_process(pod)
            except (ApiError, requests.RequestException, OSError, RuntimeError) as error:
                self.errors.append(repr(error))
            self._stop.wait(0.25)

    # --- one pod -------------------------------------------------------------------------------------------------
    def _path(self, name: str, sub: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{name}{sub}"

    def _sync(self, pod: dict[str, Any]) -> None:
        metadata, spec = pod["metadata"], pod["spec"]
        name, uid = metadata["name"], metadata["uid"]
        if metadata.get("deletionTimestamp"):
            running = self.pods.get(uid)
            if running is None or running.process.poll() is not None:
                self._confirm_deletion(name, uid)
            elif running.killed_at is None:
                self._kill(running, grace=float(metadata.get("deletionGracePeriodSeconds") or 30), wait=False)
            return
        if not spec.get("nodeName"):
            binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
            self.client.call("POST", self._path(name, "/binding"), json=binding)
        elif spec["nodeName"] == self.node and uid not in self.pods and uid not in self.finished:
            try:
                self.pods[uid] = self._start(pod)
            except (RuntimeError, OSError) as error:  # the pod cannot run here: say so once, as a kubelet would
                self.finished.add(uid)
                self.client.patch(PODS, self.namespace, name, {"status": {
                    "phase": "Failed", "reason": "ProcessKubelet", "message": str(error)}}, subresource="status")

    def _confirm_deletion(self, name: str, uid: str) -> None:
        running = self.pods.pop(uid, None)
        if running is not None:
            self.network.remove(running.netns)
        self.client.request("DELETE", self._path(name), json={"gracePeriodSeconds": 0,
                                                               "preconditions": {"uid": uid}})

    def _volume_sources(self, pod: dict[str, Any], folder: Path) -> dict[str, Path]:
        sources = {}
        for volume in pod["spec"].get("volumes") or []:
            target = folder / "volumes" / volume["name"]
            if "configMap" in volume:
                target.mkdir(parents=True)
                config_map = self.client.get(CONFIGMAPS, self.namespace, volume["configMap"]["name"]) or {}
                for key, value in (config_map.get("data") or {}).items():
                    (target / key).write_text(value)
            elif "emptyDir" in volume:
                target.mkdir(parents=True)
            elif "hostPath" in volume:
                target = Path(volume["hostPath"]["path"])
                target.mkdir(parents=True, exist_ok=True)
            else:
                raise RuntimeError(f"process kubelet: volume {volume['name']} has an unsupported source")
            sources[volume["name"]] = target
        return sources

    def _environment(self, pod: dict[str, Any], container: dict[str, Any], ip: str) -> dict[str, str]:
        fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": self.namespace,
                  "status.podIP": ip, "spec.nodeName": self.node}
        venv = Path(sys.executable).parent
        env = {"PATH": f"{venv}:/usr/local/bin:/usr/bin:/bin", "HOSTNAME": pod["metadata"]["name"],
               "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer_image'}",
               "GRPO_ROLLOUT_PYTHON": os.environ.get("GRPO_ROLLOUT_PYTHON",
                                                     str(REPO / ".venv-rollout" / "bin" / "python"))}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def _start(self, pod: dict[str, Any]) -> RunningPod:
        metadata, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        folder = self.workdir / f"{metadata['name']}-{metadata['uid'][:8]}"
        folder.mkdir(parents=True)
        hostname = spec.get("hostname") or metadata["name"]
        names = [hostname] + ([f"{hostname}.{spec['subdomain']}.{self.namespace}.svc",
                               f"{hostname}.{spec['subdomain']}.{self.namespace}.svc.cluster.local"]
                              if spec.get("subdomain") else [])
        netns, ip = self.network.add(names)
        sources = self._volume_sources(pod, folder)
        termination = folder / "termination-log"
        termination.touch()
        mounts = [(str(sources[m["name"]]), m["mountPath"]) for m in container.get("volumeMounts") or []]
        message_path = container.get("terminationMessagePath", "/dev/termination-log")
        script = "set -e\n"
        for source, target in mounts:
            script += f"mkdir -p '{target}' && mount --bind '{source}' '{target}'\n"
        script += f"[ -e '{message_path}' ] || touch '{message_path}'\nmount --bind '{termination}' '{message_path}'\n"
        script += 'exec "$@"\n'
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        log = open(folder / "container.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        process = subprocess.Popen(["ip", "netns", "exec", netns, "sh", "-c", script, "sh", *command],
                                   env=self._environment(pod, container, ip), cwd=folder, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        running = RunningPod(metadata["name"], metadata["uid"], process, netns, ip, folder, container,
                             ready="readinessProbe" not in container)
        self._report(running, {"running": {"startedAt": _now()}})
        return running

    def _probe(self, pod: RunningPod) -> bool:
        probe = pod.container.get("readinessProbe") or {}
        get = probe.get("httpGet")
        if not get:
            return True
        try:
            return requests.get(f"http://{pod.ip}:{get['port']}{get.get('path', '/')}", timeout=2).ok
        except requests.RequestException:
            return False

    def _watch_process(self, pod: RunningPod) -> None:
        code = pod.process.poll()
        if code is None:
            if pod.killed_at is not None and time.monotonic() > pod.killed_at:
                _signal(pod.process, signal.SIGKILL)
            ready = self._probe(pod)
            if ready != pod.ready:
                pod.ready = ready
                self._report(pod, {"running": {"startedAt": pod.reported["startedAt"]}})
            return
        if pod.uid in self.finished:
            return
        self.finished.add(pod.uid)
        code = 128 - code if code < 0 else code  # a signal, as a container runtime reports it
        message = (pod.folder / "termination-log").read_text(errors="replace")[-4096:]
        if not message and code != 0 and pod.container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = (pod.folder / "container.log").read_text(errors="replace").splitlines()[-80:]
            message = "\n".join(lines)[-2048:]
        pod.ready = False
        self._report(pod, {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                          "message": message, "startedAt": pod.reported["startedAt"],
                                          "finishedAt": _now()}}, phase="Succeeded" if code == 0 else "Failed")

    def _report(self, pod: RunningPod, state: dict[str, Any], phase: str = "Running") -> None:
        pod.reported.setdefault("startedAt", _now())
        ready = "True" if pod.ready else "False"
        status = {"phase": phase, "podIP": pod.ip, "podIPs": [{"ip": pod.ip}], "hostIP": self.network.host_ip,
                  "startTime": pod.reported["startedAt"],
                  "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready},
                                 {"type": "ContainersReady", "status": ready}],
                  "containerStatuses": [{"name": pod.container["name"], "ready": pod.ready, "restartCount": 0,
                                         "image": pod.container["image"], "imageID": "", "state": state,
                                         "started": "running" in state}]}
        try:
            self.client.patch(PODS, self.namespace, pod.name, {"status": status}, subresource="status")
        except ApiError as error:
            if error.code != 404:
                raise

    def _kill(self, pod: RunningPod, grace: float, wait: bool = True) -> None:
        if pod.process.poll() is None:
            _signal(pod.process, signal.SIGTERM)
            pod.killed_at = time.monotonic() + grace
            if wait:
                try:
                    pod.process.wait(grace)
                except subprocess.TimeoutExpired:
                    _signal(pod.process, signal.SIGKILL)
                    pod.process.wait()
