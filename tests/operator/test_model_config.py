"""The model's config.json for the fit check: read from a local directory, or fetched alone from a hub (the stand-in
on loopback, tests/support/servers/hub_server.py) at the run's revision with its token; a hub that cannot be reached,
refused or silent, skips the check with the reason within the timeout."""

from __future__ import annotations

import json

import pytest

from grpo_operator.model_config import HubAccess, read_model_config
from tests.support.ports import LOOPBACK, free_port
from tests.support.servers.hub_server import GATED_TOKEN, QWEN25_7B, silent_endpoint

CONFIG_PATH = "/Qwen/Qwen2.5-7B/resolve/{}/config.json"


def test_a_local_directory_is_read_and_a_relative_one_only_from_the_manifests_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN25_7B))
    offline = HubAccess(endpoint=f"http://{LOOPBACK}:{free_port()}")  # never asked: the paths are local
    assert read_model_config(str(tmp_path / "m"), offline) == (QWEN25_7B, "")
    assert read_model_config("./m", offline, tmp_path) == (QWEN25_7B, "")  # relative to the manifest's folder
    assert read_model_config("./m", offline) == (None, "spec.model ./m: no such directory here")  # the operator
    assert read_model_config(str(tmp_path / "gone"), offline) == (
        None, f"spec.model {tmp_path / 'gone'}: no such directory here")
    (tmp_path / "m" / "config.json").write_text("{")
    config, why = read_model_config(str(tmp_path / "m"), offline)
    assert config is None and why.startswith(f"spec.model {tmp_path / 'm'}: cannot read config.json (")
    assert read_model_config("s3://models/qwen", offline) == (
        None, "spec.model s3://models/qwen is in an object store; its config.json is read from a local path or the hub")


def test_a_hub_model_is_fetched_alone_at_its_revision(hub):
    endpoint = hub.url
    assert read_model_config("Qwen/Qwen2.5-7B", HubAccess(endpoint=endpoint)) == (QWEN25_7B, "")
    assert read_model_config("Qwen/Qwen2.5-7B", HubAccess(endpoint=endpoint, revision="v1.0")) == (QWEN25_7B, "")
    # Nothing but config.json was asked for, at the revision given (main without one).
    assert {(method, path) for method, path, _ in hub.requests} == {
        ("HEAD", CONFIG_PATH.format("main")), ("GET", CONFIG_PATH.format("main")),
        ("HEAD", CONFIG_PATH.format("v1.0")), ("GET", CONFIG_PATH.format("v1.0"))}


@pytest.mark.parametrize(("model", "access", "why"), [
    ("Qwen/Qwen2.5-7B", {"revision": "v9"}, "spec.model Qwen/Qwen2.5-7B (revision v9): the hub has no such revision"),
    ("Qwen/Nope", {}, "spec.model Qwen/Nope: the hub has no such model (or it is private, and no token that may read "
                      "it was given)"),
    ("meta-llama/Gated-7B", {}, "spec.model meta-llama/Gated-7B is gated, and the hub refused its config.json without "
                                "a token that may read it (HF_TOKEN)"),
    ("meta-llama/Gated-7B", {"token": "hf_wrong"}, "spec.model meta-llama/Gated-7B is gated, and the hub refused its "
                                                   "config.json without a token that may read it (HF_TOKEN)"),
    ("not a repo!", {}, "spec.model not a repo!: neither a directory here nor a hub id"),
])
def test_what_the_hub_answered_is_the_reason(hub, model, access, why):
    assert read_model_config(model, HubAccess(endpoint=hub.url, **access)) == (None, why)


def test_a_gated_model_is_read_with_the_token(hub):
    assert read_model_config("meta-llama/Gated-7B", HubAccess(endpoint=hub.url, token=GATED_TOKEN)) == (QWEN25_7B, "")
    assert {token for _, _, token in hub.requests} == {GATED_TOKEN}


def test_hf_token_is_the_default_token(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    assert read_model_config("meta-llama/Gated-7B", HubAccess(endpoint=hub.url)) == (QWEN25_7B, "")


@pytest.mark.timeout(60)
def test_a_hub_that_cannot_be_reached_is_a_reason_not_a_hang():
    refused = f"http://{LOOPBACK}:{free_port()}"  # nothing listens there
    config, why = read_model_config("Qwen/Qwen2.5-7B", HubAccess(endpoint=refused))
    assert config is None and why.startswith("spec.model Qwen/Qwen2.5-7B: the hub cannot be reached (ConnectError")
    with silent_endpoint() as silent:  # accepts, never answers: the timeout ends the wait
        config, why = read_model_config("Qwen/Qwen2.5-7B", HubAccess(endpoint=silent, timeout=1.0))
    assert (config, why) == (None, "spec.model Qwen/Qwen2.5-7B: the hub cannot be reached (ReadTimeout: timed out)")
