"""The one small Kubernetes API helper: create tolerant of 409, delete tolerant of 404, status patches.

It rides on kopf's own client (kopf 1.45.2 is pinned) so every call uses the credentials kopf logged in with, its
re-authentication on 401, `settings.networking.request_timeout` and its retry backoffs; no second client library
to configure (kubernetes==37 reads $KUBECONFIG once at import, which bites in tests and in-cluster alike).
Only `kopf._cogs.clients` (api, errors, auth) is private here; everything else comes from kopf's public names.
tests/support/emulator/test_kube_emulator.py checks the kopf internals used here still exist.
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

import aiohttp
import kopf
from kopf._cogs.clients import api, errors

from ..api import KIND, PLURAL

APIClientError = errors.APIClientError
#: Statuses that mean the object itself is invalid: retrying the same object cannot help.
PERMANENT_REJECTIONS = frozenset({400, 422})

_PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Pod": "pods", KIND: PLURAL, "Event": "events",
            "Workload": "workloads", "ResourceFlavor": "resourceflavors", "PodGroup": "podgroups", "Lease": "leases",
            "Node": "nodes"}


def object_url(api_version: str, kind: str, namespace: str | None, name: str | None = None,
               subresource: str | None = None) -> str:
    """The REST path of an object; `namespace` None for a cluster-scoped kind (a Kueue ResourceFlavor)."""
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    url = f"{base}/namespaces/{namespace}/{_PLURALS[kind]}" if namespace else f"{base}/{_PLURALS[kind]}"
    url += f"/{name}" if name else ""
    url += f"/{subresource}" if subresource else ""
    return url


#: kopf retries 403, 429, 5xx and connection errors itself, by default for about a minute (1+1+2+3+5+8+13+21 s),
#: inside the pass. Creates retry once, briefly: the reconcile pass retries them with its own backoff and shows the
#: error on the run meanwhile, instead of holding the run's loop for a minute.
CREATE_BACKOFFS = (0.5,)


class Kube:
    def __init__(self, settings: kopf.OperatorSettings, logger: logging.Logger | logging.LoggerAdapter):
        self.settings, self.logger = settings, logger

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it exists already (deterministic names make that "done", not an error)."""
        metadata = obj["metadata"]
        url = object_url(obj["apiVersion"], obj["kind"], metadata["namespace"])
        try:
            await api.post(url, payload=obj, settings=self.settings, logger=self.logger, backoffs=CREATE_BACKOFFS)
        except errors.APIConflictError:
            return False
        return True

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete with background propagation; False when it is gone already."""
        url = object_url(api_version, kind, namespace, name)
        try:
            await api.delete(url, payload={"propagationPolicy": "Background"}, settings=self.settings,
                             logger=self.logger)
        except errors.APINotFoundError:
            return False
        return True

    async def read(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none (namespace None: a cluster-scoped object)."""
        try:
            return await api.get(object_url(api_version, kind, namespace, name), settings=self.settings,
                                 logger=self.logger)
        except errors.APINotFoundError:
            return None

    async def list(self, api_version: str, kind: str, namespace: str | None, *, label_selector: str | None = None,
                   field_selector: str | None = None, timeout: float) -> list[dict[str, Any]]:
        """The objects of `kind` whose labels match `label_selector` and fields `field_selector`, in one request of
        at most `timeout` seconds and no retry (namespace None: a cluster-scoped kind). Raises APIClientError (a 403
        among them) and aiohttp's errors: the caller decides what a failed read costs."""
        query = {key: value for key, value in (("labelSelector", label_selector), ("fieldSelector", field_selector))
                 if value}
        url = f"{object_url(api_version, kind, namespace)}?{urllib.parse.urlencode(query)}"
        response = await api.request("get", url, settings=self.settings, logger=self.logger, backoffs=(),
                                     timeout=aiohttp.ClientTimeout(total=timeout))
        async with response:
            return (await response.json()).get("items") or []

    async def api_group(self, group: str) -> dict[str, Any] | None:
        """The discovery document of an API group (its versions, the preferred one); None when it is not served."""
        try:
            return await api.get(f"/apis/{group}", settings=self.settings, logger=self.logger)
        except errors.APINotFoundError:
            return None

    async def patch(self, api_version: str, kind: str, namespace: str, name: str,
                    patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch the object; None when it is gone."""
        try:
            return await api.patch(object_url(api_version, kind, namespace, name), payload=patch,
                                   settings=self.settings, logger=self.logger,
                                   headers={"Content-Type": "application/merge-patch+json"})
        except errors.APINotFoundError:
            return None

    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                           patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch `/status`; None when the object is gone."""
        url = object_url(api_version, kind, namespace, name, "status")
        try:
            return await api.patch(url, payload={"status": patch}, settings=self.settings, logger=self.logger,
                                   headers={"Content-Type": "application/merge-patch+json"})
        except errors.APINotFoundError:
            return None


def merge_patch_between(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns `old` into `new` (removed keys become null; lists are replaced)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch_between(old[key], value)
    return patch
