"""Leader election on a coordination.k8s.io/v1 Lease, held before kopf starts: one replica reconciles, the others
wait for the Lease and take over when the holder stops renewing it.

The algorithm is client-go's (controller-runtime's): a candidate takes the Lease when it is free, or when its record
(holder and renewTime, seen through its resourceVersion) has not changed for `lease_duration` seconds measured on
the candidate's own clock, so no clock skew between nodes matters. Every take and renewal is an update with the
resourceVersion it read: two candidates racing for one Lease get one 200 and one 409. The holder renews every
`retry_period`; when no renewal has succeeded for `renew_deadline` (< lease_duration) it has lost the Lease and
must stop acting at once, before any other replica can have taken it (the caller exits the process).

kopf peering is not used: it pauses lower-priority operators, but two replicas of one Deployment have one priority,
and kopf then only warns that both are active.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable
from typing import Any

import kopf
from kopf._cogs.clients import api, auth, errors

from .kube import object_url

LEASE_API = "coordination.k8s.io/v1"
DEFAULT_LEASE_NAME = "grpo-operator"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


class LeadershipLost(Exception):
    """The holder could not renew its Lease within the renew deadline."""


@dataclasses.dataclass(frozen=True)
class LeaseTimings:
    """client-go's defaults: a dead holder is replaced within lease_duration + retry_period seconds."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration "
                             f"(got {self.retry_period:g} < {self.renew_deadline:g} < {self.lease_duration:g})")


def default_identity() -> str:
    """The pod's name (the chart passes POD_NAME) plus a random suffix: a restarted container is a new candidate."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(_TIME_FORMAT)


class LeaseClient:
    """GET/POST/PUT of one Lease over kopf's HTTP client, logged in the way kopf logs in; 401 logs in again."""

    def __init__(self, namespace: str, name: str, settings: kopf.OperatorSettings, logger: logging.Logger,
                 login: Callable[[], kopf.ConnectionInfo | None] | None = None):
        self.namespace, self.name, self.settings, self.logger = namespace, name, settings, logger
        self._login = login or self._login_as_kopf
        self._context: auth.APIContext | None = None

    def _login_as_kopf(self) -> kopf.ConnectionInfo | None:

        return kopf.login_via_client(logger=self.logger, settings=self.settings)

    def _url(self, named: bool = True) -> str:
        return object_url(LEASE_API, "Lease", self.namespace, self.name if named else None)

    async def _request(self, method: str, url: str, payload: Any = None) -> dict[str, Any]:
        if self._context is None:
            info = self._login()
            if info is None:
                raise kopf.LoginError("the kubernetes client library is not installed")
            self._context = auth.APIContext(info)
        try:
            response = await api.request(method, url, payload=payload, settings=self.settings, logger=self.logger,
                                         backoffs=(), context=self._context)
        except errors.APIUnauthorizedError:
            await self.close()  # a rotated token: log in again on the next attempt
            raise
        async with response:
            return await response.json()

    async def read(self) -> dict[str, Any] | None:
        try:
            return await self._request("get", self._url())
        except errors.APINotFoundError:
            return None

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": LEASE_API, "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        return await self._request("post", self._url(named=False), body)

    async def replace(self, lease: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        """PUT with the read resourceVersion: 409 when anyone wrote the Lease since."""
        return await self._request("put", self._url(), {**lease, "spec": spec})

    async def close(self) -> None:
        if self._context is not None:
            await self._context.session.close()
            self._context = None


class LeaderElector:
    def __init__(self, client: LeaseClient, identity: str, timings: LeaseTimings, logger: logging.Logger):
        self.client, self.identity, self.timings, self.logger = client, identity, timings, logger
        self._observed: tuple[str, float] | None = None  # (resourceVersion, local monotonic time first seen)
        self._renewed_at = 0.0

    def _spec(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = _now()
        previous = previous or {}
        ours = previous.get("holderIdentity") == self.identity
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.timings.lease_duration)),
                "acquireTime": previous.get("acquireTime") if ours else now, "renewTime": now,
                "leaseTransitions": (previous.get("leaseTransitions") or 0) + (0 if ours or not previous else 1)}

    def _free(self, lease: dict[str, Any]) -> bool:
        """The Lease may be taken: free, ours, or unchanged for lease_duration on our clock."""
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if not holder or holder == self.identity:
            return True
        now, version = asyncio.get_running_loop().time(), lease["metadata"]["resourceVersion"]
        if self._observed is None or self._observed[0] != version:
            self._observed = (version, now)
        duration = spec.get("leaseDurationSeconds") or self.timings.lease_duration
        return now - self._observed[1] >= duration

    async def try_acquire_or_renew(self) -> bool:
        try:
            lease = await self.client.read()
            if lease is None:
                await self.client.create(self._spec(None))
            elif self._free(lease):
                await self.client.replace(lease, self._spec(lease.get("spec")))
            else:
                return False
        except errors.APIConflictError:
            return False  # another candidate wrote first
        self._renewed_at = asyncio.get_running_loop().time()
        return True

    async def acquire(self) -> None:
        """Return once this replica holds the Lease."""
        self.logger.info("waiting to lead: Lease %s/%s as %s", self.client.namespace, self.client.name,
                         self.identity)
        while True:
            try:
                if await asyncio.wait_for(self.try_acquire_or_renew(), self.timings.retry_period):
                    self.logger.info("leading: took Lease %s/%s", self.client.namespace, self.client.name)
                    return
            except (errors.APIError, TimeoutError, OSError) as error:
                self.logger.warning("Lease %s/%s: %s", self.client.namespace, self.client.name, error)
            await asyncio.sleep(self.timings.retry_period * random.uniform(1.0, 1.2))

    async def hold(self) -> None:
        """Renew until a renewal fails for renew_deadline seconds; then raise LeadershipLost."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timings.retry_period)
            left = self._renewed_at + self.timings.renew_deadline - loop.time()
            try:
                if left > 0 and await asyncio.wait_for(self.try_acquire_or_renew(), left):
                    continue
                if left > 0:  # read and answered: another replica holds the Lease (or wrote it first)
                    raise LeadershipLost(f"Lease {self.client.namespace}/{self.client.name} is held by another "
                                         "replica")
            except (errors.APIError, TimeoutError, OSError) as error:
                self.logger.warning("renewing Lease %s/%s failed: %s", self.client.namespace, self.client.name,
                                    error)
            if loop.time() - self._renewed_at >= self.timings.renew_deadline:
                raise LeadershipLost(f"Lease {self.client.namespace}/{self.client.name} not renewed for "
                                     f"{self.timings.renew_deadline:g} s")

    async def release(self) -> None:
        """Hand the Lease back on a clean exit, so a standby takes over within one retry period."""
        try:
            lease = await self.client.read()
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                await self.client.replace(lease, spec)
                self.logger.info("released Lease %s/%s", self.client.namespace, self.client.name)
        except (errors.APIError, TimeoutError, OSError) as error:
            self.logger.warning("releasing Lease %s/%s failed: %s", self.client.namespace, self.client.name, error)
        finally:
            await self.client.close()
