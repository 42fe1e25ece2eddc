"""The rollout server's weight-version gate as vLLM's app runs it: an ASGI middleware around the server's routes.

The app behind it here answers as vLLM's routes do (the load, the version update, a completion); the real server with
the gate in it is tests/trainer/rollout/test_routing_guards.py's.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from grpo_trainer.contract.rollout_pod import (
    LOADING_WEIGHTS,
    MIN_WEIGHT_VERSION_HEADER,
    SERVED_WEIGHT_VERSION_HEADER,
    WEIGHT_REFUSED_STATUS,
)
from grpo_trainer.server.main import build_server_command
from grpo_trainer.server.version_gate import IMPORT_PATH, WeightVersionGate
from tests.trainer.server.test_main import flag, run_config


class Routes:
    """vLLM's routes, as far as the gate sees them: each POST answers 200 (or `fail` for the paths in it)."""

    def __init__(self):
        self.seen: list[str] = []
        self.fail: set[str] = set()
        self.state = type("State", (), {})()  # app.state: no engine client unless a test gives one

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append(scope["path"])
        status = 500 if scope["path"] in self.fail else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})


def call(gate: WeightVersionGate, path: str, body: dict | None = None, needs: str | None = None):
    """One POST through the gate: its status, the served-version header, and the body the app echoed."""
    headers = [(b"content-type", b"application/json")]
    if needs is not None:
        headers.append((MIN_WEIGHT_VERSION_HEADER.encode(), needs.encode()))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "app": gate.app}
    data = json.dumps(body or {}).encode()
    chunks = [{"type": "http.request", "body": data[:5], "more_body": True},
              {"type": "http.request", "body": data[5:], "more_body": False}]
    sent = []

    async def receive():
        return chunks.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    start = sent[0]
    served = dict(start["headers"]).get(SERVED_WEIGHT_VERSION_HEADER.encode())
    return start["status"], served and served.decode(), b"".join(m.get("body", b"") for m in sent[1:])


def load(gate: WeightVersionGate, version: str) -> None:
    """The learner's weight sync on one server: the reload, then the version it ends with."""
    assert call(gate, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w"}})[0] == 200
    assert call(gate, "/update_weight_version", {"new_version": version})[0] == 200


def test_a_fresh_server_serves_requests_without_a_version_and_those_naming_none_newer_than_its_own():
    routes = Routes()
    gate = WeightVersionGate(routes)
    assert call(gate, "/v1/completions", {"prompt": [1]})[0] == 200  # a probe, anyone else's request
    assert call(gate, "/v1/completions", {"prompt": [1]}, needs="v0")[0] == 200
    status, served, body = call(gate, "/v1/completions", {"prompt": [1]}, needs="v3")
    assert (status, served) == (WEIGHT_REFUSED_STATUS, "v0") and b"holds weights v0" in body
    assert routes.seen == ["/v1/completions", "/v1/completions"]  # the refused one never reached vLLM


def test_a_load_refuses_stamped_requests_from_its_start_to_the_version_it_ends_with():
    routes = Routes()
    gate = WeightVersionGate(routes)
    load(gate, "v3")
    assert call(gate, "/v1/completions", needs="v3")[0] == 200
    assert call(gate, "/v1/completions", needs="v2")[0] == 200  # sent just before the sync ended: older is fine
    # The next sync's reload went through; its version is not set yet.
    assert call(gate, "/collective_rpc", {"method": "reload_weights", "kwargs": {}})[0] == 200
    assert call(gate, "/v1/completions", needs="v3")[:2] == (WEIGHT_REFUSED_STATUS, LOADING_WEIGHTS)
    assert call(gate, "/v1/completions")[0] == 200  # an unstamped request: whatever the server holds
    assert call(gate, "/update_weight_version", {"new_version": "v4"})[0] == 200
    assert call(gate, "/v1/completions", needs="v4")[0] == 200
    # The body reached vLLM whole, after the gate read it.
    assert json.loads(call(gate, "/update_weight_version", {"new_version": "v4"})[2]) == {"new_version": "v4"}


def test_a_failed_load_leaves_the_server_refusing_until_it_is_loaded_again():
    routes = Routes()
    gate = WeightVersionGate(routes)
    load(gate, "v2")
    routes.fail = {"/collective_rpc"}
    assert call(gate, "/collective_rpc", {"method": "reload_weights"})[0] == 500
    assert call(gate, "/v1/completions", needs="v2")[1] == LOADING_WEIGHTS  # half-loaded weights are no version
    routes.fail = set()
    load(gate, "v3")  # its catch-up
    assert call(gate, "/v1/completions", needs="v3")[0] == 200


def test_an_adapter_load_counts_as_a_load_and_other_rpcs_do_not():
    gate = WeightVersionGate(Routes())
    load(gate, "v1")
    assert call(gate, "/collective_rpc", {"method": "get_model_info"})[0] == 200
    assert call(gate, "/v1/completions", needs="v1")[0] == 200
    assert call(gate, "/v1/load_lora_adapter", {"lora_name": "policy-v2", "lora_path": "/w/v2"})[0] == 200
    assert call(gate, "/v1/completions", needs="v1")[1] == LOADING_WEIGHTS
    assert call(gate, "/update_weight_version", {"new_version": "v2"})[0] == 200
    assert call(gate, "/v1/completions", needs="v2")[0] == 200


def test_a_version_another_api_process_set_is_read_from_the_engine_before_a_refusal():
    class Engine:
        version = "v5"

        async def get_weight_version(self):
            return self.version

    routes = Routes()
    routes.state.engine_client = Engine()
    gate = WeightVersionGate(routes)  # this process saw no load: the update went through another one
    assert call(gate, "/v1/completions", needs="v5")[0] == 200
    assert call(gate, "/v1/completions", needs="v6")[:2] == (WEIGHT_REFUSED_STATUS, "v5")


@pytest.mark.parametrize("training", [{}, {"lora": {"r": 8}}], ids=["whole-weights", "adapter"])
def test_the_rollout_entrypoint_puts_the_gate_in_vllms_app(training):
    argv, _ = build_server_command(run_config(training=training, device="cpu",
                                              weightSync={"mode": "filesystem", "directory": "/w"}))
    assert flag(argv, "--middleware") == IMPORT_PATH == "grpo_trainer.server.version_gate.WeightVersionGate"
