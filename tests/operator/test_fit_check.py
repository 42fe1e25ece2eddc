"""The operator's side of the fit check (grpo_operator.cluster.fit_check): what it reads before a run starts and how
often. The real API server's answers are tests/controlplane/test_fit_check.py's."""

from __future__ import annotations

import asyncio
import json

from grpo_operator.api import parse_spec
from grpo_operator.cluster.fit_check import (
    CONFIG_TTL_SECONDS,
    NODES_TTL_SECONDS,
    GpuNodes,
    ModelConfigs,
    check_run,
)
from grpo_operator.cluster.kube import APIClientError
from grpo_operator.model_config import HubAccess
from tests.support.servers.hub_server import QWEN25_7B
from tests.support.specs import minimal_spec

H100_NODE = {"metadata": {"name": "h100-0", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                       "nvidia.com/gpu.memory": "81559"}},
             "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}
FORBIDDEN = APIClientError({"message": "nodes is forbidden"}, status=403, headers={})
ONE_GPU = {"resources": {"limits": {"nvidia.com/gpu": 1}},
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


class NodeLists:
    """The one call GpuNodes makes of grpo_operator.cluster.kube.Kube, counted; `error` makes it fail."""

    def __init__(self, items: list[dict], error: Exception | None = None):
        self.items, self.error, self.calls = items, error, []

    async def list(self, api_version, kind, namespace, *, label_selector, timeout):
        self.calls.append((api_version, kind, namespace, label_selector))
        if self.error is not None:
            raise self.error
        return self.items


def test_the_gpu_nodes_are_listed_by_their_gfd_label_and_kept_for_a_minute():
    now = [0.0]
    nodes, kube = GpuNodes(clock=lambda: now[0]), NodeLists([H100_NODE])

    async def read_at(seconds: float):
        now[0] = seconds
        return await nodes.read(kube)

    (node,), why = asyncio.run(read_at(0.0))
    assert why == "" and node.labels["nvidia.com/gpu.memory"] == "81559" and node.taints[0]["key"] == "nvidia.com/gpu"
    asyncio.run(read_at(NODES_TTL_SECONDS - 1))
    assert kube.calls == [("v1", "Node", None, "nvidia.com/gpu.product")]
    asyncio.run(read_at(NODES_TTL_SECONDS))
    assert len(kube.calls) == 2
    refused = GpuNodes()
    assert asyncio.run(refused.read(NodeLists([], FORBIDDEN))) == (
        None, "cannot list nodes (HTTP 403): nodes is forbidden")


def check(spec: dict, kube: NodeLists, gpu_nodes: GpuNodes | None):
    return asyncio.run(check_run(parse_spec(spec), kube, ModelConfigs(), gpu_nodes))


def test_the_operator_checks_a_model_its_filesystem_has_against_the_nodes_gpu(tmp_path):
    (tmp_path / "qwen7b").mkdir()
    (tmp_path / "qwen7b" / "config.json").write_text(json.dumps(QWEN25_7B))
    spec = minimal_spec(model=str(tmp_path / "qwen7b"), learner=ONE_GPU)
    checked = check(spec, NodeLists([H100_NODE]), GpuNodes())
    assert checked.skipped == []
    assert "more than the 80 GiB of its GPU (nvidia.com/gpu.memory=81559 on the 1 node it can land on)" in (
        checked.report.errors[0])
    # Without the nodes, the GPU is not known: a warning.
    unread = check(spec, NodeLists([], FORBIDDEN), GpuNodes())
    assert unread.report.errors == [] and "its GPU is not known" in unread.report.warnings[0]
    assert unread.skipped == ["the GPU nodes' labels: cannot list nodes (HTTP 403): nodes is forbidden"]
    not_read = check(spec, NodeLists([H100_NODE]), None)  # the operator was not told to read them
    assert not_read.skipped == [] and not_read.report.errors == []


def test_what_the_operator_cannot_read_is_skipped_with_why_and_a_cpu_run_is_not_checked(tmp_path):
    kube = NodeLists([H100_NODE])
    for model, why in [("/models/tiny", "spec.model /models/tiny: no such directory here"),
                       ("s3://models/qwen", "spec.model s3://models/qwen is in an object store; its config.json is "
                                            "read from a local path or the hub")]:
        checked = check(minimal_spec(model=model, learner=ONE_GPU), kube, GpuNodes())
        assert checked.skipped == [why] and checked.report.errors == checked.report.notes == []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    checked = check(minimal_spec(model=str(tmp_path / "m")), kube, GpuNodes())
    assert checked.skipped == [f"spec.model {tmp_path / 'm'}: config.json has no hidden_size"]
    cpu = minimal_spec(model=str(tmp_path / "m"), learner={"device": "cpu"},
                       rollout={"device": "cpu", "weightSync": {"mode": "filesystem"}})
    assert check(cpu, kube, GpuNodes()).skipped == []
    assert kube.calls == []  # nothing was worth the nodes


def test_a_models_config_is_read_once_a_minute_for_the_runs_created_together(hub):
    now = [0.0]
    configs = ModelConfigs(clock=lambda: now[0], hub=HubAccess(endpoint=hub.url))

    async def together(count: int):
        return await asyncio.gather(*(configs.read("Qwen/Qwen2.5-7B") for _ in range(count)))

    assert asyncio.run(together(5)) == [(QWEN25_7B, "")] * 5
    gets = [path for method, path, _ in hub.requests if method == "GET"]
    assert gets == ["/Qwen/Qwen2.5-7B/resolve/main/config.json"]
    now[0] = CONFIG_TTL_SECONDS
    asyncio.run(together(1))
    assert len([method for method, _, _ in hub.requests if method == "GET"]) == 2
