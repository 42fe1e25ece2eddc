"""Two `grporun operator --leader-elect` replicas against one API: one acts, the other waits; the active one is
SIGKILLed mid-run, the standby takes the Lease, resumes the run and finishes it, and no child is created twice."""

from __future__ import annotations

import collections

import pytest
import requests

from grpo_operator.cluster.leader import LeaseTimings
from tests.support.emulator.kube_emulator import CONFIGMAPS, LEASES, PODS, SERVICES
from tests.support.emulator.operator_fixtures import cluster, learner  # noqa: F401  (fixtures)
from tests.support.operator_process import OperatorProcess, write_kubeconfig
from tests.support.ports import free_port
from tests.support.specs import NAMESPACE, grporun, minimal_spec

#: The operator's own election timings (what the chart runs): a leader renews every 2 s and gives up after 10 s
#: without a renewal, so a loaded machine's pauses do not cost it the Lease; the standby takes over a killed leader
#: once the Lease has gone unrenewed for its 15 s.
TIMINGS = LeaseTimings()
ELECTION = ("--leader-elect", "--lease-namespace", NAMESPACE)


def _args(liveness_port: int) -> tuple[str, ...]:
    return ("--namespace", NAMESPACE, "--metrics-port", "0", "--reconcile-interval", "0.2",
            "--liveness-port", str(liveness_port), *ELECTION)


def _healthz(port: int) -> dict | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
    except requests.ConnectionError:
        return None


def _holder(cluster) -> str:  # noqa: F811
    lease = cluster.client.get(LEASES, NAMESPACE, "grpo-operator") or {}
    return (lease.get("spec") or {}).get("holderIdentity") or ""


@pytest.mark.slow
def test_the_standby_takes_over_a_killed_operator_and_finishes_the_run_without_double_creates(
        cluster, learner, tmp_path):  # noqa: F811
    cluster.stop_operator()  # the fixture's in-process operator: this test runs two real ones instead
    url = cluster.emulator_thread.url
    a_port, b_port = free_port(), free_port()
    active = OperatorProcess("op-a", write_kubeconfig(tmp_path, url, token="op-a"), *_args(a_port))
    standby = None
    try:
        cluster.wait_for(lambda: _holder(cluster).startswith("op-a_"), timeout=60, what="op-a to take the Lease")
        standby = OperatorProcess("op-b", write_kubeconfig(tmp_path, url, token="op-b"), *_args(b_port))
        cluster.wait_for(lambda: "waiting to lead" in standby.output(), timeout=60, what="op-b to wait for the Lease")
        # The standby answers its liveness probe (the kubelet would restart it otherwise); the leader, through kopf.
        assert cluster.wait_for(lambda: _healthz(b_port), what="op-b's /healthz") == {"standby": True}
        assert "runs" in cluster.wait_for(lambda: _healthz(a_port), what="op-a's /healthz")

        cluster.apply(grporun("ha", minimal_spec()))
        cluster.bring_up("ha")
        cluster.wait_phase("ha", "Running", timeout=30)
        assert _holder(cluster).startswith("op-a_"), "the standby took the Lease from a live leader"
        # While op-a leads, op-b reads the Lease and nothing else (past its start-up check for the CRD): no watch,
        # no write, no look at a run.
        standby_calls = {(r.verb, r.rbac_resource) for r in list(cluster.emulator.request_log) if r.token == "op-b"}
        assert ("get", "leases") in standby_calls, standby_calls
        assert standby_calls <= {("get", "leases"), ("list", "customresourcedefinitions")}, standby_calls

        active.kill()
        cluster.wait_for(lambda: _holder(cluster).startswith("op-b_"), timeout=TIMINGS.lease_duration + 30,
                         what="op-b to take the Lease")
        assert standby.alive()
        # Now kopf answers op-b's probe on the same port.
        cluster.wait_for(lambda: "runs" in (_healthz(b_port) or {}), what="op-b's kopf /healthz")

        learner.update(phase="Succeeded", groups_consumed=40, groups_trained=40, epochs_done=1)
        cluster.kubelet.exit("ha-learner-0", 0, learner.report.termination_message())
        cluster.wait_phase("ha", "Succeeded", timeout=60)
    finally:
        active.kill() if active.alive() else None
        outputs = {"op-a": active.output(), "op-b": standby.output() if standby else ""}
        if standby is not None:
            standby.stop()

    # Every object the API server stored, counted by name: a double create would be a second ADDED.
    history = {rdef.plural: cluster.emulator_thread.call(lambda r=rdef: cluster.emulator.history(r))
               for rdef in (PODS, SERVICES, CONFIGMAPS)}
    created = collections.Counter((plural, name) for plural, events in history.items()
                                  for kind, name, _ in events if kind == "ADDED")
    assert created == {("pods", "ha-learner-0"): 1, ("pods", "ha-rollout-0"): 1, ("services", "ha-learner"): 1,
                       ("services", "ha-rollout"): 1, ("configmaps", "ha-config"): 1}, created
    assert "leading" in outputs["op-b"] and "Traceback" not in outputs["op-b"]
