"""Pods on the real node, from the user's side (kubectl): containers under containerd, the kubelet's probes, cgroup
limits, logs and exec, and Service names through CoreDNS. The image is testbox (hack/node/images), built with the
node's binaries."""

from __future__ import annotations

import itertools

import pytest

from tests.support.node.node import TESTBOX_IMAGE, Node

pytestmark = pytest.mark.node

_names = itertools.count()


@pytest.fixture()
def pod_namespace(node: Node) -> str:
    name = node.create_namespace(f"node-{next(_names)}")
    yield name
    node.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod(name: str, *containers: dict, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, **spec,
                     "containers": list(containers)}}


def container(name: str, *args: str, **fields) -> dict:
    return {"name": name, "image": TESTBOX_IMAGE, "imagePullPolicy": "Never", "args": list(args), **fields}


def phase(wanted: str):
    return lambda p: p.get("status", {}).get("phase") == wanted


def ready(p: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))


def restarts(p: dict) -> int:
    return sum(c["restartCount"] for c in p.get("status", {}).get("containerStatuses", []))


def test_a_pod_runs_to_succeeded_as_a_container(node: Node, pod_namespace: str):
    node.apply(pod("hello", container("app", "hello", "greetings")), namespace=pod_namespace)
    done = node.wait_for_pod(pod_namespace, "hello", phase("Succeeded"), "Succeeded")
    status = done["status"]["containerStatuses"][0]
    node.report(f"pod hello ran as {status['containerID']}, image {status['image']}, imageID {status['imageID']}")
    assert status["containerID"].startswith("containerd://")
    assert status["imageID"].startswith("sha256:") or "@sha256:" in status["imageID"]
    assert status["state"]["terminated"]["exitCode"] == 0
    assert node.kubectl("logs", "hello", "-n", pod_namespace).stdout == "greetings from hello\n"


def test_logs_and_exec_reach_a_running_container(node: Node, pod_namespace: str):
    node.apply(pod("sleeper", container("app", "sleep", "0")), namespace=pod_namespace)
    node.wait_for_pod(pod_namespace, "sleeper", ready, "Ready")
    hostname = node.kubectl("exec", "sleeper", "-n", pod_namespace, "--", "/testbox", "cat", "/etc/hostname").stdout
    assert hostname.strip() == "sleeper"
    failed = node.kubectl("exec", "sleeper", "-n", pod_namespace, "--", "/testbox", "cat", "/nowhere", check=False)
    assert failed.returncode == 1 and "no such file" in failed.stderr


def test_a_pod_has_no_route_out_of_the_node(node: Node, pod_namespace: str):
    node.apply(pod("routes", container("app", "sleep", "0")), namespace=pod_namespace)
    node.wait_for_pod(pod_namespace, "routes", ready, "Ready")
    table = node.kubectl("exec", "routes", "-n", pod_namespace, "--", "/testbox", "cat", "/proc/net/route").stdout
    destinations = [line.split()[1] for line in table.splitlines()[1:]]
    assert destinations and "00000000" not in destinations, table  # no default route


def test_an_exec_liveness_probe_restarts_the_container(node: Node, pod_namespace: str):
    probe = {"exec": {"command": ["/testbox", "cat", "/tmp/healthy"]}, "initialDelaySeconds": 4,
             "periodSeconds": 1, "failureThreshold": 1}
    live = pod("live", container("app", "sleep", "0", livenessProbe=probe), restartPolicy="Always")
    node.apply(live, namespace=pod_namespace)
    node.wait_for_pod(pod_namespace, "live", phase("Running"), "Running")
    node.kubectl("exec", "live", "-n", pod_namespace, "--", "/testbox", "touch", "/tmp/healthy")
    node.kubectl("exec", "live", "-n", pod_namespace, "--", "/testbox", "rm", "/tmp/healthy")
    restarted = node.wait_for_pod(pod_namespace, "live", lambda p: restarts(p) >= 1, "restarted by its liveness probe")
    assert restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]
    events = node.kubectl("get", "events", "-n", pod_namespace, "--field-selector", "involvedObject.name=live").stdout
    assert "Liveness probe failed" in events


def test_pods_reach_each_other_by_headless_service_name(node: Node, pod_namespace: str):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"clusterIP": "None", "selector": {"app": "server"}, "publishNotReadyAddresses": True,
                        "ports": [{"name": "http", "port": 8080}]}}
    server = pod("server", container("app", "serve", "8080"), hostname="server-0", subdomain="web")
    server["metadata"]["labels"] = {"app": "server"}
    node.apply(service, server, namespace=pod_namespace)
    node.wait_for_pod(pod_namespace, "server", ready, "Ready")
    by_pod_name = f"http://server-0.web.{pod_namespace}.svc.cluster.local:8080/"
    client = pod("client", container("by-pod-name", "get", by_pod_name, "30"),
                 container("by-service-name", "get", "http://web:8080/", "30"))
    node.apply(client, namespace=pod_namespace)
    node.wait_for_pod(pod_namespace, "client", phase("Succeeded"), "Succeeded")
    for name in ("by-pod-name", "by-service-name"):
        assert node.kubectl("logs", "client", "-c", name, "-n", pod_namespace).stdout.strip() == "server-0"


def test_a_memory_limit_is_enforced(node: Node, pod_namespace: str):
    limits = {"memory": "64Mi", "cpu": "100m"}
    hog = pod("hog", container("app", "alloc", "256", resources={"requests": limits, "limits": limits}))
    node.apply(hog, namespace=pod_namespace)
    done = node.wait_for_pod(pod_namespace, "hog", phase("Failed"), "Failed")
    assert done["status"]["qosClass"] == "Guaranteed"
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled", terminated
