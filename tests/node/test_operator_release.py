"""The chart installed with helm on the real node: the operator image runs as the chart's Deployment, becomes Ready
(its liveness and readiness probes pass under the kubelet), and takes its leader-election Lease."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.chart_render import RELEASE
from tests.support.node.operator_release import OperatorRelease

pytestmark = pytest.mark.node


def lease_holder(node, namespace: str, name: str) -> str | None:
    got = node.kubectl("get", "lease", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(got.stdout)["spec"].get("holderIdentity") if got.returncode == 0 else None


def test_helm_install_runs_the_operator_image_and_it_takes_its_lease(operator_release: OperatorRelease):
    node, namespace = operator_release.node, operator_release.namespace
    deployment = json.loads(node.kubectl("get", "deployment", "-n", namespace, "-l",
                                         f"app.kubernetes.io/instance={RELEASE}", "-o", "json").stdout)["items"]
    assert len(deployment) == 1 and deployment[0]["status"].get("readyReplicas") == 1, deployment
    [pod] = operator_release.operator_pods()
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["containerID"].startswith("containerd://")
    assert status["image"] == operator_release.image.reference
    assert pod["spec"]["serviceAccountName"] == deployment[0]["spec"]["template"]["spec"]["serviceAccountName"]
    node.report(f"operator pod {pod['metadata']['name']} ran as {status['containerID']}, imageID {status['imageID']}")
    lease_name = next(arg.split("=", 1)[1] for arg in pod["spec"]["containers"][0]["args"]
                      if arg.startswith("--lease-name="))
    deadline = time.monotonic() + 120
    while (holder := lease_holder(node, namespace, lease_name)) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert holder is not None and holder.startswith(pod["metadata"]["name"]), (holder, node.kubectl(
        "logs", "-n", namespace, pod["metadata"]["name"], check=False).stdout[-3000:])
