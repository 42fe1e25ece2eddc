"""Two `grporun operator --leader-elect` processes on the real kube-apiserver, logged in as the chart's
ServiceAccount (its RBAC, its Lease in the release namespace): the leader is SIGKILLed mid-run, the standby takes
the Lease, finishes the run, and no pod is created twice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.controlplane.test_rbac import _lease_name
from tests.support.chart_render import RELEASE_NAMESPACE
from tests.support.controlplane.control_plane_cluster import RealCluster, context_factory
from tests.support.emulator.kube_emulator import GRPORUNS
from tests.support.emulator.operator_fixtures import learner  # noqa: F401  (fixture)
from tests.support.operator_process import OperatorProcess
from tests.support.specs import grporun, minimal_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


@pytest.fixture()
def cluster(control_plane, admin, operator_account, namespace) -> Iterator[RealCluster]:
    real = RealCluster(control_plane, admin, operator_account.token, namespace, context_factory({}))
    try:
        yield real
    finally:
        real.recorder.stop()


def _holder(cluster: RealCluster) -> str:
    response = cluster.client.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{_lease_name()}")
    lease = response.json() if response.status_code == 200 else {}
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def test_the_standby_takes_over_a_killed_operator_on_the_real_api_server(cluster, operator_account,
                                                                          learner):  # noqa: F811
    args = ("--all-namespaces", "--metrics-port", "0", "--reconcile-interval", "0.5", "--leader-elect",
            "--lease-namespace", RELEASE_NAMESPACE, f"--lease-name={_lease_name()}", "--lease-duration", "4",
            "--renew-deadline", "3", "--retry-period", "0.5")
    first = OperatorProcess("cp-a", operator_account.kubeconfig, *args)
    second = None
    try:
        cluster.wait_for(lambda: _holder(cluster).startswith("cp-a_"), timeout=30, what="cp-a to take the Lease")
        second = OperatorProcess("cp-b", operator_account.kubeconfig, *args)
        cluster.wait_for(lambda: "waiting to lead" in second.output(), timeout=30, what="cp-b to stand by")
        cluster.apply(grporun("ha", minimal_spec()))
        cluster.bring_up("ha")
        cluster.wait_phase("ha", "Running", timeout=30)
        # cp-a leads, unless it missed its 3 s renew deadline meanwhile (a starved machine) and cp-b took over: the
        # leader is killed, and the other one must take over either way.
        leader, standby = (first, "cp-b") if _holder(cluster).startswith("cp-a_") else (second, "cp-a")
        leader.kill()
        cluster.wait_for(lambda: _holder(cluster).startswith(f"{standby}_"), timeout=20,
                         what=f"{standby} to take the Lease")
        learner.update(phase="Succeeded", groups_consumed=40, groups_trained=40, epochs_done=1)
        cluster.kubelet.exit("ha-learner-0", 0, learner.report.termination_message())
        cluster.wait_phase("ha", "Succeeded", timeout=30)
        assert cluster.pods_ever_created("ha") == ["ha-learner-0", "ha-rollout-0"]
        # No leftover run for the next test's operator.
        cluster.client.delete(GRPORUNS, cluster.namespace, "ha")
        cluster.wait_for(lambda: not cluster.client.list(GRPORUNS, cluster.namespace), what="the run deleted")
    finally:
        if first.alive():
            first.kill()
        if second is not None:
            second.stop()
