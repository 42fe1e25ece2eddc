"""Pod networking for the process kubelet: one network namespace per pod, joined by a veth pair to a bridge.

Every pod gets its own address on a /24 (so two pods can both listen on :8000), the host gets .1 on the bridge (the
operator polls pods there) and pods reach each other over the bridge. Names resolve through a hosts file per pod:
`ip netns exec` bind-mounts /etc/netns/NAME/hosts over /etc/hosts, and it is rewritten in place (same inode, so a
running pod sees later entries) whenever a pod gets an address. The addresses exist only inside namespaces this
module makes, and it removes them all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why pods cannot get network namespaces here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"grpo-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class PodNetwork:
    """A bridge and a /24 of its own (picked from the process id, so two test runs on one machine do not meet)."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 4096:03x}"
        self.subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.bridge = f"gk{self.tag}br"
        self.host_ip = f"{self.subnet}.1"
        self.pods: dict[str, tuple[str, list[str]]] = {}  # netns -> (ip, host names)
        self._next = 2
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, names: list[str]) -> tuple[str, str]:
        """A namespace with an address for a pod known by `names`; returns (namespace, address)."""
        index, self._next = self._next, self._next + 1
        netns, host_if, pod_if = f"gk{self.tag}p{index}", f"gk{self.tag}h{index}", f"gk{self.tag}c{index}"
        address = f"{self.subnet}.{index}"
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        _ip("link", "set", pod_if, "netns", netns)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", pod_if)
        _ip("-n", netns, "link", "set", pod_if, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        self.pods[netns] = (address, names)
        self._write_hosts()
        return netns, address

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{ip} {' '.join(names)}" for ip, names in self.pods.values()]
        for netns in self.pods:
            folder = Path("/etc/netns") / netns
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "hosts", "w") as hosts:  # in place: a running pod's bind mount keeps the inode
                hosts.write("\n".join(lines) + "\n")

    def remove(self, netns: str) -> None:
        self.pods.pop(netns, None)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)  # takes its veth pair along
        shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)

    def close(self) -> None:
        for netns in list(self.pods):
            self.remove(netns)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
