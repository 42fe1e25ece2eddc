"""The rollout server's weight-version gate: an ASGI middleware in vLLM's OpenAI server (`--middleware`).

The learner's generation requests go straight from TRL's worker to the servers (grpo_trainer.rollout.router), each
naming the least weight version the server must hold (contract.rollout_pod.MIN_WEIGHT_VERSION_HEADER): the version
every server of the pool holds since the last weight sync. The gate answers WEIGHT_REFUSED_STATUS, with the version
it holds in SERVED_WEIGHT_VERSION_HEADER, when the server holds an older one: a restarted server (it holds the model it
loaded, version 0, until the learner's catch-up loads the current weights into it), or one that missed a sync. While
a weight load is under way, from its start to the version it ends with, the gate answers LOADING_WEIGHTS: what the
server would generate then is no version at all, and a load that fails leaves it so until it is loaded again. The
router sends a refused request to another server.

The gate learns the version from the calls that change it, which pass through the same server: a load begins with
`/collective_rpc` `reload_weights` or `/v1/load_lora_adapter` and ends with `/update_weight_version` (the learner's
weight sync, grpo_trainer.rollout.weight_sync). Where vLLM runs several API processes the load may pass through
another one: a request this process would refuse as behind is checked against the engine's own version first.
A request without the header (a health probe, anyone else's) is served whatever the server holds. The check costs a
header lookup per request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..contract.codes import weight_version_name, weight_version_number
from ..contract.rollout_pod import (
    LOADING_WEIGHTS,
    MIN_WEIGHT_VERSION_HEADER,
    SERVED_WEIGHT_VERSION_HEADER,
    WEIGHT_REFUSED_STATUS,
)

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: How `--middleware` names the gate (the rollout entrypoint adds it).
IMPORT_PATH = f"{__name__}.WeightVersionGate"
_HEADER = MIN_WEIGHT_VERSION_HEADER.encode()
#: POST paths that load weights (`/collective_rpc` only for the methods named), and the one that names the version.
_LOAD_PATH = "/v1/load_lora_adapter"
_LOAD_RPC_METHODS = {"reload_weights"}
_RPC_PATH = "/collective_rpc"
_VERSION_PATH = "/update_weight_version"
_WEIGHT_PATHS = {_LOAD_PATH, _RPC_PATH, _VERSION_PATH}


class WeightVersionGate:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app
        self.version = 0  # the model the server started with (vLLM calls it "default")
        self.loading = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST":
            path = scope["path"]
            if path in _WEIGHT_PATHS:
                await self._weight_call(path, scope, receive, send)
                return
        stamp = _header(scope, _HEADER)
        if stamp is not None and not await self._holds(scope, weight_version_number(stamp)):
            await self._refuse(stamp, send)
            return
        await self.app(scope, receive, send)

    async def _holds(self, scope: Scope, needed: int) -> bool:
        if self.loading:
            return False
        if self.version >= needed:
            return True
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is None:
            return False
        try:  # another API process may have passed the update on
            self.version = max(self.version, weight_version_number(await engine.get_weight_version()))
        except Exception as error:  # noqa: BLE001 - no verdict from the engine: what this process knows stands
            logger.warning("weight-version gate: the engine's version could not be read: %s", error)
        return self.version >= needed

    async def _refuse(self, stamp: str, send: Send) -> None:
        held = LOADING_WEIGHTS if self.loading else weight_version_name(self.version)
        body = json.dumps({"error": f"this rollout server holds weights {held}; the request needs "
                                    f"{stamp} or newer"}).encode()
        await send({"type": "http.response.start", "status": WEIGHT_REFUSED_STATUS, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (SERVED_WEIGHT_VERSION_HEADER.encode(), held.encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _weight_call(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A call that may change the weights: read its body (small JSON), note what it does, pass it on."""
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {}
        payload = payload if isinstance(payload, dict) else {}

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        if path == _LOAD_PATH or (path == _RPC_PATH and payload.get("method") in _LOAD_RPC_METHODS):
            self.loading = True  # until the version it ends with is set
            await self.app(scope, replay, send)
            return
        if path != _VERSION_PATH or not isinstance(payload.get("new_version"), str):
            await self.app(scope, replay, send)
            return
        status = 0

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, replay, noting_status)
        if status == 200:
            self.version, self.loading = weight_version_number(payload["new_version"]), False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
