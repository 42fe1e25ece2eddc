"""A real Kubernetes node for tests: the pods are containers (containerd + runc) run by a real kubelet.

Everything runs inside one network namespace and one private mount namespace that `Node.start()` makes (a holder
process keeps them alive): a control plane of its own (etcd, kube-apiserver with Node+RBAC authorization,
kube-controller-manager with the controllers a node's pods need, kube-scheduler), containerd, the kubelet, CoreDNS
and kube-proxy (nftables). The shared control plane of control_plane_fixtures.py is left as it is: its tests rely on
no controller running beside them.

Why each piece is the way it is:
- The namespace's bridge carries the node's address (the kubelet refuses a loopback node IP) and the pods' subnet.
  It has no link out of the namespace: pods reach each other, the node's own servers and nothing else. The tests
  reach the API server through netns_forward.py, on a free port of this machine's loopback.
- The mount namespace has tmpfs over /run, /var/log and /var/lib, where containerd 1.6, the kubelet and the CNI
  library write whatever their configs say (/run/containerd, /var/log/containers, /var/lib/cni), and files holding
  the values the kubelet wants bound over three /proc/sys files, with `protectKernelDefaults`: the kubelet never
  writes this machine's sysctls (it refuses to start rather than write them).
- The pods' cgroups live under a cgroup root named for this node (`cgroupRoot`), and every process the node starts
  is put in its own cgroup of the pids hierarchy, so that containerd's shims and the containers (which leave their
  parent) are found and killed by pid at teardown, and every cgroup is removed.
- Root here lacks CAP_SYS_RESOURCE: the kubelet's oomScoreAdj is 0 and containerd restricts oom_score_adj.
- `failCgroupV1: false`: kubelet 1.37 refuses cgroup v1 hosts otherwise.

Binaries: hack/k8s/build.sh's `controlplane` (etcd, kube-apiserver, kube-controller-manager, kubectl) and `node`
(kubelet, kube-scheduler, kube-proxy, CoreDNS, the pause and testbox image archives); containerd, runc, the CNI
plugins and nft from Debian (`make setup-node-apt`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.builds import Build
from tests.support.controlplane.control_plane import ADMIN_TOKEN, ControlPlane, _die_with_parent, _openssl, k8s_build
from tests.support.controlplane.control_plane import make_certificates as make_serving_certificates

BUILD_NAME = "node"  # hack/k8s/build.sh's set, and its name in hack/lib/build-times
NODE_NAME = "grpo-node"
PAUSE_IMAGE = "localhost/grpo-node-pause:1"
TESTBOX_IMAGE = "localhost/grpo-node-testbox:1"
CNI_BIN_DIR = Path("/usr/lib/cni")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SERVICE_CIDR = "10.96.0.0/24"
API_SERVICE_IP = "10.96.0.1"
API_PORT = 6443  # inside the node's namespace, where every port is free
KUBELET_TOKEN = "grpo-node-kubelet-token"
SCHEDULER_TOKEN = "grpo-node-scheduler-token"
IMPORT_TIMEOUT_S = 1200
# The kubelet checks these with protectKernelDefaults; the mount namespace shows it these values.
KERNEL_DEFAULTS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
# What a node's pods need of the controller-manager: ServiceAccounts and the CA ConfigMap for their tokens,
# EndpointSlices for DNS and kube-proxy, the not-ready taint lifted, Deployments, cascading deletes, namespace
# deletion, the aggregated view/edit roles, PodDisruptionBudgets for the Eviction API, PersistentVolumeClaims bound
# to PersistentVolumes (the kubelet mounts a claim only once it is Bound).
CONTROLLERS = ("serviceaccount,root-ca-cert-publisher,endpointslice,nodelifecycle,garbagecollector,namespace,"
               "clusterrole-aggregation,deployment,replicaset,disruption,persistentvolume-binder")
REQUIRED_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "nft", "ip", "unshare", "nsenter", "openssl")
DEBIAN_PACKAGES = "make setup-node-apt"


def unavailable_reason() -> str | None:
    """Why no node can exist on this machine (the tier skips with it), or None. Only what cannot be set up:
    a missing package or binary is an error the caller raises, not a skip."""
    if os.geteuid() != 0:
        return "a node needs root (network and mount namespaces, cgroups, containers)"
    if not (CGROUP_ROOT / "pids").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return f"no cgroups mounted at {CGROUP_ROOT}"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem (containerd's snapshotter)"
    return None


def missing_prerequisites() -> list[str]:
    missing = [name for name in REQUIRED_COMMANDS if shutil.which(name) is None]
    missing += [str(CNI_BIN_DIR / plugin) for plugin in ("bridge", "host-local", "loopback")
                if not (CNI_BIN_DIR / plugin).is_file()]
    return missing


def build() -> Build:
    """hack/k8s/build.sh node (not started), which prints the folder of the kubelet, kube-scheduler, kube-proxy,
    CoreDNS and the two image archives, building what is missing (minutes the first time)."""
    return k8s_build(BUILD_NAME, "the kubelet and CoreDNS are")


def _imported_references(output: str) -> list[str]:
    """The references `ctr image import` says it unpacked ("unpacking <reference> (sha256:...)...done")."""
    return [line.split()[1] for line in output.splitlines() if line.startswith("unpacking ")]


@dataclass(frozen=True)
class NodeAddresses:
    """The node's subnet (a /24 inside its own namespace): the bridge is .1, the pods get .10 and up."""

    prefix: str

    @classmethod
    def pick(cls) -> NodeAddresses:
        # Unique per run only to keep logs of two runs apart: the addresses exist only inside the run's namespace.
        return cls(f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}")

    @property
    def subnet(self) -> str:
        return f"{self.prefix}.0/24"

    @property
    def gateway(self) -> str:
        return f"{self.prefix}.1"


class Node(ControlPlane):
    """One node and its own control plane. `url`, `ca`, `kubeconfig`, `session()` and `bin_dir` (with kubectl) are
    those of ControlPlane, reached from this machine's loopback; `kubectl()` and `import_image()` are the node's."""

    def __init__(self, workdir: Path, bin_dir: Path, node_bin_dir: Path):
        super().__init__(workdir, bin_dir)
        self.node_bin_dir = node_bin_dir
        self.tag = secrets.token_hex(4)
        self.cgroup_name = f"grpo-node-{self.tag}"
        self.addresses = NodeAddresses.pick()
        self.holder: subprocess.Popen | None = None
        self.forwarder: subprocess.Popen | None = None
        self.containerd_socket = workdir / "containerd" / "containerd.sock"
        self.inside_kubeconfig = workdir / "admin-inside.kubeconfig"
        self.timings: dict[str, float] = {}
        self.report_lines: list[str] = []  # printed when the node stops (pytest shows no test's output on success)

    # --- processes ------------------------------------------------------------------------------------------
    def _enter(self) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--"]

    def _join_node_cgroup(self) -> None:
        """Runs in each child before exec: into the node's pids cgroup (so teardown finds all it starts), and dies
        with the test process."""
        (CGROUP_ROOT / "pids" / self.cgroup_name / "node" / "cgroup.procs").write_text("0")
        _die_with_parent()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        binary = self.node_bin_dir / name if (self.node_bin_dir / name).is_file() else self.bin_dir / name
        if not binary.is_file():
            binary = Path(shutil.which(name) or name)
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        process = subprocess.Popen([*self._enter(), str(binary), *args], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=self._join_node_cgroup)
        self.processes.append(process)
        return process

    def process_name(self, process: subprocess.Popen) -> str:
        return Path(process.args[process.args.index("--") + 1]).name

    def _check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                name = self.process_name(process)
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout} s")
            time.sleep(0.3)

    # --- start ----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> Node:
        began = time.monotonic()
        self._make_cgroups()
        self._start_namespaces()
        self._write_credentials()
        self._start_control_plane(timeout)
        self._start_containerd(timeout)
        self.import_image(self.node_bin_dir / "pause.tar")
        self.import_image(self.node_bin_dir / "testbox.tar")
        self._start_kubelet()
        self._start_services()
        self._wait("the node", self._node_ready, timeout)
        self._wait("the default ServiceAccount",
                   lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0, timeout)
        self.timings["start_s"] = time.monotonic() - began
        return self

    def _make_cgroups(self) -> None:
        """The node's cgroup root in every hierarchy (the kubelet requires it to exist), a cpuset that may hold
        tasks, and the pids cgroup every node process joins."""
        for hierarchy in self._hierarchies():
            (hierarchy / self.cgroup_name).mkdir()
            if (hierarchy / "cpuset.cpus").is_file():
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (hierarchy / self.cgroup_name / knob).write_text((hierarchy / knob).read_text())
        (CGROUP_ROOT / "pids" / self.cgroup_name / "node").mkdir()

    @staticmethod
    def _hierarchies() -> list[Path]:
        return [path for path in CGROUP_ROOT.iterdir()
                if path.is_dir() and not path.is_symlink() and (path / "cgroup.procs").is_file()]

    def _start_namespaces(self) -> None:
        gateway = self.addresses.gateway
        sysctls = self.workdir / "kernel-defaults"
        sysctls.mkdir()
        binds = []
        for name, value in KERNEL_DEFAULTS.items():
            (sysctls / name.replace("/", ".")).write_text(value + "\n")
            binds.append(f"mount --bind {sysctls / name.replace('/', '.')} /proc/sys/{name}")
        ready = self.workdir / "namespaces-ready"
        script = "\n".join([
            "set -e",
            "ip link set lo up",
            "ip link add grpo0 type bridge",
            f"ip addr add {gateway}/24 dev grpo0",
            "ip link set grpo0 up",
            "for dir in /run /var/log /var/lib; do mount -t tmpfs grpo-node \"$dir\"; done",
            "mkdir -p /run/containerd /var/log/containers /var/lib/cni",
            *binds,
            f"touch {ready}",
            "exec sleep infinity",
        ])
        with open(self.workdir / "namespaces.log", "wb") as log:
            self.holder = subprocess.Popen(
                ["unshare", "--net", "--mount", "--propagation", "private", "bash", "-c", script],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, preexec_fn=self._join_node_cgroup)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.holder.poll() is not None:
                raise RuntimeError(f"the node's namespaces: {(self.workdir / 'namespaces.log').read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the node's namespaces not made in 30 s")
            time.sleep(0.1)

    def _write_credentials(self) -> None:
        w = self.workdir
        make_serving_certificates(w, (f"IP:{self.addresses.gateway}", f"IP:{API_SERVICE_IP}", "DNS:kubernetes",
                                      "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                                      "DNS:kubernetes.default.svc.cluster.local"))
        # The API server's client certificate for the kubelet (logs, exec): system:masters, signed by the CA the
        # kubelet trusts.
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client",
                 "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr", cwd=w)
        _openssl("x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", "kubelet-client.crt", cwd=w)
        (w / "tokens.csv").write_text(
            f"{ADMIN_TOKEN},grpo-test-admin,1,system:masters\n"
            f"{KUBELET_TOKEN},system:node:{NODE_NAME},2,system:nodes\n"
            f"{SCHEDULER_TOKEN},system:kube-scheduler,3\n")

    def _inside_kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig for a process inside the node's namespace (the API server's own address there)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "node", "cluster": {"server": f"https://127.0.0.1:{API_PORT}",
                                                      "certificate-authority": str(self.ca)}}],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "node", "context": {"cluster": "node", "user": "user"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def _start_control_plane(self, timeout: float) -> None:
        w, gateway = self.workdir, self.addresses.gateway
        self._spawn("etcd", [f"--data-dir={w / 'etcd-data'}", "--listen-client-urls=http://127.0.0.1:2379",
                             "--listen-peer-urls=http://127.0.0.1:2380"])
        self._spawn("kube-apiserver", [
            "--etcd-servers=http://127.0.0.1:2379", "--bind-address=0.0.0.0", f"--advertise-address={gateway}",
            f"--secure-port={API_PORT}", f"--cert-dir={w}", f"--tls-cert-file={w / 'server.crt'}",
            f"--tls-private-key-file={w / 'server.key'}", f"--client-ca-file={w / 'ca.crt'}",
            f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=Node,RBAC", "--anonymous-auth=false",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=false", "--profiling=false",
            # The node has a name only the API server's own resolver does not know: reach it by its address.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={w / 'kubelet-client.crt'}",
            f"--kubelet-client-key={w / 'kubelet-client.key'}",
        ])
        assert self.holder is not None
        self.forwarder = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("netns_forward.py")), f"/proc/{self.holder.pid}/ns/net",
             "127.0.0.1", str(API_PORT)], stdout=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=_die_with_parent)
        self.url = f"https://127.0.0.1:{int(self.forwarder.stdout.readline())}"
        self._wait_ready(timeout)
        self.write_kubeconfig(self.kubeconfig, ADMIN_TOKEN)
        self._inside_kubeconfig(self.inside_kubeconfig, ADMIN_TOKEN)
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={self.inside_kubeconfig}", f"--controllers={CONTROLLERS}", "--leader-elect=false",
            "--secure-port=0", f"--root-ca-file={w / 'ca.crt'}", f"--service-account-private-key-file={w / 'sa.key'}",
            f"--cluster-cidr={self.addresses.subnet}"])
        scheduler = self._inside_kubeconfig(w / "scheduler.kubeconfig", SCHEDULER_TOKEN)
        self._spawn("kube-scheduler", [f"--kubeconfig={scheduler}", f"--authentication-kubeconfig={scheduler}",
                                       f"--authorization-kubeconfig={scheduler}", "--leader-elect=false",
                                       "--secure-port=0"])

    def _start_containerd(self, timeout: float) -> None:
        folder = self.workdir / "containerd"
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True)
        folder.mkdir()
        (cni / "net.d" / "10-grpo-node.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "grpo-node", "plugins": [{
                "type": "bridge", "bridge": "grpo0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                         # No default route: a pod reaches its subnet and the Service range, nothing else.
                         "routes": [{"dst": SERVICE_CIDR}],
                         "ranges": [[{"subnet": self.addresses.subnet, "rangeStart": f"{self.addresses.prefix}.10",
                                      "gateway": self.addresses.gateway}]]}}]}))
        (folder / "config.toml").write_text(f"""\
version = 2
root = "{folder / 'root'}"
state = "{folder / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni / 'net.d'}"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
      Root = "{folder / 'runc'}"
""")
        self._spawn("containerd", ["--config", str(folder / "config.toml")])
        self._wait("containerd", lambda: self._ctr("version", check=False).returncode == 0, timeout)

    def _ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def import_image(self, archive: Path | str) -> float:
        """Load an image archive (docker-archive or OCI) into the node's containerd: pods name it by its reference
        with `imagePullPolicy: Never` (nothing is pulled, there is no registry).

        Once unpacked, the layer blobs are removed, as the CRI's `discard_unpacked_layers` does for pulled images:
        containers start from the unpacked snapshots, and the blobs would hold a second copy of the image (7.5 GB
        for the trainer image) on a disk the node shares with this machine's other work. Returns the seconds it
        took."""
        began = time.monotonic()
        # The trainer image's 7.6 GB took 181-272 s on a loaded 2-core machine, and over 300 s beside a second test
        # worker running vLLM.
        done = self._ctr("image", "import", str(archive), timeout=IMPORT_TIMEOUT_S)
        references = _imported_references(done.stdout)
        if not references:
            raise RuntimeError(f"ctr image import {archive} unpacked no image: {done.stdout}{done.stderr}")
        for reference in references:
            self._discard_layers(reference)
        seconds = self.timings[f"import {Path(archive).name} s"] = time.monotonic() - began
        return seconds

    def _discard_layers(self, reference: str) -> None:
        listed = self._ctr("image", "ls", f"name=={reference}")
        digest = listed.stdout.splitlines()[1].split()[2]
        manifests = [json.loads(self._ctr("content", "get", digest).stdout)]
        if "manifests" in manifests[0]:  # an index: its manifests, each with its own layers
            manifests = [json.loads(self._ctr("content", "get", entry["digest"]).stdout)
                         for entry in manifests[0]["manifests"]]
        layers = {layer["digest"] for manifest in manifests for layer in manifest.get("layers", [])}
        if layers:
            self._ctr("content", "rm", *sorted(layers))

    def _start_kubelet(self) -> None:
        folder = self.workdir / "kubelet"
        folder.mkdir()
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # dnsPolicy: Default pods ask nobody
        gateway = self.addresses.gateway
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup_name}",
            "failCgroupV1": False, "failSwapOn": False,
            "protectKernelDefaults": True, "makeIPTablesUtilChains": False, "oomScoreAdj": 0,
            "address": gateway, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca)}},
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local", "clusterDNS": [gateway],
            "resolvConf": str(folder / "resolv.conf"),
            "podLogsDir": str(self.workdir / "pod-logs"),
            "volumePluginDir": str(folder / "volume-plugins"),
            # No disk-pressure eviction and no image garbage collection ("0%" turns a threshold off): under either
            # the kubelet removes every image no container runs, the sandbox image included, and here no registry
            # can give them back, so every later pod fails to start. The disk is this machine's, filled and freed
            # by other work; a full one fails the write that fills it, naming it.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "imagefs.available": "0%"},
            "evictionPressureTransitionPeriod": "10s",
            "maxPods": 30,
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        kubeconfig = self._inside_kubeconfig(folder / "kubeconfig", KUBELET_TOKEN)
        self._spawn("kubelet", [f"--config={folder / 'config.yaml'}", f"--kubeconfig={kubeconfig}",
                                f"--root-dir={folder / 'root'}", f"--cert-dir={folder / 'pki'}",
                                f"--hostname-override={NODE_NAME}", f"--node-ip={gateway}", "--v=1"])

    def _start_services(self) -> None:
        gateway = self.addresses.gateway
        corefile = self.workdir / "Corefile"
        corefile.write_text(f"""\
.:53 {{
    bind {gateway}
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.inside_kubeconfig} node
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
        self._spawn("coredns", ["-conf", str(corefile)])
        self._spawn("kube-proxy", [
            "--proxy-mode=nftables", f"--kubeconfig={self.inside_kubeconfig}", f"--hostname-override={NODE_NAME}",
            f"--cluster-cidr={self.addresses.subnet}", f"--nodeport-addresses={gateway}/32",
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", "--metrics-bind-address=127.0.0.1:10249",
            "--healthz-bind-address=127.0.0.1:10256"])

    def _node_ready(self) -> bool:
        done = self.kubectl("get", "node", NODE_NAME, "-o",
                            "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
        return done.stdout.strip() == "True"

    # --- use ------------------------------------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """kubectl as the admin, from this machine (through the forwarder)."""
        done = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
        return done

    def apply(self, *objects: dict, namespace: str | None = None) -> None:
        """`kubectl apply` of the objects (into `namespace` where they name none)."""
        self.kubectl("apply", *(["-n", namespace] if namespace else []), "-f", "-", stdin=yaml.safe_dump_all(objects))

    def create_namespace(self, name: str, labels: dict[str, str] | None = None, timeout: float = 60) -> str:
        """A namespace, once its "default" ServiceAccount exists (pods are refused before)."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
        self._wait(f"namespace {name}'s ServiceAccount",
                   lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
                   timeout)
        return name

    def pod(self, namespace: str, name: str) -> dict:
        return yaml.safe_load(self.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)

    def wait_for_pod(self, namespace: str, name: str, condition, what: str, timeout: float = 120) -> dict:
        """The pod once `condition(pod)` holds; on timeout, an error with its status and events."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.pod(namespace, name)
            if condition(pod):
                return pod
            if time.monotonic() > deadline:
                events = self.kubectl("get", "events", "-n", namespace, "--field-selector",
                                      f"involvedObject.name={name}", check=False).stdout
                raise AssertionError(f"pod {namespace}/{name} not {what} in {timeout} s: "
                                     f"{yaml.safe_dump(pod.get('status'))}\n{events}")
            time.sleep(0.5)

    def signal_container(self, container_id: str, signum: int) -> list[int]:
        """`signum` to every process of the container (`containerd://ID`), found by its pids cgroup; their PIDs."""
        found = list((CGROUP_ROOT / "pids" / self.cgroup_name).rglob(f"{container_id.removeprefix('containerd://')}"))
        assert found, f"no cgroup for container {container_id}"
        pids = [int(pid) for pid in (found[0] / "cgroup.procs").read_text().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def expose(self, port: int) -> str:
        """A server on this machine's loopback `port`, made reachable by the node's pods, which have no route out:
        a forwarder listening on the node's address inside its namespace, connecting to 127.0.0.1:`port` here.
        Returns the `HOST:PORT` pods connect to. It ends with the node."""
        assert self.holder is not None
        process = subprocess.Popen(
            ["nsenter", f"--target={self.holder.pid}", "--net", "--", sys.executable,
             str(Path(__file__).with_name("netns_forward.py")), f"/proc/{os.getpid()}/ns/net", "127.0.0.1", str(port),
             self.addresses.gateway],
            stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=self._join_node_cgroup)
        self.processes.append(process)
        return f"{self.addresses.gateway}:{int(process.stdout.readline())}"

    def report(self, line: str) -> None:
        """A line for the session's printout (what ran on the node: runtime, image IDs)."""
        self.report_lines.append(line)

    # --- stop -----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ends every process the node started, by pid, and removes its cgroups. The namespaces (the bridge, the
        pods' interfaces, kube-proxy's nft tables, every mount) go with their last process."""
        began = time.monotonic()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 5  # nothing of the node outlives it: no process needs a long goodbye
        for process in reversed(self.processes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        self._kill_cgroup_members()  # the shims and containers, and anything that ignored SIGTERM
        for process in [*self.processes, self.holder, self.forwarder]:
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
        self.processes.clear()
        self._remove_cgroups()
        # Unpacked images and pod volumes: the mounts went with the namespace, the bytes stay until removed.
        for folder in ("containerd", "kubelet"):
            shutil.rmtree(self.workdir / folder, ignore_errors=True)
        self.timings["stop_s"] = time.monotonic() - began

    def _kill_cgroup_members(self, timeout: float = 20) -> None:
        root = CGROUP_ROOT / "pids" / self.cgroup_name
        deadline = time.monotonic() + timeout
        while True:
            pids = [int(pid) for procs in root.rglob("cgroup.procs") for pid in procs.read_text().split()]
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def _remove_cgroups(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        for hierarchy in self._hierarchies():
            top = hierarchy / self.cgroup_name
            if not top.exists():
                continue
            for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                self._rmdir(folder, deadline)
            self._rmdir(top, deadline)

    @staticmethod
    def _rmdir(folder: Path, deadline: float) -> None:
        while True:
            try:
                folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
