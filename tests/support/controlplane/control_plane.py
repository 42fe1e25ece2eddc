"""A real Kubernetes control plane for tests: etcd + kube-apiserver on loopback, with real authentication (a static
token file for the admin, ServiceAccount tokens from the TokenRequest API for everyone else) and RBAC authorization.

Binaries: `$KUBEBUILDER_ASSETS` when it names a folder with `kube-apiserver` and `etcd` (the envtest convention),
otherwise `hack/k8s/build.sh controlplane` builds them from Go modules into a cache folder (the versions are its
go.mod's), in the background while other tests run (build_fixtures.py). No
controller-manager and no scheduler: nothing garbage-collects, nothing schedules, and a namespace's "default"
ServiceAccount is created by whoever makes the namespace. A test that needs
the garbage collector starts kube-controller-manager with that controller alone for its own duration
(`garbage_collector` in control_plane_fixtures.py); build.sh builds it beside the others.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import requests
import yaml

from tests.support.builds import Build, Unavailable
from tests.support.paths import REPO
from tests.support.ports import free_port

#: Builds one set of the Go commands the tiers run from one Go module: `controlplane` (here), `node`, `helm`.
BUILD_SCRIPT = REPO / "hack" / "k8s" / "build.sh"
BUILD_NAME = "controlplane"  # the set, and its name in hack/lib/build-times
ADMIN_TOKEN = "grpo-test-admin-token"
REQUIRED = ("kube-apiserver", "etcd")
CONTROLLER_MANAGER = "kube-controller-manager"
GC_STARTED = "Proceeding to collect garbage"  # the garbage collector's log line once its monitors synced
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _go() -> str | None:
    return shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None)


def assets() -> Path | None:
    """`$KUBEBUILDER_ASSETS` when it is set: the binaries are there and nothing is built."""
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if not folder:
        return None
    missing = [name for name in REQUIRED if not (Path(folder) / name).is_file()]
    if missing:
        raise Unavailable(f"KUBEBUILDER_ASSETS={folder} has no {', '.join(missing)}")
    return Path(folder)


def go_build(name: str, command: list[str], what: str) -> Build:
    """The build `command` (not started yet) with Go on its PATH; Unavailable without Go."""
    go = _go()
    if go is None:
        raise Unavailable(f"Go is not installed: {what} built from Go modules")
    return Build(name, command, {**os.environ, "PATH": f"{Path(go).parent}:{os.environ.get('PATH', '')}"})


def k8s_build(set_name: str, what: str) -> Build:
    """hack/k8s/build.sh's build of `set_name` (not started), which prints the folder of its commands."""
    return go_build(set_name, [str(BUILD_SCRIPT), set_name], what)


def build() -> Build | str:
    """kube-apiserver, etcd, kubectl and kube-controller-manager's build (hack/k8s/build.sh controlplane), which only
    prints the folder where they are built already; or `$KUBEBUILDER_ASSETS`, where nothing is built."""
    found = assets()
    if found is not None:
        return str(found)
    return k8s_build(BUILD_NAME, "kube-apiserver and etcd are (or set KUBEBUILDER_ASSETS to a folder with them)")


def _die_with_parent() -> None:
    """SIGTERM the child when the test process dies without its teardown (a killed pytest left servers behind)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path, extra_sans: tuple[str, ...] = ()) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost (and `extra_sans`, e.g. "IP:10.0.0.1") signed by it, and
    the ServiceAccount signing key."""
    if shutil.which("openssl") is None:
        raise Unavailable("openssl is not installed (it makes the test API server's certificates)")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=grpo-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver", "-keyout", "server.key",
             "-out", "server.csr", cwd=directory)
    (directory / "san.ext").write_text(f"subjectAltName={','.join(('IP:127.0.0.1', 'DNS:localhost', *extra_sans))}\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=directory)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=directory)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)


class ControlPlane:
    """etcd + kube-apiserver in `workdir`; `start()` returns when the server is ready, `stop()` ends both."""

    def __init__(self, workdir: Path, bin_dir: Path):
        self.workdir, self.bin_dir = workdir, bin_dir
        self.processes: list[subprocess.Popen] = []
        self.url = ""
        self.ca = workdir / "ca.crt"
        self.kubeconfig = workdir / "kubeconfig"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        process = subprocess.Popen([str(self.bin_dir / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_die_with_parent)
        self.processes.append(process)
        return process

    def process_name(self, process: subprocess.Popen) -> str:
        """The name its log is under."""
        return Path(process.args[0]).name

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, timeout: float = 180.0) -> ControlPlane:
        make_certificates(self.workdir)
        (self.workdir / "tokens.csv").write_text(f"{ADMIN_TOKEN},grpo-test-admin,1,system:masters\n")
        etcd_port, peer_port, port = free_port(), free_port(), free_port()
        self._spawn("etcd", [f"--data-dir={self.workdir / 'etcd-data'}",
                             f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                             f"--listen-peer-urls=http://127.0.0.1:{peer_port}"])
        w = self.workdir
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={w}",
            f"--tls-cert-file={w / 'server.crt'}", f"--tls-private-key-file={w / 'server.key'}",
            f"--client-ca-file={w / 'ca.crt'}", f"--token-auth-file={w / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--anonymous-auth=false",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=false", "--profiling=false",
            # The endpoint reconciler refuses a loopback advertise address, and nothing here needs the endpoints.
            "--endpoint-reconciler-type=none",
        ])
        self.url = f"https://127.0.0.1:{port}"
        self._wait_ready(timeout)
        self.write_kubeconfig(self.kubeconfig, ADMIN_TOKEN)
        return self

    def start_controller_manager(self, controllers: str = "garbagecollector",
                                 timeout: float = 120.0) -> subprocess.Popen:
        """kube-controller-manager with only `controllers`, as the admin, serving nothing; returns once its garbage
        collector has synced its monitors of every resource (before that it deletes nothing). Stop it with
        stop_process()."""
        if not (self.bin_dir / CONTROLLER_MANAGER).is_file():
            raise Unavailable(f"{self.bin_dir} has no {CONTROLLER_MANAGER}")
        process = self._spawn(CONTROLLER_MANAGER, [
            f"--kubeconfig={self.kubeconfig}", f"--controllers={controllers}", "--leader-elect=false",
            "--secure-port=0", "--concurrent-gc-syncs=5"])
        deadline = time.monotonic() + timeout
        while GC_STARTED not in (self.workdir / f"{CONTROLLER_MANAGER}.log").read_text(errors="replace"):
            if process.poll() is not None:
                raise RuntimeError(f"{CONTROLLER_MANAGER} exited with {process.returncode}:\n"
                                   f"{self.log_tail(CONTROLLER_MANAGER)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the garbage collector did not sync in {timeout} s:\n"
                                   f"{self.log_tail(CONTROLLER_MANAGER)}")
            time.sleep(0.5)
        return process

    def stop_process(self, process: subprocess.Popen) -> None:
        _terminate(process)
        self.processes.remove(process)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        session = self.session(ADMIN_TOKEN)
        while True:
            for process in self.processes:
                if process.poll() is not None:
                    name = self.process_name(process)
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")
            try:
                if session.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready after {timeout} s:\n{self.log_tail('kube-apiserver')}")
            time.sleep(0.5)

    def session(self, token: str) -> requests.Session:
        session = requests.Session()
        # Not the environment's settings: with REQUESTS_CA_BUNDLE set, requests ignores session.verify.
        session.trust_env = False
        session.headers["Authorization"] = f"Bearer {token}"
        session.verify = str(self.ca)
        return session

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def stop(self) -> None:
        for process in reversed(self.processes):  # the API server before its etcd
            if process.poll() is None:
                _terminate(process)
        self.processes.clear()


def _terminate(process: subprocess.Popen, grace_s: float = 15) -> None:
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
