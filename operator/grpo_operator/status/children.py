"""What an existing child object of a run gets when CreateChildren finds it already there (created by an earlier
pass of the same run): nothing, or the patch that brings it to what the pods about to be created need; and the
children the spec no longer names (a removed or renamed environment's Service, the PodGroup of a gang removed or
moved to the other scheduler), which are deleted.

Only a run with no pods is patched: a live run's run config is never rendered again (only its `rollout.urls` follow
`rollout.replicas`, through ConfigureRollout), its gang keeps the size it started with, and its Services keep the
ports its pods listen on (the CRD lets an environment's port or name change only while the run is suspended).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..api import GENERATION_ANNOTATION
from ..podgroup import COSCHEDULING_API, VOLCANO_API
from ..run_config_map import rollout_urls_of, run_config_of


def child_patch(child: Mapping[str, Any], existing: Mapping[str, Any], *, generation: int,
                live: bool) -> dict[str, Any] | None:
    """The merge patch for `existing` (the object the run already owns under the child's name) so that it matches
    the `child` built for this pass; None when it stays as it is. `generation` is the run's metadata.generation;
    `live` says whether any of the run's pods exist."""
    if live:
        return None
    if child["kind"] == "ConfigMap" and (
            rendered_generation(existing) != generation or rendered_sizes(existing) != rendered_sizes(child)):
        # Pods about to be created from a spec edited while the run was suspended (the CRD allows rollout, learner
        # and checkpoint edits only then, but for rollout.replicas), or at other counts than the config was rendered
        # for (Kueue admits a run again at the size its spec asked for and was refused): their config is rendered
        # again.
        return {"metadata": {"annotations": child["metadata"]["annotations"]}, "data": child["data"]}
    if child["kind"] == "PodGroup" and existing.get("spec") != child["spec"]:
        # The same edit (more servers or learner nodes) changes the gang's size: a group still counting the old pods
        # would have its scheduler place part of the gang, or hold the rest forever.
        return {"spec": child["spec"]}
    if child["kind"] == "Service":
        # An environment's port edited while the run was suspended: its URL and its server say the new port, so
        # the Service must forward it.
        return service_patch(child, existing)
    return None


def service_replaced(child: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
    """Whether `existing` must be deleted and created again as `child`: a headless Service is wanted where one with a
    cluster IP exists (an environment's, as operators before headless environment Services made it), and a
    Service's clusterIP cannot be changed. Whether the run is live or not: the learner's client pins each episode
    to one server only when the name resolves to the servers."""
    return (child["kind"] == "Service" and child["spec"].get("clusterIP") == "None"
            and (existing.get("spec") or {}).get("clusterIP") != "None")


def service_patch(child: Mapping[str, Any], existing: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that gives an existing Service the child's ports and selector (the fields the operator sets;
    the API server's defaults, such as the cluster IP, are left as they are); None when they match already."""
    wanted, current = child["spec"], existing.get("spec") or {}
    if _ports(current.get("ports")) == _ports(wanted["ports"]) and current.get("selector") == wanted["selector"]:
        return None
    old_selector = current.get("selector") or {}
    selector = {**{key: None for key in old_selector if key not in wanted["selector"]}, **wanted["selector"]}
    return {"spec": {"ports": wanted["ports"], "selector": selector}}  # a merge patch replaces the ports whole


def _ports(ports: Any) -> list[tuple[Any, ...]]:
    return sorted((port.get("name"), port.get("port"), port.get("targetPort"), port.get("protocol", "TCP"))
                  for port in ports or [] if isinstance(port, Mapping))


def stale_services(children: Sequence[Mapping[str, Any]], owned: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of the run's Services (`owned`, the run's by its label and ownerReference) that none of the
    `children` built from the spec names: an environment removed or renamed while the run was suspended."""
    named = {child["metadata"]["name"] for child in children if child["kind"] == "Service"}
    names = ((service.get("metadata") or {}).get("name") for service in owned)
    return sorted(name for name in names if name and name not in named)


def stale_pod_groups(children: Sequence[Mapping[str, Any]]) -> list[str]:
    """The PodGroup API versions (one per gang scheduler) whose PodGroup of the run none of the `children` is: a
    PodGroup of the run under such a version is left from a gang the spec no longer asks for (spec.scheduling.gang
    removed, or its scheduler changed)."""
    rendered = {child["apiVersion"] for child in children if child["kind"] == "PodGroup"}
    return [api_version for api_version in (COSCHEDULING_API, VOLCANO_API) if api_version not in rendered]


def rendered_sizes(config_map: Mapping[str, Any]) -> tuple[list[str] | None, Any]:
    """The rollout URLs and learner node count a ConfigMap's run config was rendered with."""
    learner = (run_config_of(config_map) or {}).get("learner")
    return rollout_urls_of(config_map), learner.get("nodes") if isinstance(learner, dict) else None


def rendered_generation(config_map: Mapping[str, Any]) -> int:
    """The run generation a ConfigMap was rendered from (its annotation; 1 when it has none or a torn one)."""
    value = str(((config_map.get("metadata") or {}).get("annotations") or {}).get(GENERATION_ANNOTATION, "1"))
    return int(value) if value.isdigit() else 1
