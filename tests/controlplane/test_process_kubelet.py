"""The process kubelet (tests/support/process_kubelet.py) on the real control plane: what it promises the operator."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from tests.support.kube_emulator import CONFIGMAPS, PODS
from tests.support.pod_network import unavailable_reason
from tests.support.process_kubelet import ProcessKubelet

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

SERVER = """
import http.server, os, signal, sys
def stop(*_):
    open('/dev/termination-log', 'w').write('stopped by SIGTERM')
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (os.environ['POD'] + ' ' + open('/etc/greeting/text').read()).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
http.server.HTTPServer(('0.0.0.0', 8000), Hello).serve_forever()
"""


@pytest.fixture()
def kubelet(admin, namespace, tmp_path) -> Iterator[ProcessKubelet]:
    why = unavailable_reason()
    if why:
        pytest.skip(f"the process kubelet needs network namespaces: {why}")
    running = ProcessKubelet(admin, namespace, tmp_path, node=f"node-{namespace}").start()
    yield running
    running.stop()
    assert running.errors == []


def _pod(name: str, code: str, **container: object) -> dict:
    env = [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "hostname": name, "subdomain": "hello",
                     "automountServiceAccountToken": False,  # as the operator's pods: no projected token volume
                     "containers": [{"name": "main", "image": "none", "command": ["python", "-c", code], "env": env,
                                     "volumeMounts": [{"name": "greeting", "mountPath": "/etc/greeting"}],
                                     **container}],
                     "volumes": [{"name": "greeting", "configMap": {"name": "greeting"}}]}}


def _wait(predicate, timeout: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def test_two_pods_listen_on_the_same_port_at_their_own_addresses_and_stop_on_deletion(admin, namespace, kubelet):
    admin.create(CONFIGMAPS, namespace, {"metadata": {"name": "greeting"}, "data": {"text": "hi"}})
    for name in ("one", "two"):
        admin.create(PODS, namespace, _pod(name, SERVER, readinessProbe={"httpGet": {"path": "/", "port": 8000}}))
    ready = {}
    for name in ("one", "two"):
        ready[name] = _wait(lambda n=name: (p := admin.get(PODS, namespace, n)) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])) and p,
            what=f"{name} ready")
    ips = {name: pod["status"]["podIP"] for name, pod in ready.items()}
    assert len(set(ips.values())) == 2
    for name, ip in ips.items():
        assert requests.get(f"http://{ip}:8000/", timeout=5).text == f"{name} hi"
        assert ready[name]["spec"]["nodeName"] == kubelet.node
    admin.delete(PODS, namespace, "one")
    _wait(lambda: admin.get(PODS, namespace, "one") is None, what="one deleted")
    assert "stopped by SIGTERM" in (next(kubelet.workdir.glob("one-*")) / "termination-log").read_text()


def test_exit_code_and_termination_message_reach_pod_status(admin, namespace, kubelet):
    admin.create(CONFIGMAPS, namespace, {"metadata": {"name": "greeting"}, "data": {"text": "bye"}})
    code = "import sys; open('/dev/termination-log', 'w').write(open('/etc/greeting/text').read()); sys.exit(42)"
    admin.create(PODS, namespace, _pod("quits", code))
    crash = "import sys; print('Traceback: boom'); sys.exit(3)"
    admin.create(PODS, namespace, _pod("crashes", crash, terminationMessagePolicy="FallbackToLogsOnError"))
    for name, exit_code, message in (("quits", 42, "bye"), ("crashes", 3, "Traceback: boom")):
        pod = _wait(lambda n=name: (p := admin.get(PODS, namespace, n)) and p["status"].get("phase") == "Failed" and p,
                    what=f"{name} failed")
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == exit_code and terminated["message"] == message
