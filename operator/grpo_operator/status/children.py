"""What an existing child object of a run gets when CreateChildren finds it already there (created by an earlier
pass of the same run): nothing, or the patch that brings it to what the pods about to be created need.

Only a run with no pods is touched: a live run's run config is never rendered again (only its `rollout.urls` follow
`rollout.replicas`, through ConfigureRollout), and its gang keeps the size it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..api import GENERATION_ANNOTATION
from ..builders import rollout_urls_of, run_config_of


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
    return None


def rendered_sizes(config_map: Mapping[str, Any]) -> tuple[list[str] | None, Any]:
    """The rollout URLs and learner node count a ConfigMap's run config was rendered with."""
    learner = (run_config_of(config_map) or {}).get("learner")
    return rollout_urls_of(config_map), learner.get("nodes") if isinstance(learner, dict) else None


def rendered_generation(config_map: Mapping[str, Any]) -> int:
    """The run generation a ConfigMap was rendered from (its annotation; 1 when it has none or a torn one)."""
    value = str(((config_map.get("metadata") or {}).get("annotations") or {}).get(GENERATION_ANNOTATION, "1"))
    return int(value) if value.isdigit() else 1
