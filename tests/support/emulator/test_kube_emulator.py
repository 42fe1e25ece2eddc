"""The API emulator's realism layer (tests/support/emulator/kube_emulator.py): the semantics kopf relies on, and a guard
that fails when a kmock or kopf upgrade changes the internals the layer and grpo_operator.cluster.kube use."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
from collections.abc import Iterator

import kmock
import pytest
import requests

from tests.support.emulator.kube_emulator import (
    GRPORUNS,
    KMOCK_VERSION,
    NAMESPACES,
    PODS,
    ApiError,
    EmulatorThread,
    KubeClient,
    KubeEmulator,
    parse_label_selector,
    parse_resource_path,
)


@pytest.fixture()
def api() -> Iterator[KubeClient]:
    thread = EmulatorThread(KubeEmulator()).start()
    client = KubeClient(thread.url)
    client.emulator = thread.emulator
    yield client
    thread.stop()


def owned_pod(name: str, owner: dict, labels: dict | None = None) -> dict:
    return {"metadata": {"name": name, "labels": labels or {}, "ownerReferences": [{
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"], "controller": True}]}, "spec": {"containers": [{"name": "c", "image": "i"}]}}


def watch(api: KubeClient, rdef, **params) -> list[dict]:
    query = {"watch": "true", "timeoutSeconds": "1", **params}
    with requests.get(api.path(rdef, "default"), params=query, stream=True, timeout=10) as response:
        return [json.loads(line) for line in response.iter_lines() if line]


# --- the pins ---------------------------------------------------------------------------------------------------
def test_kmock_and_kopf_versions_and_internals_the_layer_relies_on():
    assert importlib.metadata.version("kmock") == KMOCK_VERSION
    assert importlib.metadata.version("kopf") == "1.45.2"
    from kmock._internal import rendering
    fields = {a.name for a in rendering.Request.__attrs_attrs__}
    assert {"id", "method", "url", "params", "headers", "body", "text", "data", "resource", "namespace", "name",
            "subresource", "_raw_request"} <= fields
    for name in ("__call__", "_handle", "_render_error", "_serve_version", "_serve_group", "_serve_apis"):
        assert callable(getattr(kmock.KubernetesEmulator, name)), name
    assert isinstance(kmock.KubernetesEmulator()._requests, list)
    assert {"namespaced", "kind", "singular", "verbs", "subresources"} <= {
        a.name for a in kmock.ResourceInfo.__attrs_attrs__}
    from kopf._cogs.clients import api, errors
    for verb in ("get", "post", "patch", "delete"):
        assert {"url", "settings", "payload", "logger"} <= set(inspect.signature(getattr(api, verb)).parameters)
    assert {"method", "url", "settings", "timeout", "backoffs", "logger"} <= set(
        inspect.signature(api.request).parameters)  # Kube.list: one request, its own timeout, no retries
    for error in ("APIError", "APIClientError", "APIConflictError", "APINotFoundError"):
        assert issubclass(getattr(errors, error), Exception)
    from kopf._cogs.structs.credentials import Vault
    assert Vault({"x": __import__("kopf").ConnectionInfo(server="http://127.0.0.1:1")}) is not None


# --- paths, discovery, selectors --------------------------------------------------------------------------------
def test_resource_paths_parse_including_the_namespaces_resource_kmock_trips_on():
    assert parse_resource_path("/api/v1/namespaces") == ("", "v1", "namespaces", None, None, None)
    assert parse_resource_path("/api/v1/namespaces/default") == ("", "v1", "namespaces", None, "default", None)
    assert parse_resource_path("/api/v1/namespaces/ns/pods/p/status") == ("", "v1", "pods", "ns", "p", "status")
    assert parse_resource_path("/apis/grpo.dev/v1alpha1/grporuns") == ("grpo.dev", "v1alpha1", "grporuns", None,
                                                                     None, None)
    assert parse_resource_path("/apis/grpo.dev/v1alpha1") is None


def test_discovery_declares_namespaced_resources_verbs_and_the_status_subresource(api):
    resources = requests.get(api.url + "/apis/grpo.dev/v1alpha1", timeout=5).json()["resources"]
    by_name = {r["name"]: r for r in resources}
    assert by_name["grporuns"]["namespaced"] is True and "grporuns/status" in by_name
    assert {"list", "watch", "patch"} <= set(by_name["grporuns"]["verbs"])
    core_document = requests.get(api.url + "/api/v1", timeout=5).json()
    assert core_document["groupVersion"] == "v1"
    core = {r["name"]: r for r in core_document["resources"]}
    assert {"namespaces", "pods", "pods/status", "services", "configmaps", "events"} <= set(core)
    assert core["namespaces"]["namespaced"] is False
    assert [n["metadata"]["name"] for n in api.list(NAMESPACES)] == ["default"]


def test_label_selectors():
    match = parse_label_selector("a=1,b!=2,c in (x, y),d notin (z),e,!f")
    assert match({"a": "1", "b": "3", "c": "x", "d": "q", "e": ""})
    assert not match({"a": "1", "b": "2", "c": "x", "e": ""})
    assert not match({"a": "1", "c": "x", "e": "", "f": "1"})
    with pytest.raises(ApiError):
        parse_label_selector("a in (b")


def test_list_filters_by_label_selector(api):
    run = api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    api.create(PODS, "default", owned_pod("a", run, {"role": "learner"}))
    api.create(PODS, "default", owned_pod("b", run, {"role": "rollout"}))
    assert [p["metadata"]["name"] for p in api.list(PODS, "default", "role=learner")] == ["a"]
    assert [p["metadata"]["name"] for p in api.list(PODS, "default", "role in (learner,rollout)")] == ["a", "b"]


# --- writes -----------------------------------------------------------------------------------------------------
def test_writes_set_uid_resource_version_and_generation_and_no_op_writes_bump_nothing(api):
    created = api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {"x": 1}})
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"]
    labelled = api.patch(GRPORUNS, "default", "r", {"metadata": {"labels": {"a": "b"}}})
    assert int(labelled["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert labelled["metadata"]["generation"] == 1  # metadata is not spec
    changed = api.patch(GRPORUNS, "default", "r", {"spec": {"x": 2}})
    assert changed["metadata"]["generation"] == 2
    same = api.patch(GRPORUNS, "default", "r", {"spec": {"x": 2}})
    assert same["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as conflict:
        api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    assert conflict.value.code == 409
    with pytest.raises(ApiError) as missing_namespace:
        api.create(GRPORUNS, "nowhere", {"metadata": {"name": "r"}, "spec": {}})
    assert missing_namespace.value.code == 404


def test_status_subresource_takes_only_status_and_the_object_ignores_status(api):
    api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {"x": 1}, "status": {"phase": "Forged"}})
    assert "status" not in api.get(GRPORUNS, "default", "r")
    written = api.patch(GRPORUNS, "default", "r", {"spec": {"x": 9}, "status": {"phase": "Running"}},
                        subresource="status")
    assert written["spec"] == {"x": 1} and written["status"] == {"phase": "Running"}
    written = api.patch(GRPORUNS, "default", "r", {"spec": {"x": 2}, "status": {"phase": "Forged"}})
    assert written["spec"] == {"x": 2} and written["status"] == {"phase": "Running"}


def test_a_failed_json_patch_test_is_422_and_changes_nothing(api):
    created = api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
             {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    with pytest.raises(ApiError) as rejected:
        api.patch(GRPORUNS, "default", "r", stale, content_type="application/json-patch+json")
    assert rejected.value.code == 422
    fresh = [{**stale[0], "value": created["metadata"]["resourceVersion"]}, stale[1]]
    patched = api.patch(GRPORUNS, "default", "r", fresh, content_type="application/json-patch+json")
    assert patched["metadata"]["finalizers"] == ["x"]
    with pytest.raises(ApiError) as unsupported:
        api.patch(GRPORUNS, "default", "r", {}, content_type="application/apply-patch+yaml")
    assert unsupported.value.code == 415


def test_finalizers_hold_deletion_until_removed(api):
    api.create(GRPORUNS, "default", {"metadata": {"name": "r", "finalizers": ["grpo.dev/finalizer"]}, "spec": {}})
    marked = api.delete(GRPORUNS, "default", "r")
    assert marked["metadata"]["deletionTimestamp"]
    assert api.get(GRPORUNS, "default", "r") is not None
    with pytest.raises(ApiError) as refused:
        api.patch(GRPORUNS, "default", "r", {"metadata": {"finalizers": ["grpo.dev/finalizer", "more"]}})
    assert refused.value.code == 422
    api.patch(GRPORUNS, "default", "r", {"metadata": {"finalizers": None}})
    assert api.get(GRPORUNS, "default", "r") is None


def test_deleting_an_owner_collects_its_dependents(api):
    run = api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    other = api.create(GRPORUNS, "default", {"metadata": {"name": "o"}, "spec": {}})
    api.create(PODS, "default", owned_pod("mine", run))
    shared = owned_pod("shared", run)
    shared["metadata"]["ownerReferences"].append({**shared["metadata"]["ownerReferences"][0], "name": "o",
                                                  "uid": other["metadata"]["uid"], "controller": False})
    api.create(PODS, "default", shared)
    api.delete(GRPORUNS, "default", "r")
    assert api.get(PODS, "default", "mine") is None
    assert api.get(PODS, "default", "shared") is not None  # another owner is alive
    api.delete(GRPORUNS, "default", "o")
    assert api.get(PODS, "default", "shared") is None
    orphan = api.create(PODS, "default", owned_pod("late", run))  # its owner is gone already
    assert orphan["metadata"]["name"] == "late" and api.get(PODS, "default", "late") is None


def test_pod_spec_is_immutable_and_pod_status_is_the_kubelets(api):
    run = api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    created = api.create(PODS, "default", owned_pod("p", run))
    assert created["status"] == {"phase": "Pending"}
    with pytest.raises(ApiError) as refused:
        api.patch(PODS, "default", "p", {"spec": {"containers": [{"name": "c", "image": "other"}]}})
    assert refused.value.code == 422
    running = api.patch(PODS, "default", "p", {"status": {"phase": "Running"}}, subresource="status")
    assert running["status"]["phase"] == "Running"


# --- watches ----------------------------------------------------------------------------------------------------
def test_a_watch_resumed_from_a_resource_version_misses_nothing(api):
    first = api.create(GRPORUNS, "default", {"metadata": {"name": "a"}, "spec": {}})
    since = first["metadata"]["resourceVersion"]
    api.create(GRPORUNS, "default", {"metadata": {"name": "b"}, "spec": {}})
    api.patch(GRPORUNS, "default", "a", {"spec": {"x": 1}})
    api.delete(GRPORUNS, "default", "b")
    events = watch(api, GRPORUNS, resourceVersion=since)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)


def test_a_watch_without_a_version_starts_with_the_current_objects(api):
    api.create(GRPORUNS, "default", {"metadata": {"name": "a"}, "spec": {}})
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in watch(api, GRPORUNS)] == [("ADDED", "a")]


def test_a_watch_from_a_version_older_than_the_history_is_gone():
    thread = EmulatorThread(KubeEmulator(history_limit=3)).start()
    try:
        api = KubeClient(thread.url)
        first = api.create(GRPORUNS, "default", {"metadata": {"name": "a"}, "spec": {}})
        for value in range(4):
            api.patch(GRPORUNS, "default", "a", {"spec": {"x": value}})
        (event,) = watch(api, GRPORUNS, resourceVersion=first["metadata"]["resourceVersion"])
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
    finally:
        thread.stop()


def test_every_request_is_recorded_with_its_rbac_verb(api):
    api.create(GRPORUNS, "default", {"metadata": {"name": "r"}, "spec": {}})
    api.patch(GRPORUNS, "default", "r", {"status": {"phase": "Running"}}, subresource="status")
    api.list(PODS, "default", "a=b")
    watch(api, GRPORUNS)
    api.delete(GRPORUNS, "default", "r")
    log = [(r.method, r.path, r.verb, r.rbac_resource) for r in api.emulator.request_log]
    assert log == [
        ("POST", "/apis/grpo.dev/v1alpha1/namespaces/default/grporuns", "create", "grporuns"),
        ("PATCH", "/apis/grpo.dev/v1alpha1/namespaces/default/grporuns/r/status", "patch", "grporuns/status"),
        ("GET", "/api/v1/namespaces/default/pods", "list", "pods"),
        ("GET", "/apis/grpo.dev/v1alpha1/namespaces/default/grporuns", "watch", "grporuns"),
        ("DELETE", "/apis/grpo.dev/v1alpha1/namespaces/default/grporuns/r", "delete", "grporuns"),
    ]
    assert api.emulator.request_log[2].query == {"labelSelector": "a=b"}
