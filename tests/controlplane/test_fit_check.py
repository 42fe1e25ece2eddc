"""The fit check in a cluster, on the real kube-apiserver: the operator, logged in as the chart's ServiceAccount (its
default values grant list on nodes), lists the nodes NVIDIA's GPU feature discovery labelled and matches each run's
nodeSelector against their labels. A 7B DDP learner on the pool of 80 GB H100s fails as InvalidSpec with the numbers
before any pod exists, though its nodeSelector names no GPU; the same run on the pool of H200s starts. An account
the list is forbidden to gets the reason at once (no retries that would hold the run's pass)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import kopf
import pytest
from kopf._cogs.clients import auth
from kopf._cogs.structs.credentials import Vault

from grpo_operator.cluster.fit_check import GpuNodes
from grpo_operator.cluster.kube import Kube
from grpo_operator.cluster.reconcile import OperatorContext
from tests.support.controlplane.control_plane_cluster import RealCluster, context_factory
from tests.support.emulator.kube_emulator import ResourceDef
from tests.support.servers.hub_server import QWEN25_7B
from tests.support.specs import grporun, minimal_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

NODES = ResourceDef("", "v1", "nodes", "Node", namespaced=False)


def gfd_node(name: str, product: str, memory_mib: int, pool: str) -> dict:
    """A node as NVIDIA's GPU feature discovery labels it. No kubelet runs it: the API server taints it
    node.kubernetes.io/not-ready, a condition the fit check looks past (grpo_operator.placement)."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/gpu.count": "8",
        "pool": pool}}}


@pytest.fixture()
def gpu_nodes(admin, namespace) -> Iterator[list[str]]:
    nodes = [gfd_node(f"{namespace}-h100-{i}", "NVIDIA-H100-80GB-HBM3", 81559, f"{namespace}-h100") for i in range(2)]
    nodes.append(gfd_node(f"{namespace}-h200", "NVIDIA-H200", 143771, f"{namespace}-h200"))
    nodes.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{namespace}-cpu", "labels": {
        "pool": f"{namespace}-h100"}}})  # no GPU labels: not listed
    for node in nodes:
        admin.create(NODES, None, node)
    yield [node["metadata"]["name"] for node in nodes]
    for node in nodes:
        admin.delete(NODES, None, node["metadata"]["name"])


@pytest.fixture()
def cluster(control_plane, admin, operator_account, namespace, progress_urls, gpu_nodes) -> Iterator[RealCluster]:
    plain = context_factory(progress_urls)

    def reading_gpu_nodes() -> OperatorContext:  # grporun operator --read-gpu-nodes, as the chart runs it
        context = plain()
        context.gpu_nodes = GpuNodes()
        return context

    real = RealCluster(control_plane, admin, operator_account.token, namespace, reading_gpu_nodes)
    real.start_operator()
    try:
        yield real
    finally:
        real.close()


def test_the_gpu_of_the_nodes_a_run_can_land_on_refuses_it_before_any_pod(cluster, tmp_path):
    (tmp_path / "qwen7b").mkdir()  # the operator reads config.json where its own filesystem has the model
    (tmp_path / "qwen7b" / "config.json").write_text(json.dumps(QWEN25_7B))
    model, pool = str(tmp_path / "qwen7b"), f"{cluster.namespace}-h100"
    cluster.apply(grporun("on-h100", minimal_spec(model=model, learner={
        "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"pool": pool}})))
    cluster.wait_phase("on-h100", "Failed")
    failed = cluster.condition("on-h100", "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert failed["message"].startswith("spec.learner: the learner needs ~122 GiB per GPU under ddp (7.6B parameters: "
                                        "113 GiB fp32 weights, gradients and Adam states + 7.9 GiB activations"), failed
    assert ("more than the 80 GiB of its GPU (nvidia.com/gpu.memory=81559 on the 2 nodes it can land on); ways out, "
            "each estimated the same way: learner.strategy fsdp2 over 2 GPUs") in failed["message"], failed
    assert cluster.pods_ever_created("on-h100") == []

    cluster.apply(grporun("on-h200", minimal_spec(model=model, learner={
        "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"pool": f"{cluster.namespace}-h200"}})))
    cluster.wait_for(lambda: cluster.pods("on-h200", "learner"), what="the run on the H200 pool starting")
    assert cluster.run("on-h200")["status"].get("phase") != "Failed"


def read_nodes_as(control_plane, token: str):
    """GpuNodes.read through grpo_operator's Kube, logged in with `token` as kopf logs in."""
    async def read():
        vault = Vault({"account": kopf.ConnectionInfo(server=control_plane.url, token=token,
                                                      ca_path=str(control_plane.ca))})
        auth.vault_var.set(vault)
        try:
            return await GpuNodes().read(Kube(kopf.OperatorSettings(), logging.getLogger("test.fit_check")))
        finally:
            await vault.close()

    return asyncio.run(read())


@pytest.mark.timeout(60)  # kopf's own retries of a 403 would take about a minute
def test_the_gpu_nodes_are_listed_by_their_label_and_a_forbidden_list_is_a_reason(control_plane, admin,
                                                                                   operator_account, namespace,
                                                                                   gpu_nodes):
    nodes, why = read_nodes_as(control_plane, operator_account.token)
    assert why == ""
    mine = {node.name: node for node in nodes if node.name.startswith(f"{namespace}-")}
    assert sorted(mine) == sorted(gpu_nodes[:3])  # the node without GPU labels is not listed
    assert mine[f"{namespace}-h200"].labels["nvidia.com/gpu.memory"] == "143771"
    nodes, why = read_nodes_as(control_plane, admin.service_account_token(namespace, "default"))
    assert nodes is None
    user = f"system:serviceaccount:{namespace}:default"
    assert why == (f'cannot list nodes (HTTP 403): nodes is forbidden: User "{user}" cannot list resource "nodes" in '
                   'API group "" at the cluster scope'), why
