"""The cluster port's CreateChildren and ConfigureRollout: the run's ConfigMap, Services, PodGroup and pods created
(idempotent: a child that exists already is patched to what it must be before the pods start; a Service or PodGroup
the spec no longer names is deleted), and the run config's `rollout.urls` kept at the servers the state machine asks
for.

A child the API server refuses as invalid raises ChildRejected (the port records it; the next pass fails the run as
InvalidSpec); anything else it answers (quota, throttling, a name still held by an earlier run's object) is shown on
the run and retried with backoff.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from .. import builders, run_config_map
from ..api import ROLE_LABEL, RUN_LABEL, GRPORunSpec
from ..pod_overrides import OverrideError
from ..podgroup import pod_group_name
from ..run_ref import RunRef
from ..run_status import parse_status
from ..status import revision
from ..status.children import child_patch, service_replaced, stale_pod_groups, stale_services
from . import kueue
from .kube import PERMANENT_REJECTIONS, APIClientError, Kube

#: Backoff between attempts to create children after a transient API error (quota, throttling, conflicts).
CREATE_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
#: The bound on listing the run's Services (one request; a failure is retried with the create backoff).
LIST_TIMEOUT_SECONDS = 10.0
#: PodSecurity admission answers 403 Forbidden, as quota does, but only a different pod (or namespace label) passes
#: it; its message is the one sign that tells the two apart (`pods "x" is forbidden: violates PodSecurity ...`).
POD_SECURITY_REFUSAL = "violates PodSecurity"


def _permanent(error: APIClientError) -> bool:
    """A refusal that the same object would meet again: invalid (400, 422), or against the namespace's PodSecurity
    level. Anything else (quota, throttling, conflicts, the server's own errors) may pass on a later try."""
    return error.status in PERMANENT_REJECTIONS or (
        error.status == 403 and POD_SECURITY_REFUSAL in str(error.message or ""))


class ChildRejected(Exception):
    """The API server refused a child object as invalid: its fields come from the spec (volumes, resources)."""

    def __init__(self, message: str, created_pods: list[str]):
        super().__init__(message)
        self.created_pods = created_pods  # pods this pass created before the refusal (not in the index yet)


@dataclasses.dataclass
class ChildrenMemory:
    """What the operator remembers of a run's children between passes (lost on restart: creating is idempotent)."""

    created: bool = False  # everything was created (or found) by the last CreateChildren
    error: str | None = None  # why creating failed last time (transient; retried with backoff)
    failures: int = 0
    retry_at: datetime.datetime | None = None
    rollout_urls: list[str] | None = None  # what the run config in the ConfigMap lists, as last read or written
    images: dict[str, list[str]] | None = None  # the image digests the run config records, as last read or written
    deleted_uids: set[str] = dataclasses.field(default_factory=set)  # pods deleted, until the index drops them


class Children:
    """One run's children, for one pass: `kube` to act with, `memory` kept between passes."""

    def __init__(self, kube: Kube, run: RunRef, memory: ChildrenMemory, trainer_image: str,
                 clock: Callable[[], datetime.datetime]):
        self.kube, self.run, self.memory = kube, run, memory
        self.trainer_image, self.clock = trainer_image, clock

    async def configured(self) -> tuple[list[str] | None, dict[str, list[str]] | None]:
        """The `rollout.urls` and `images` of the run config in the run's ConfigMap, one read for both (once per
        operator process, then kept as written; None while there is no ConfigMap or it cannot be read)."""
        memory = self.memory
        if memory.rollout_urls is None or memory.images is None:
            config_map = await self._owned("v1", "ConfigMap", builders.config_map_name(self.run.name))
            if config_map is not None:
                memory.rollout_urls = run_config_map.rollout_urls_of(config_map)
                memory.images = run_config_map.images_of(config_map)
        return memory.rollout_urls, memory.images

    async def record_images(self, images: Mapping[str, Sequence[str]]) -> None:
        """Make the run config's `images` hold these digests (RecordImages). The learner reads them from its mounted
        copy, which the kubelet refreshes in place, when it exports the model."""
        name = builders.config_map_name(self.run.name)
        config_map = await self._owned("v1", "ConfigMap", name)
        if config_map is None:
            return
        try:
            data = run_config_map.with_images(config_map, images)
        except ValueError as error:
            self.kube.logger.warning(f"cannot record the pods' images in the run config: {error}")
            return
        if data is not None and await self.kube.patch("v1", "ConfigMap", self.run.namespace, name,
                                                      {"data": data}) is None:
            return
        self.memory.images = {key: list(digests) for key, digests in images.items()}

    async def configure_rollout(self, replicas: int) -> None:
        """Make the run config list `replicas` servers (ConfigureRollout). The learner watches the file: the kubelet
        refreshes the mounted ConfigMap in place, so no pod restarts for it."""
        run, logger = self.run, self.kube.logger
        urls = builders.rollout_urls(run.name, run.namespace, replicas)
        if self.memory.rollout_urls == urls:
            return
        name = builders.config_map_name(run.name)
        config_map = await self._owned("v1", "ConfigMap", name)
        if config_map is None:
            return  # not created yet (CreateChildren renders it with these URLs), or an earlier run's
        try:
            data = run_config_map.with_rollout_urls(config_map, urls)
        except ValueError as error:
            logger.warning(f"cannot set rollout.urls in the run config: {error}")
            return
        if data is not None:
            if await self.kube.patch("v1", "ConfigMap", run.namespace, name, {"data": data}) is None:
                return
            logger.info(f"run config: rollout.urls now lists {len(urls)} server(s)")
        self.memory.rollout_urls = urls

    async def create(self, spec: GRPORunSpec, status: dict[str, Any], present: frozenset[str],
                     gate: kueue.Gate | None) -> None:
        """Create what is missing of the run as `spec` asks (`present`: the pod names it holds; `gate`: Kueue's
        admission, whose flavours place the pods), at the restart counts `status` holds. Raises ChildRejected."""
        memory, now = self.memory, self.clock()
        if memory.retry_at is not None and now < memory.retry_at:
            return
        try:
            children = self._build(spec, status)
        except OverrideError as error:  # a managed field the API server's rules let through
            raise ChildRejected(str(error), []) from None
        if present:  # a live run: new servers are in the run config before their pods exist
            await self.configure_rollout(spec.rollout.replicas)
        if gate is not None:  # Kueue admitted the run: its flavours' node labels and tolerations
            children = await self._placed(children, spec, gate)
        problem = (await self._create_each(children, present) or await self._delete_stale_services(children)
                   or await self._delete_stale_pod_groups(children))
        if problem is None:
            memory.created, memory.error, memory.failures, memory.retry_at = True, None, 0, None
            return
        self.kube.logger.warning(problem)
        memory.created, memory.error = False, problem
        delay = CREATE_BACKOFF_SECONDS[min(memory.failures, len(CREATE_BACKOFF_SECONDS) - 1)]
        memory.failures += 1
        memory.retry_at = now + datetime.timedelta(seconds=delay)

    def _build(self, spec: GRPORunSpec, status: dict[str, Any]) -> list[dict[str, Any]]:
        attempt = int(status.get("restarts", 0)) + int(status.get("disruptions", 0))
        parsed = parse_status(status)
        rollout = parsed.rollout
        digest = revision.pinned_digest(spec, parsed)  # a later pod held to the model's content at the first start
        spec = revision.pinned_spec(spec, parsed)  # every pod, a later one too, at the commits pinned before the first
        rollout_restarts = {server.replica: server.restarts for server in rollout.servers} if rollout else {}
        return revision.with_model_digest(builders.build_children(
            self.run, spec, trainer_image=self.trainer_image, attempt=attempt, rollout_restarts=rollout_restarts),
            digest)

    async def _placed(self, children: list[dict[str, Any]], spec: GRPORunSpec,
                      gate: kueue.Gate) -> list[dict[str, Any]]:
        placed = await kueue.placements(self.kube, gate.flavors)
        children = [kueue.place(child, *placed[pod_set]) if child["kind"] == "Pod" and (
            pod_set := kueue.pod_set_of(child)) in placed else child
            for child in children]
        topologies = kueue.role_topologies(spec)
        return [kueue.topology_gated(child, self.run.name, role, topologies[role]) if child["kind"] == "Pod" and (
            role := child["metadata"]["labels"].get(ROLE_LABEL)) in topologies else child
            for child in children]

    async def _create_each(self, children: list[dict[str, Any]], present: frozenset[str]) -> str | None:
        """Create each child in order; why a create must be tried again, or None when all are there."""
        run, kube, created_pods, problem = self.run, self.kube, [], None
        for child in children:
            child_name = f"{child['kind']} {child['metadata']['name']}"
            if child["kind"] == "Pod" and child["metadata"]["name"] in present:
                continue
            try:
                created = await kube.create(child)
            except APIClientError as error:
                if _permanent(error):
                    raise ChildRejected(f"{child_name} was rejected by the API server: {error.message or error}",
                                        created_pods) from None
                return f"creating {child_name} failed (HTTP {error.status}): {error.message or error}; retrying"
            if created and child["kind"] == "Pod":
                created_pods.append(child["metadata"]["name"])
            if created and child["kind"] == "ConfigMap":
                self.memory.rollout_urls = run_config_map.rollout_urls_of(child)
                self.memory.images = run_config_map.images_of(child)
            if created:
                continue
            meta = child["metadata"]
            existing = await self._owned(child["apiVersion"], child["kind"], meta["name"])
            if existing is None:
                problem = f"{child_name} still belongs to an earlier run of the same name; waiting for it to go"
            elif service_replaced(child, existing):
                problem = await self._replace(child) or problem
            elif (patch := child_patch(_keeping_images(child, existing), existing, generation=run.generation,
                                       live=bool(present))) is not None:
                await kube.patch(child["apiVersion"], child["kind"], run.namespace, meta["name"], patch)
                if child["kind"] == "ConfigMap":
                    self.memory.rollout_urls = run_config_map.rollout_urls_of(child)
                    self.memory.images = run_config_map.images_of(existing)
        return problem

    async def _replace(self, child: dict[str, Any]) -> str | None:
        """Delete `child`'s existing object and create it again; why that must be tried again, or None."""
        kube, name = self.kube, child["metadata"]["name"]
        await kube.delete(child["apiVersion"], child["kind"], self.run.namespace, name)
        if not await kube.create(child):
            return f"{child['kind']} {name} is being replaced and the old one is not gone yet; retrying"
        kube.logger.info(f"{child['kind']} {name} replaced: it is headless now (a cluster IP cannot be changed)")
        return None

    async def _delete_stale_services(self, children: list[dict[str, Any]]) -> str | None:
        """Delete the run's Services that `children` no longer names; why it must be tried again, or None."""
        run, kube = self.run, self.kube
        try:
            services = await kube.list("v1", "Service", run.namespace, label_selector=f"{RUN_LABEL}={run.name}",
                                       timeout=LIST_TIMEOUT_SECONDS)
            for name in stale_services(children, [service for service in services if self._controls(service)]):
                await kube.delete("v1", "Service", run.namespace, name)
                kube.logger.info(f"Service {name} deleted: the spec no longer names it")
        except APIClientError as error:
            return (f"deleting the Services the spec no longer names failed (HTTP {error.status}): "
                    f"{error.message or error}; retrying")
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"listing the run's Services failed: {type(error).__name__} {error}; retrying"
        return None

    async def _delete_stale_pod_groups(self, children: list[dict[str, Any]]) -> str | None:
        """Delete the run's PodGroup of a gang scheduler `children` does not use (read by its name: a cluster without
        that scheduler serves no such kind, a 404 as for no object); why it must be tried again, or None."""
        run, kube, name = self.run, self.kube, pod_group_name(self.run.name)
        try:
            for api_version in stale_pod_groups(children):
                if await self._owned(api_version, "PodGroup", name) is not None:
                    await kube.delete(api_version, "PodGroup", run.namespace, name)
                    kube.logger.info(f"PodGroup {name} ({api_version}) deleted: the spec no longer names its gang")
        except APIClientError as error:
            return (f"deleting the PodGroup the spec no longer names failed (HTTP {error.status}): "
                    f"{error.message or error}; retrying")
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"reading the run's PodGroup failed: {type(error).__name__} {error}; retrying"
        return None

    def _controls(self, existing: dict[str, Any] | None) -> bool:
        owners = ((existing or {}).get("metadata") or {}).get("ownerReferences") or []
        return any(ref.get("uid") == self.run.uid and ref.get("controller") for ref in owners)

    async def _owned(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """The object under `name` in the run's namespace, when the run controls it; None otherwise."""
        existing = await self.kube.read(api_version, kind, self.run.namespace, name)
        return existing if self._controls(existing) else None


def _keeping_images(child: dict[str, Any], existing: dict[str, Any]) -> dict[str, Any]:
    """A run config rendered again (a resumed run's edited spec) keeps the image digests the run's pods have run."""
    images = run_config_map.images_of(existing) if child["kind"] == "ConfigMap" else None
    data = run_config_map.with_images(child, images) if images else None
    return child if data is None else {**child, "data": data}
