"""The operator's asking of the hub for a run's commits (cluster/revisions.py), with the stand-in hub: the run's token
where the operator may read its Secret, its own where it may not (said with a refusal), the last answer kept for
RETRY_SECONDS."""

from __future__ import annotations

import asyncio
import base64

from grpo_operator.api import parse_spec
from grpo_operator.cluster.kube import APIClientError
from grpo_operator.cluster.revisions import RETRY_SECONDS, PinMemory, RevisionPinner
from grpo_operator.model_config import HubAccess
from grpo_operator.status.revision import pin_requests
from tests.support.servers.hub_server import GATED_TOKEN, commit_of
from tests.support.specs import minimal_spec


class Secrets:
    """Kube.read of Secrets: the run's, or a refusal as the chart's account gets (no Secret read granted)."""

    def __init__(self, secrets: dict[str, dict], refusal: APIClientError | None = None):
        self.secrets, self.refusal, self.reads = secrets, refusal, 0

    async def read(self, api_version, kind, namespace, name):
        self.reads += 1
        if self.refusal is not None:
            raise self.refusal
        return self.secrets.get(name)


def gated_spec():
    return parse_spec(minimal_spec(model="meta-llama/Gated-7B", inputs={"hubTokenSecret": "hf"}))


def ask(pinner, kube, spec, memory):
    return asyncio.run(pinner.answer(kube, "ns", spec, pin_requests(spec), memory))


def test_the_runs_token_reads_a_gated_model_where_the_operator_may_read_its_secret(hub):
    token = base64.b64encode(GATED_TOKEN.encode()).decode()
    pinner = RevisionPinner(HubAccess(endpoint=hub.url))
    answer = ask(pinner, Secrets({"hf": {"data": {"HF_TOKEN": token}}}), gated_spec(), PinMemory())
    assert answer.pins.commits == {"model": commit_of("meta-llama/Gated-7B", "main")} and answer.refused is None
    assert [asked for _, path, asked in hub.requests if path.startswith("/api/")] == [GATED_TOKEN]


def test_without_the_secret_the_operators_own_token_is_used_and_a_refusal_says_so(hub):
    forbidden = APIClientError({"message": "secrets \"hf\" is forbidden"}, status=403, headers={})
    answer = ask(RevisionPinner(HubAccess(endpoint=hub.url)), Secrets({}, forbidden), gated_spec(), PinMemory())
    assert answer.pins.commits == {} and answer.refused is not None
    assert answer.refused.startswith("spec.modelRevision main of model meta-llama/Gated-7B is gated")
    assert answer.refused.endswith("(the operator may not read Secret 'hf', HTTP 403, so it asked with its own token)")


def test_an_answer_serves_the_runs_passes_for_the_retry_interval(hub):
    now = [0.0]
    pinner = RevisionPinner(HubAccess(endpoint=hub.url), clock=lambda: now[0])
    kube, memory, spec = Secrets({}), PinMemory(), parse_spec(minimal_spec(model="Qwen/Qwen3-0.6B"))
    first = ask(pinner, kube, spec, memory)
    now[0] = RETRY_SECONDS - 1
    assert ask(pinner, kube, spec, memory) is first and len(hub.requests) == 1
    now[0] = RETRY_SECONDS
    ask(pinner, kube, spec, memory)
    assert len(hub.requests) == 2
