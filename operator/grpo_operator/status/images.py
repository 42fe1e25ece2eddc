"""The images a run's pods ran, by digest, for the trained model's provenance (pure).

The kubelet reports each started container's `imageID`: the digest it pulled (`registry/name@sha256:...`) or imported
(`sha256:...`), which a tag such as `:latest` does not pin. The run config's `images` keeps every digest the run's pods
have run, by role (`rollout`, `learner`, `environment/NAME`), so that the learner's export names them in its manifest
(grpo-export.json `images`): a pod re-created on a node that pulled a newer image under the same tag adds its digest
beside the old one instead of replacing it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..api import GRPORunSpec
from ..builders import environment_pod_prefix
from .decision import PodObservation, RecordImages


def image_key(run: str, environments: Iterable[str], pod: PodObservation) -> str:
    """The run config's key for a pod's image: its role, and an environment server's environment."""
    if pod.role == "environment":
        name = next((env for env in environments if pod.name.startswith(environment_pod_prefix(run, env))), None)
        return f"environment/{name}" if name else "environment"
    return pod.role


def images_to_record(run: str, environments: Iterable[str], pods: Iterable[PodObservation],
                     configured: Mapping[str, Sequence[str]] | None) -> dict[str, list[str]] | None:
    """The run config's `images` with every digest `pods` report added; None when it holds them all already, or when
    what it holds is not known (no run config read yet)."""
    if configured is None:
        return None
    names = list(environments)
    recorded = {key: sorted(set(digests)) for key, digests in configured.items()}
    images = {key: list(digests) for key, digests in recorded.items()}
    for pod in pods:
        digests = images.setdefault(image_key(run, names, pod), []) if pod.image_id else None
        if digests is not None and pod.image_id not in digests:
            digests.append(pod.image_id)
            digests.sort()
    return None if images == recorded else images


def images_action(run: str, spec: GRPORunSpec, pods: Iterable[PodObservation],
                  configured: Mapping[str, Sequence[str]] | None) -> RecordImages | None:
    """RecordImages when the run config's `images` lack a digest the run's pods report."""
    environments = [environment.name for environment in spec.environments or ()]
    images = images_to_record(run, environments, pods, configured)
    return RecordImages(images) if images is not None else None

