"""The hub's commits for a run's revisions not pinned yet, asked by the operator before the run's first pod (I/O;
status/revision.py decides what is pinned and what the run does meanwhile).

One bounded request per repository (model_config.resolve_commit), off the event loop. The hub is asked with the
run's token (the `HF_TOKEN` key of spec.inputs.hubTokenSecret) when the operator may read that Secret, else with its
own (its HF_TOKEN, if any): a gated model the operator cannot see then fails the run with the reason, and a commit
in spec.modelRevision needs no hub at all. While the hub cannot be reached, it is asked again every RETRY_SECONDS
(the run's passes in between carry the last answer), so a hub that hangs costs one timeout per interval, not one
per pass.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import os
import time
from collections.abc import Callable

import aiohttp

from grpo_trainer.contract.pod_env import HUB_TOKEN_ENV

from ..api import GRPORunSpec
from ..model_config import HUB_ENDPOINT_ENV, HubAccess, resolve_commit
from ..status.revision import HubPins, PinKind, PinRequest
from .kube import APIClientError, Kube

#: Seconds between two askings of the hub for a run whose commits it has not named.
RETRY_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class HubAnswer:
    """What the hub answered for a run: the commits and why not (the pass's Observation.pins), and a revision it
    refused for good (no such repository or revision, or gated): the run's spec error."""

    pins: HubPins
    refused: str | None = None


@dataclasses.dataclass
class PinMemory:
    """A run's last answer from the hub, and when it was asked (the operator's clock)."""

    answer: HubAnswer | None = None
    asked_at: float | None = None


class RevisionPinner:
    """Asks the hub (`hub`: its endpoint and the operator's own token) for runs' commits."""

    def __init__(self, hub: HubAccess | None = None, clock: Callable[[], float] = time.monotonic):
        self.hub = hub or HubAccess(endpoint=os.environ.get(HUB_ENDPOINT_ENV))
        self.clock = clock

    async def answer(self, kube: Kube, namespace: str, spec: GRPORunSpec, requests: list[PinRequest],
                     memory: PinMemory) -> HubAnswer:
        """The commits of `requests` (the run's revisions not pinned yet), asked now or kept from the last asking
        within RETRY_SECONDS."""
        now = self.clock()
        if memory.answer is not None and memory.asked_at is not None and now - memory.asked_at < RETRY_SECONDS:
            return memory.answer
        token, note = await self._token(kube, namespace, spec)
        commits: dict[PinKind, str] = {}
        waiting: list[str] = []
        refused = None
        for request in requests:
            access = dataclasses.replace(self.hub, revision=request.requested, token=token or self.hub.token)
            commit, failure = await asyncio.to_thread(resolve_commit, request.name, request.kind, request.field,
                                                      access)
            if commit is not None:
                commits[request.kind] = commit
            elif failure is not None and failure.transient:
                waiting.append(failure.why)
            elif failure is not None and refused is None:
                refused = failure.why + note
        memory.answer, memory.asked_at = HubAnswer(HubPins(commits, "; ".join(waiting) or None), refused), now
        return memory.answer

    async def _token(self, kube: Kube, namespace: str, spec: GRPORunSpec) -> tuple[str | None, str]:
        """The run's hub token, or None and why the operator's own is used instead (said with a refusal)."""
        secret = spec.inputs.hub_token_secret if spec.inputs is not None else None
        if secret is None:
            return None, ""
        try:
            found = await kube.read("v1", "Secret", namespace, secret)
        except APIClientError as error:
            return None, (f" (the operator may not read Secret {secret!r}, HTTP {error.status}, so it asked with its "
                          "own token)")
        except (aiohttp.ClientError, TimeoutError) as error:
            return None, f" (Secret {secret!r} could not be read: {type(error).__name__}, so the operator's own token)"
        encoded = ((found or {}).get("data") or {}).get(HUB_TOKEN_ENV)
        if not encoded:
            return None, f" (Secret {secret!r} has no {HUB_TOKEN_ENV}, so the operator asked with its own token)"
        try:
            return base64.b64decode(encoded).decode().strip() or None, ""
        except (binascii.Error, UnicodeDecodeError):
            return None, f" (Secret {secret!r}: its {HUB_TOKEN_ENV} is not base64 text)"
