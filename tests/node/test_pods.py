"""Pods on the real node, from the user's side (kubectl): containers under containerd, the kubelet's probes, cgroup
limits, logs and exec, and Service names through CoreDNS. The image is testbox (hack/node/images), built with the
node's binaries."""

from __future__ import annotations

import itertools

import pytest

from tests.support.node import TESTBOX_IMAGE, Node

pytestmark = pytest.mark.node

_names = itertools.count()


@pytest.fixture()
def namespace(node: Node) -> str:
    name = node.create_namespace(f"node-{next(_names)}")
    yield name
    node.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod(name: str, *containers: dict, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, **spec,
                     "containers": list(containers)}}


def testbox(name: str, *args: str, **fields) -> dict:
    return {"name": name, "image": TESTBOX_IMAGE, "imagePullPolicy": "Never", "args": list(args), **fields}


def phase(wanted: str):
    return lambda p: p.get("status", {}).get("phase") == wanted


def ready(p: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))


def test_a_pod_runs_to_succeeded_as_a_container(node: Node, namespace: str):
    node.apply(pod("hello", testbox("app", "hello", "greetings")), namespace=namespace)
    done = node.wait_for_pod(namespace, "hello", phase("Succeeded"), "Succeeded")
    status = done["status"]["containerStatuses"][0]
    print(f"hello: containerID {status['containerID']} image {status['image']} imageID {status['imageID']}")
    assert status["containerID"].startswith("containerd://")
    assert status["imageID"].startswith("sha256:") or "@sha256:" in status["imageID"]
    assert status["state"]["terminated"]["exitCode"] == 0
    assert node.kubectl("logs", "hello", "-n", namespace).stdout == "greetings from hello\n"


def test_logs_and_exec_reach_a_running_container(node: Node, namespace: str):
    node.apply(pod("sleeper", testbox("app", "sleep", "0")), namespace=namespace)
    node.wait_for_pod(namespace, "sleeper", ready, "Ready")
    hostname = node.kubectl("exec", "sleeper", "-n", namespace, "--", "/testbox", "cat", "/etc/hostname").stdout
    assert hostname.strip() == "sleeper"
    failed = node.kubectl("exec", "sleeper", "-n", namespace, "--", "/testbox", "cat", "/nowhere", check=False)
    assert failed.returncode == 1 and "no such file" in failed.stderr


def test_a_pod_has_no_route_out_of_the_node(node: Node, namespace: str):
    node.apply(pod("routes", testbox("app", "sleep", "0")), namespace=namespace)
    node.wait_for_pod(namespace, "routes", ready, "Ready")
    table = node.kubectl("exec", "routes", "-n", namespace, "--", "/testbox", "cat", "/proc/net/route").stdout
    destinations = [line.split()[1] for line in table.splitlines()[1:]]
    assert destinations and "00000000" not in destinations, table  # no default route


def test_an_exec_liveness_probe_restarts_the_container(node: Node, namespace: str):
    probe = {"exec": {"command": ["/testbox", "cat", "/tmp/healthy"]}, "initialDelaySeconds": 4,
             "periodSeconds": 1, "failureThreshold": 1}
    live = pod("live", testbox("app", "sleep", "0", livenessProbe=probe), restartPolicy="Always")
    node.apply(live, namespace=namespace)
    node.wait_for_pod(namespace, "live", phase("Running"), "Running")
    node.kubectl("exec", "live", "-n", namespace, "--", "/testbox", "touch", "/tmp/healthy")
    node.kubectl("exec", "live", "-n", namespace, "--", "/testbox", "rm", "/tmp/healthy")
    restarted = node.wait_for_pod(namespace, "live", lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 1,
                                  "restarted by its liveness probe")
    assert restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]
    events = node.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=live").stdout
    assert "Liveness probe failed" in events


def test_pods_reach_each_other_by_headless_service_name(node: Node, namespace: str):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"clusterIP": "None", "selector": {"app": "server"}, "publishNotReadyAddresses": True,
                        "ports": [{"name": "http", "port": 8080}]}}
    server = pod("server", testbox("app", "serve", "8080"), hostname="server-0", subdomain="web")
    server["metadata"]["labels"] = {"app": "server"}
    node.apply(service, server, namespace=namespace)
    node.wait_for_pod(namespace, "server", ready, "Ready")
    by_pod_name = f"http://server-0.web.{namespace}.svc.cluster.local:8080/"
    client = pod("client", testbox("by-pod-name", "get", by_pod_name, "30"),
                 testbox("by-service-name", "get", "http://web:8080/", "30"))
    node.apply(client, namespace=namespace)
    node.wait_for_pod(namespace, "client", phase("Succeeded"), "Succeeded")
    for container in ("by-pod-name", "by-service-name"):
        assert node.kubectl("logs", "client", "-c", container, "-n", namespace).stdout.strip() == "server"


def test_a_memory_limit_is_enforced(node: Node, namespace: str):
    limits = {"memory": "64Mi", "cpu": "100m"}
    hog = pod("hog", testbox("app", "alloc", "256", resources={"requests": limits, "limits": limits}))
    node.apply(hog, namespace=namespace)
    done = node.wait_for_pod(namespace, "hog", phase("Failed"), "Failed")
    assert done["status"]["qosClass"] == "Guaranteed"
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled", terminated
