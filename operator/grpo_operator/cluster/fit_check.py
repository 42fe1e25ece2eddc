"""The fit check in a cluster, before a run's first pods start: the model's config.json (a path on the operator's own
filesystem, or fetched from the hub), the cluster's GPU nodes, the verdict of grpo_operator.fit (I/O).

The GPU nodes are those NVIDIA's GPU feature discovery labels (`nvidia.com/gpu.product`, with `nvidia.com/gpu.memory`
in MiB), listed by that label, only when the operator was told it may (`grporun operator --read-gpu-nodes`, the
chart's `fitCheck.readNodes`, which grants list on nodes), and kept for a minute: runs created together share one
list. The hub is asked with the operator's own token (its HF_TOKEN, if it has one): the operator may not read the
run's Secrets, so a gated model without one is skipped, and said so. What the hub answered for a model is kept for a
minute too: runs of one model created together ask once, and a hub that does not answer costs its timeout once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from .. import fit
from ..api import GRPORunSpec
from ..model_config import ConfigRead, HubAccess, read_model_config
from ..placement import Node
from .kube import APIClientError, Kube

#: How long one list of the GPU nodes, or one answer of the hub for a model, serves the runs checked after it.
NODES_TTL_SECONDS = CONFIG_TTL_SECONDS = 60.0
#: The list's own limit: a slow API server skips the nodes, it does not hold the run's pass.
NODES_TIMEOUT_SECONDS = 10.0


def node_of(obj: dict) -> Node:
    metadata = obj.get("metadata") or {}
    return Node(name=metadata.get("name", ""), labels=dict(metadata.get("labels") or {}),
                taints=tuple((obj.get("spec") or {}).get("taints") or ()))


class GpuNodes:
    """The cluster's GPU nodes as the fit check sees them, read at most once per NODES_TTL_SECONDS."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._read_at: float | None = None
        self._nodes: list[Node] | None = None
        self._why = ""
        self._lock = asyncio.Lock()

    async def read(self, kube: Kube) -> tuple[list[Node] | None, str]:
        """(the nodes, "") or (None, why they could not be read)."""
        async with self._lock:
            if self._read_at is None or self.clock() - self._read_at >= NODES_TTL_SECONDS:
                try:
                    items = await kube.list("v1", "Node", None, label_selector=fit.GPU_PRODUCT_LABEL,
                                            timeout=NODES_TIMEOUT_SECONDS)
                    self._nodes, self._why = [node_of(item) for item in items], ""
                except APIClientError as error:
                    self._nodes, self._why = None, f"cannot list nodes (HTTP {error.status}): {error.message or error}"
                except (aiohttp.ClientError, TimeoutError) as error:
                    self._nodes, self._why = None, f"cannot list nodes: {type(error).__name__} {error}"
                self._read_at = self.clock()
            return self._nodes, self._why


class ModelConfigs:
    """The models' config.json as read for the fit check (or why not), each kept for CONFIG_TTL_SECONDS."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, hub: HubAccess | None = None):
        self.clock, self.hub = clock, hub or HubAccess()
        self._reads: dict[str, tuple[float, ConfigRead]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def read(self, model: str) -> ConfigRead:
        async with self._locks.setdefault(model, asyncio.Lock()):  # runs of one model wait for the first read
            kept = self._reads.get(model)
            if kept is None or self.clock() - kept[0] >= CONFIG_TTL_SECONDS:
                # huggingface_hub blocks: off the event loop, which the other runs' passes share.
                kept = self.clock(), await asyncio.to_thread(read_model_config, model, self.hub)
                self._reads[model] = kept
            return kept[1]


@dataclass(frozen=True)
class ClusterFit:
    report: fit.FitReport
    skipped: list[str]  # why the check, or a part of it, did not run


async def check_run(spec: GRPORunSpec, kube: Kube, configs: ModelConfigs, gpu_nodes: GpuNodes | None) -> ClusterFit:
    """The fit check of a run about to start (a CPU run is not checked). `gpu_nodes` None: the nodes are not read,
    and only a GPU the nodeSelector names is known."""
    if spec.learner.device != "cuda" and spec.rollout.device != "cuda":
        return ClusterFit(fit.FitReport([], [], []), [])
    config, why = await configs.read(spec.model)
    if config is None:
        return ClusterFit(fit.FitReport([], [], []), [why])
    try:
        fit.model_shape(config)  # a config.json without the shape: skipped before the nodes are read for it
    except fit.ModelConfigError as error:
        return ClusterFit(fit.FitReport([], [], []), [f"spec.model {spec.model}: {error}"])
    nodes, unread = await gpu_nodes.read(kube) if gpu_nodes is not None else (None, "")
    return ClusterFit(fit.check_spec_fit(spec, config, nodes), [f"the GPU nodes' labels: {unread}"] if unread else [])
