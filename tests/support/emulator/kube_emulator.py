"""A Kubernetes API emulator that the real kopf operator can run a whole GRPORun lifecycle against.

The fast tier: a real kube-apiserver and etcd (`tests.support.controlplane.control_plane`) take seconds to start and
need their binaries built, so most operator tests run against `kmock.KubernetesEmulator` (0.8) served over real HTTP,
and the control-plane tier runs the same scenarios again on the real server. Plain kmock keeps objects as dicts merged
blindly: no resourceVersion, uid or generation, watches that replay a snapshot and miss what happens while they
reconnect, no `/status` subresource, no failed JSON-patch `test`, no label selectors, no garbage collection. kopf's
finalizer flow and its optimistic-concurrency patches need all of these, so this layer keeps kmock's HTTP server,
request parsing, discovery documents, error rendering and request list, and replaces the storage semantics:

- uid, creationTimestamp, resourceVersion (one cluster-wide counter) and generation (bumped when anything outside
  metadata/status changes) on every write; a write that changes nothing bumps nothing (as the real server does,
  which is what keeps kopf from looping on its own no-op patches);
- watches: `resourceVersion=N` replays every retained event after N, then streams live ones; the backlog is taken and
  the subscription registered in one step with no await between, so nothing falls in a gap; 410 Gone when N is older
  than the retained history; `timeoutSeconds` honoured;
- `/status` takes status only; writes to the object ignore status (for resources with the status subresource);
- merge-patch, JSON-patch (422 when a `test` op fails), strategic-merge-patch treated as merge-patch, PUT replace
  with a resourceVersion precondition (409), server-side apply refused (415);
- label selectors (equality and set based) on list, watch and deletecollection; `metadata.name`/`metadata.namespace`
  field selectors, and an Event's `involvedObject.*`, `reason` and `type`;
- finalizers: delete sets deletionTimestamp and keeps the object until its finalizers are empty; no new finalizers
  on an object being deleted (422);
- ownerReference garbage collection: deleting an owner deletes the dependents whose owners are all gone (background
  propagation; `Orphan` keeps them); a dependent created for an owner that no longer exists is collected at once;
- namespaced objects need their namespace to exist (404), as on a real server;
- optional per-resource validators (e.g. the CRD's structural schema) that reject a write with 422;
- request bodies decoded as Go decodes them: NaN and Infinity are not JSON (400), an integer beyond int64 becomes
  a float (so `type: integer` refuses it).

Stricter modes a test opts into (each is what a real cluster does; the defaults keep tests short):
- `graceful_pod_deletion`: deleting a pod only marks it Terminating (deletionTimestamp) until its kubelet confirms
  with a `gracePeriodSeconds=0` delete; a pod on a dead node stays Terminating, and creating a pod under its name
  is a 409 meanwhile;
- `deferred_gc`: dependents of a deleted owner stay until `collect_garbage()` (the real garbage collector is
  asynchronous, seconds or more behind);
- `inject_fault(...)`: the next matching requests fail with a given status (403 quota, 429, 500, ...).

Deliberate gaps: no admission, no defaulting, Foreground propagation is treated as Background, and spec changes to
a pod are rejected wholesale (the real server allows a few fields).

Every request is recorded as a `RecordedRequest` (method, path, query, plus the RBAC verb/group/resource it needs)
so a test can check the operator's calls against the chart's RBAC rules.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import json
import random
import re
import string
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import requests
from kmock._internal import rendering  # Request: the parsed method/path/query/resource/namespace/name/subresource

#: The kmock release whose internals this layer relies on; tests/support/emulator/test_kube_emulator.py pins it.
KMOCK_VERSION = "0.8"

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
HISTORY_LIMIT = 20_000  # events kept for watch resumption; older resourceVersions get 410 Gone


@dataclasses.dataclass(frozen=True)
class ResourceDef:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.group}/{self.version}/{self.plural}"


NAMESPACES = ResourceDef("", "v1", "namespaces", "Namespace", namespaced=False, subresources=("status",))
PODS = ResourceDef("", "v1", "pods", "Pod", subresources=("status",))
SERVICES = ResourceDef("", "v1", "services", "Service", subresources=("status",))
CONFIGMAPS = ResourceDef("", "v1", "configmaps", "ConfigMap")
EVENTS = ResourceDef("", "v1", "events", "Event")
GRPORUNS = ResourceDef("grpo.dev", "v1alpha1", "grporuns", "GRPORun", subresources=("status",))
LEASES = ResourceDef("coordination.k8s.io", "v1", "leases", "Lease")  # the operator replicas' leader election
DEFAULT_RESOURCES = (NAMESPACES, PODS, SERVICES, CONFIGMAPS, EVENTS, GRPORUNS, LEASES)
# What the operator touches on clusters with Kueue or a gang scheduler installed.
WORKLOADS = ResourceDef("kueue.x-k8s.io", "v1beta1", "workloads", "Workload", subresources=("status",))
RESOURCE_FLAVORS = ResourceDef("kueue.x-k8s.io", "v1beta1", "resourceflavors", "ResourceFlavor", namespaced=False)
COSCHEDULING_POD_GROUPS = ResourceDef("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup",
                                      subresources=("status",))
VOLCANO_POD_GROUPS = ResourceDef("scheduling.volcano.sh", "v1beta1", "podgroups", "PodGroup", subresources=("status",))
SCHEDULING_RESOURCES = (WORKLOADS, RESOURCE_FLAVORS, COSCHEDULING_POD_GROUPS, VOLCANO_POD_GROUPS)


@dataclasses.dataclass
class Fault:
    """Answer the next `times` requests matching method, plural (and the object's name, if given) with this error."""

    method: str
    plural: str
    code: int
    reason: str
    message: str
    times: int = 1
    name: str | None = None

    def matches(self, method: str, plural: str, name: str | None) -> bool:
        return self.times > 0 and self.method == method and self.plural == plural and self.name in (None, name)


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    """One API call, with what RBAC needs to allow it (verb, apiGroup, resource, subresource)."""

    method: str
    path: str
    query: dict[str, str]
    verb: str | None  # None for discovery (non-resource URLs)
    group: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    user_agent: str = ""  # kopf sends `kopf/<version>`: tells the operator's calls from the test's own
    token: str = ""  # the bearer token: tells one operator replica's calls from another's

    @property
    def rbac_resource(self) -> str | None:
        return f"{self.resource}/{self.subresource}" if self.resource and self.subresource else self.resource


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": self.code,
                "reason": self.reason, "message": self.message}


def parse_resource_path(path: str) -> tuple[str, str, str, str | None, str | None, str | None] | None:
    """`/api/v1/namespaces/ns/pods/name/status` -> (group, version, plural, namespace, name, subresource); None for
    discovery paths (no resource named)."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return group, version, plural, namespace, name, subresource


# ---------------------------------------------------------------------------------------------------------------------
# Selectors
# ---------------------------------------------------------------------------------------------------------------------
_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """`a=b,c!=d,e,!f,g in (x,y),h notin (z)` -> a predicate on a labels dict (400 when malformed)."""
    if not text:
        return lambda labels: True
    clauses, depth, current = [], 0, ""
    for char in text:  # split on commas outside parentheses
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            clauses.append(current)
            current = ""
        else:
            current += char
    clauses.append(current)
    checks: list[Callable[[dict[str, str]], bool]] = []
    for clause in (c.strip() for c in clauses):
        if match := _SET_RE.match(clause):
            key, op, values = match[1], match[2], {v.strip() for v in match[3].split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in clause:
            key, value = (s.strip() for s in clause.split("!=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in clause:
            key, value = (s.strip() for s in clause.replace("==", "=").split("=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif clause.startswith("!") and clause[1:].strip():
            absent = clause[1:].strip()
            checks.append(lambda labels, k=absent: k not in labels)
        elif clause and re.fullmatch(r"[A-Za-z0-9./_-]+", clause):
            checks.append(lambda labels, k=clause: k in labels)
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {clause!r} in labelSelector {text!r}")
    return lambda labels: all(check(labels) for check in checks)


#: The field selectors the real server takes on every resource, and those it takes on core/v1 Events besides.
COMMON_FIELDS = ("metadata.name", "metadata.namespace")
EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                "reason", "type")


def _field(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj if obj is not None else ""


def parse_field_selector(text: str | None, rdef: ResourceDef | None = None) -> Callable[[dict[str, Any]], bool]:
    if not text:
        return lambda obj: True
    supported = COMMON_FIELDS + (EVENT_FIELDS if rdef == EVENTS else ())
    checks = []
    for clause in text.split(","):
        negate = "!=" in clause
        field, _, value = clause.replace("!=", "=").replace("==", "=").partition("=")
        if field not in supported:
            raise ApiError(400, "BadRequest", f"field label not supported: {field}")
        checks.append(lambda obj, f=field, v=value, n=negate: (_field(obj, f) == v) != n)
    return lambda obj: all(check(obj) for check in checks)


# ---------------------------------------------------------------------------------------------------------------------
# Patch semantics
# ---------------------------------------------------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, null deletes, everything else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_IMMUTABLE_META = ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion",
                   "deletionTimestamp", "deletionGracePeriodSeconds")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(eq=False)
class _Watcher:
    resource: ResourceDef
    namespace: str | None
    labels: Callable[[dict[str, str]], bool]
    fields: Callable[[dict[str, Any]], bool]
    queue: asyncio.Queue

    def wants(self, resource: ResourceDef, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (resource == self.resource and (self.namespace is None or meta.get("namespace") == self.namespace)
                and self.labels(meta.get("labels") or {}) and self.fields(obj))


Validator = Callable[[dict[str, Any]], list[str]]


def _not_json(token: str) -> Any:
    """NaN and Infinity, which Python's json reads and Go's refuses: the real server answers 400."""
    raise ValueError(f"invalid character {token[0]!r} looking for beginning of value")


def _int64_or_float(digits: str) -> int | float:
    """An integer as the real server decodes it: int64, else a float (which then fails `type: integer`)."""
    value = int(digits)
    return value if -(2**63) <= value < 2**63 else float(value)


class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the storage semantics kopf needs (see the module docstring)."""

    def __init__(self, resources: Iterable[ResourceDef] = DEFAULT_RESOURCES, *,
                 validators: dict[str, Validator] | None = None, namespaces: Iterable[str] = ("default",),
                 max_watch_seconds: float | None = None, history_limit: int = HISTORY_LIMIT,
                 graceful_pod_deletion: bool = False, deferred_gc: bool = False):
        super().__init__()
        self.graceful_pod_deletion, self.deferred_gc = graceful_pod_deletion, deferred_gc
        self.faults: list[Fault] = []
        self._orphaned_owners: list[str] = []
        self.defs: dict[tuple[str, str, str], ResourceDef] = {}
        for rdef in resources:
            self.defs[(rdef.group, rdef.version, rdef.plural)] = rdef
            self.resources[rdef.key] = kmock.ResourceInfo(
                kind=rdef.kind, singular=rdef.kind.lower(), namespaced=rdef.namespaced, verbs=set(ALL_VERBS),
                subresources=set(rdef.subresources))
        self.validators = dict(validators or {})
        # Server-side cap on each watch request, so tests can force kopf through its resume path.
        self.max_watch_seconds = max_watch_seconds
        self.store: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self._live_uids: set[str] = set()
        self.request_log: list[RecordedRequest] = []
        self._rv = 0
        self._history: deque[tuple[int, ResourceDef, dict[str, Any]]] = deque(maxlen=history_limit)
        self._watchers: list[_Watcher] = []
        for namespace in namespaces:
            self._create(NAMESPACES, None, {"metadata": {"name": namespace}})

    # --- kmock hooks -------------------------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8's path parser fails on the namespaces resource itself (`/api/v1/namespaces` -> 500), so resource
        # paths are parsed here; discovery paths still go through kmock's own parsing and documents.
        parsed = parse_resource_path(raw_request.path)
        if parsed is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        text = body.decode(errors="replace")
        try:
            data = json.loads(text, parse_constant=_not_json, parse_int=_int64_or_float) if text else None
        except ValueError:
            data = None
        group, version, plural, namespace, name, subresource = parsed
        request = rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=raw_request.method,
            params=dict(raw_request.query), headers=dict(raw_request.headers), cookies=dict(raw_request.cookies),
            body=body, text=text, data=data, resource=kmock.resource(group=group, version=version, plural=plural),
            namespace=namespace, name=name, subresource=subresource)
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as error:  # noqa: BLE001 - a bug in this layer: answer 500 with the traceback, as kmock does
            return await self._render_error(error)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        rdef = self._resource_of(request)
        self.request_log.append(self._record(request, rdef))
        if rdef is None:  # discovery: kmock's own documents
            return await super()._handle(request)
        try:
            if request.method.value.upper() == "GET" and request.params.get("watch") in ("true", "1"):
                return await self._watch(request, rdef)
            status, payload = self._serve(request, rdef)
        except ApiError as error:
            return aiohttp.web.json_response(error.status(), status=error.code)
        return aiohttp.web.json_response(payload, status=status)

    async def _serve_version(self, request: rendering.Request) -> dict[str, Any]:
        document = await super()._serve_version(request)
        document["groupVersion"] = document["groupVersion"].lstrip("/")  # kmock 0.8 says "/v1" for the core group
        return document

    def _resource_of(self, request: rendering.Request) -> ResourceDef | None:
        resource = request.resource
        if resource is None or resource.plural is None:
            return None
        rdef = self.defs.get((resource.group, resource.version, resource.plural))
        if rdef is None:
            return ResourceDef(resource.group, resource.version, resource.plural, "Unknown")  # answered with 404
        return rdef

    @staticmethod
    def _record(request: rendering.Request, rdef: ResourceDef | None) -> RecordedRequest:
        method = request.method.value.upper()
        query = dict(request.params)
        if rdef is None:
            verb = None
        elif method == "GET":
            verb = "watch" if query.get("watch") in ("true", "1") else ("get" if request.name else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
                    "DELETE": "delete" if request.name else "deletecollection"}.get(method, method.lower())
        return RecordedRequest(
            method=method, path=request.url.path, query=query, verb=verb,
            group=rdef.group if rdef else None, resource=rdef.plural if rdef else None,
            subresource=request.subresource, namespace=request.namespace, name=request.name,
            user_agent=request.headers.get("User-Agent", ""),
            token=request.headers.get("Authorization", "").removeprefix("Bearer "))

    # --- dispatch ----------------------------------------------------------------------------------------------
    def inject_fault(self, method: str, plural: str, code: int, reason: str, message: str, *, times: int = 1,
                     name: str | None = None) -> Fault:
        fault = Fault(method.upper(), plural, code, reason, message, times, name)
        self.faults.append(fault)
        return fault

    def collect_garbage(self) -> None:
        """Run the deferred garbage collector: delete the dependents of every owner deleted so far."""
        owners, self._orphaned_owners = self._orphaned_owners, []
        for uid in owners:
            self._collect_dependents_of(uid)

    def _serve(self, request: rendering.Request, rdef: ResourceDef) -> tuple[int, Any]:
        if rdef.kind == "Unknown":
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({rdef.key})")
        method = request.method.value.upper()
        body_name = ((request.data or {}).get("metadata") or {}).get("name") if isinstance(request.data, dict) else None
        fault = next((f for f in self.faults if f.matches(method, rdef.plural, request.name or body_name)), None)
        if fault is not None:
            fault.times -= 1
            raise ApiError(fault.code, fault.reason, fault.message)
        if request.subresource and request.subresource not in rdef.subresources:
            raise ApiError(404, "NotFound", f"{rdef.plural} has no subresource {request.subresource!r}")
        method = request.method.value.upper()
        namespace = request.namespace if rdef.namespaced else None
        if method == "GET" and request.name is None:
            return 200, self._list(rdef, namespace, request.params)
        if method == "GET":
            return 200, copy.deepcopy(self._get(rdef, namespace, request.name))
        if method == "POST" and request.name is None:
            return 201, self._create(rdef, namespace, self._body(request))
        if method == "PATCH" and request.name:
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            return 200, self._patch(rdef, namespace, request.name, request.subresource, ctype, self._body(request))
        if method == "PUT" and request.name:
            return 200, self._replace(rdef, namespace, request.name, request.subresource, self._body(request))
        if method == "DELETE" and request.name:
            graceful = request.params.get("gracePeriodSeconds") != "0"
            return 200, self._delete(rdef, namespace, request.name, self._propagation(request), graceful=graceful)
        if method == "DELETE":
            return 200, self._delete_collection(rdef, namespace, request.params, self._propagation(request))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    @staticmethod
    def _body(request: rendering.Request) -> Any:
        if request.data is None:
            raise ApiError(400, "BadRequest", "the request body is not JSON")
        return copy.deepcopy(request.data)

    @staticmethod
    def _propagation(request: rendering.Request) -> str:
        body = request.data if isinstance(request.data, dict) else {}
        return request.params.get("propagationPolicy") or body.get("propagationPolicy") or "Background"

    # --- storage -----------------------------------------------------------------------------------------------
    def _key(self, rdef: ResourceDef, namespace: str | None, name: str) -> tuple[str, str | None, str]:
        return (rdef.key, namespace if rdef.namespaced else None, name)

    def _get(self, rdef: ResourceDef, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.store.get(self._key(rdef, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{rdef.plural} "{name}" not found')
        return obj

    def _list(self, rdef: ResourceDef, namespace: str | None, params: dict[str, str]) -> dict[str, Any]:
        labels = parse_label_selector(params.get("labelSelector"))
        fields = parse_field_selector(params.get("fieldSelector"), rdef)
        items = [copy.deepcopy(obj) for obj in self._objects_of(rdef, namespace)
                 if labels(obj["metadata"].get("labels") or {}) and fields(obj)]
        return {"apiVersion": rdef.api_version, "kind": f"{rdef.kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _objects_of(self, rdef: ResourceDef, namespace: str | None) -> list[dict[str, Any]]:
        return [obj for (key, ns, _), obj in self.store.items()
                if key == rdef.key and (namespace is None or ns == namespace)]

    def _commit(self, rdef: ResourceDef, event_type: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = self._key(rdef, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if event_type == "DELETED":
            self.store.pop(key, None)
            self._live_uids.discard(obj["metadata"]["uid"])
        else:
            self.store[key] = obj
            self._live_uids.add(obj["metadata"]["uid"])
        event = {"type": event_type, "object": copy.deepcopy(obj)}
        self._history.append((self._rv, rdef, event))
        for watcher in self._watchers:
            if watcher.wants(rdef, obj):
                watcher.queue.put_nowait(event)
        return copy.deepcopy(obj)

    def _validate(self, rdef: ResourceDef, obj: dict[str, Any]) -> None:
        validator = self.validators.get(rdef.plural)
        errors = validator(obj) if validator else []
        if errors:
            raise ApiError(422, "Invalid", f'{rdef.kind} "{obj["metadata"]["name"]}" is invalid: ' + "; ".join(errors))

    def _create(self, rdef: ResourceDef, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be an object")
        meta = body.setdefault("metadata", {})
        if rdef.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the request")
            if self._key(NAMESPACES, None, namespace or "") not in self.store:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            meta["namespace"] = namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if self._key(rdef, namespace, meta["name"]) in self.store:
            raise ApiError(409, "AlreadyExists", f'{rdef.plural} "{meta["name"]}" already exists')
        body["apiVersion"], body["kind"] = rdef.api_version, rdef.kind
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if rdef == PODS:
            body["status"] = {"phase": "Pending"}
        elif "status" in rdef.subresources:
            body.pop("status", None)
        self._validate(rdef, body)
        created = self._commit(rdef, "ADDED", body)
        owners = meta.get("ownerReferences") or []
        if owners and not any(self._alive(ref["uid"]) for ref in owners):
            self._remove(rdef, body, "Background")  # its owner is already gone: the GC collects it
        return created

    def _alive(self, uid: str) -> bool:
        return uid in self._live_uids  # a set, not a scan of the store: creates stay O(1) with thousands of objects

    def _patch(self, rdef: ResourceDef, namespace: str | None, name: str, subresource: str | None,
               content_type: str, patch: Any) -> dict[str, Any]:
        current = self._get(rdef, namespace, name)
        if content_type == "application/json-patch+json":
            try:
                updated = jsonpatch.apply_patch(current, patch)
            except jsonpatch.JsonPatchTestFailed as error:
                raise ApiError(422, "Invalid", "the server rejected our request due to an error in our request: "
                               f"{error}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                raise ApiError(422, "Invalid", f"json patch: {error}") from None
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            wanted_rv = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
            if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rdef.plural} "{name}": '
                               "the object has been modified; please apply your changes to the latest version")
            updated = merge_patch(current, patch)
        else:
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format: {content_type}")
        return self._update(rdef, current, updated, subresource)

    def _replace(self, rdef: ResourceDef, namespace: str | None, name: str, subresource: str | None,
                 body: Any) -> dict[str, Any]:
        current = self._get(rdef, namespace, name)
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rdef.plural} "{name}": '
                           "the object has been modified; please apply your changes to the latest version")
        return self._update(rdef, current, body, subresource)

    def _update(self, rdef: ResourceDef, current: dict[str, Any], updated: dict[str, Any],
                subresource: str | None) -> dict[str, Any]:
        if subresource == "status":
            result = copy.deepcopy(current)
            if updated.get("status") is None:
                result.pop("status", None)
            else:
                result["status"] = updated["status"]
        else:
            result = updated
            if "status" in rdef.subresources:
                if "status" in current:
                    result["status"] = copy.deepcopy(current["status"])
                else:
                    result.pop("status", None)
        meta = result.setdefault("metadata", {})
        for field in _IMMUTABLE_META:
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
            else:
                meta.pop(field, None)
        result["apiVersion"], result["kind"] = rdef.api_version, rdef.kind
        deleting = bool(current["metadata"].get("deletionTimestamp"))
        if deleting and set(meta.get("finalizers") or []) - set(current["metadata"].get("finalizers") or []):
            raise ApiError(422, "Invalid", "metadata.finalizers: Forbidden: no new finalizers can be added if the "
                                           "object is being deleted")
        if rdef == PODS and result.get("spec") != current.get("spec"):
            raise ApiError(422, "Invalid", "spec: Forbidden: pod updates may not change fields other than a few")
        if result == current:
            return copy.deepcopy(current)  # no-op writes bump nothing
        if _body_of(result) != _body_of(current):
            meta["generation"] = current["metadata"].get("generation", 1) + 1
        self._validate(rdef, result)
        if deleting and not meta.get("finalizers"):
            return self._remove(rdef, result, "Background")
        return self._commit(rdef, "MODIFIED", result)

    def _delete(self, rdef: ResourceDef, namespace: str | None, name: str, propagation: str, *,
                graceful: bool = True) -> dict[str, Any]:
        current = self._get(rdef, namespace, name)
        if rdef == PODS and self.graceful_pod_deletion and graceful and not current["metadata"].get("finalizers"):
            if current["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(current)
            marked = copy.deepcopy(current)
            marked["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=30)
            return self._commit(rdef, "MODIFIED", marked)
        if current["metadata"].get("finalizers"):
            if current["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(current)
            marked = copy.deepcopy(current)
            marked["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            return self._commit(rdef, "MODIFIED", marked)
        return self._remove(rdef, copy.deepcopy(current), propagation)

    def _delete_collection(self, rdef: ResourceDef, namespace: str | None, params: dict[str, str],
                           propagation: str) -> dict[str, Any]:
        listed = self._list(rdef, namespace, params)
        for obj in listed["items"]:
            if self._key(rdef, obj["metadata"].get("namespace"), obj["metadata"]["name"]) in self.store:
                self._delete(rdef, obj["metadata"].get("namespace"), obj["metadata"]["name"], propagation)
        return listed

    def _remove(self, rdef: ResourceDef, obj: dict[str, Any], propagation: str) -> dict[str, Any]:
        removed = self._commit(rdef, "DELETED", obj)
        if propagation != "Orphan" and self.deferred_gc:
            self._orphaned_owners.append(obj["metadata"]["uid"])
        elif propagation != "Orphan":
            self._collect_dependents_of(obj["metadata"]["uid"])
        return removed

    def _collect_dependents_of(self, owner_uid: str) -> None:
        for (key, namespace, name), obj in list(self.store.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in owners):
                continue
            if any(self._alive(ref["uid"]) for ref in owners if ref.get("uid") != owner_uid):
                continue
            rdef = next(r for r in self.defs.values() if r.key == key)
            if (key, namespace, name) in self.store:
                self._delete(rdef, namespace, name, "Background", graceful=False)

    def history(self, rdef: ResourceDef) -> list[tuple[str, str, str]]:
        """(event type, name, uid) of every retained event of a resource, oldest first."""
        return [(event["type"], event["object"]["metadata"]["name"], event["object"]["metadata"]["uid"])
                for _, r, event in self._history if r == rdef]

    # --- watch -------------------------------------------------------------------------------------------------
    async def _watch(self, request: rendering.Request, rdef: ResourceDef) -> aiohttp.web.StreamResponse:
        if rdef.kind == "Unknown":
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({rdef.key})")
        params = request.params
        watcher = _Watcher(rdef, request.namespace if rdef.namespaced else None,
                           parse_label_selector(params.get("labelSelector")),
                           parse_field_selector(params.get("fieldSelector"), rdef), asyncio.Queue())
        since = params.get("resourceVersion")
        # The backlog and the subscription are taken together, with no await in between: no event can fall between.
        if since in (None, "", "0"):
            backlog = [{"type": "ADDED", "object": copy.deepcopy(obj)}
                       for obj in self._objects_of(rdef, watcher.namespace) if watcher.wants(rdef, obj)]
        elif self._history and int(since) < self._history[0][0] - 1:
            expired = ApiError(410, "Expired", f"too old resource version: {since}")
            backlog = [{"type": "ERROR", "object": expired.status()}]
        else:
            backlog = [event for rv, r, event in self._history if rv > int(since) and watcher.wants(r, event["object"])]
        self._watchers.append(watcher)
        timeouts = [float(params["timeoutSeconds"])] if "timeoutSeconds" in params else []
        timeouts += [self.max_watch_seconds] if self.max_watch_seconds else []
        deadline = asyncio.get_running_loop().time() + (min(timeouts) if timeouts else 3600)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            await response.prepare(request._raw_request)
            for event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        finally:
            self._watchers.remove(watcher)
        return response


def _body_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


# ---------------------------------------------------------------------------------------------------------------------
# Running it for synchronous tests, and a tiny client to drive it the way kubectl and the kubelet would
# ---------------------------------------------------------------------------------------------------------------------
class EmulatorThread:
    """Serves a KubeEmulator over HTTP on 127.0.0.1 from its own event loop thread."""

    def __init__(self, emulator: KubeEmulator):
        self.emulator = emulator
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self.url = ""

    def _run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the API emulator did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the emulator's loop (its state is not thread-safe) and return its result."""
        async def wrapper() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(10)


class KubeClient:
    """A minimal synchronous client over real HTTP (what kubectl/the kubelet would send)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url, self.timeout = url, timeout
        self.session = requests.Session()

    def path(self, rdef: ResourceDef, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        base = f"/apis/{rdef.group}/{rdef.version}" if rdef.group else f"/api/{rdef.version}"
        parts = [base] + ([f"namespaces/{namespace}"] if namespace and rdef.namespaced else []) + [rdef.plural]
        parts += [name] if name else []
        parts += [subresource] if subresource else []
        return self.url + "/".join(parts)

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        response = self.session.request(method, url, timeout=self.timeout, **kwargs)
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.json().get("reason", ""), response.text)
        return response.json()

    def get(self, rdef: ResourceDef, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self.path(rdef, namespace, name))
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    def list(self, rdef: ResourceDef, namespace: str | None = None, label_selector: str | None = None) -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else {}
        return self._call("GET", self.path(rdef, namespace), params=params)["items"]

    def create(self, rdef: ResourceDef, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self.path(rdef, namespace), json=body)

    def patch(self, rdef: ResourceDef, namespace: str | None, name: str, patch: Any, *,
              subresource: str | None = None, content_type: str = "application/merge-patch+json") -> dict[str, Any]:
        return self._call("PATCH", self.path(rdef, namespace, name, subresource), data=json.dumps(patch),
                          headers={"Content-Type": content_type})

    def delete(self, rdef: ResourceDef, namespace: str | None, name: str, *,
               grace_period_seconds: int | None = None) -> dict[str, Any]:
        params = {} if grace_period_seconds is None else {"gracePeriodSeconds": str(grace_period_seconds)}
        return self._call("DELETE", self.path(rdef, namespace, name), params=params)
