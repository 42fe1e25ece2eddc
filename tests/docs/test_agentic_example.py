"""docs/agentic.md's environment server: its command and args, run as a pod runs them, serve on the pod's address
(a kubelet's readiness probe connects there, never to loopback), and the example runs several replicas of the
stateful game (the learner's client pins each episode to the server its reset reached). Its OpenEnv example is the
shipped example's (examples/tiny-agentic-openenv.yaml, which tests/operator/cli/test_local_agentic.py runs)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
import yaml

from grpo_operator.api import EnvironmentSpec
from grpo_operator.local.plan import expand_references
from tests.support.paths import REPO

AGENTIC_DOC = REPO / "docs" / "agentic.md"


def environment_examples() -> list[dict]:
    """The `spec` of each of docs/agentic.md's YAML blocks that shows spec.environments."""
    blocks = re.findall(r"```yaml\n(.*?)```", AGENTIC_DOC.read_text(), flags=re.S)
    return [doc["spec"] for doc in map(yaml.safe_load, blocks)
            if isinstance(doc, dict) and "environments" in doc.get("spec", {})]


def environment_example() -> EnvironmentSpec:
    """The reference example: every field of an environment (its podTemplateOverride a placeholder)."""
    found = [spec["environments"] for spec in environment_examples()
             if any("podTemplateOverride" in entry for entry in spec["environments"])]
    assert len(found) == 1, "docs/agentic.md shows one reference spec.environments example"
    (entry,) = found[0]
    entry.pop("podTemplateOverride")  # a placeholder ({...}): as spec.rollout's, documented there
    return EnvironmentSpec.model_validate(entry)


def pod_address() -> str | None:
    """This machine's address on its network (as a pod's IP is), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def test_the_example_server_listens_on_the_pods_address_and_runs_several_replicas():
    environment = environment_example()
    assert environment.replicas == 2
    address = pod_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback to connect to")
    port = str(free_port())
    argv = [expand_references(word, {"PORT": port}) for word in [*environment.command, *environment.args]]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert "serving on" in server.stdout.readline()  # it prints this once it listens
        with socket.create_connection((address, int(port)), timeout=10):
            pass  # what the default readiness probe does: a TCP connect to the pod's IP and port
    finally:
        server.kill()
        server.wait()


def test_the_openenv_example_is_the_shipped_runs():
    (shown,) = [spec for spec in environment_examples()
                if any(entry.get("protocol") == "openenv" for entry in spec["environments"])]
    shipped = yaml.safe_load((REPO / "examples" / "tiny-agentic-openenv.yaml").read_text())["spec"]
    assert shown["environments"] == shipped["environments"]
    assert "environmentFactory" not in shipped["training"] and "environmentFactories" not in shipped["training"]
    assert shown["training"]["maxToolCallingIterations"] == shipped["training"]["maxToolCallingIterations"]
