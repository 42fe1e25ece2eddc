"""Health that proves generation: a one-token completion with a timeout.

A vLLM server whose engine died keeps answering `GET /health` for a while (the API process outlives its engine), and
a hung engine answers it forever; only a generated token proves the server can serve the learner.
"""

from __future__ import annotations

import asyncio

import aiohttp

from ..contract.rollout_pod import HEALTH_REQUEST_TIMEOUT_S, PROBE_TIMEOUT_S, STARTUP_POLL_S, STARTUP_WAIT_S

#: What the probe asks to complete: any three token ids the model has.
PROBE_PROMPT = [1, 2, 3]


async def generation_probe(
    session: aiohttp.ClientSession, url: str, model: str, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """None when `url` generated one token within `timeout_s`; otherwise why not, in one line."""
    payload = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        async with session.post(f"{url}/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.text())[:200]}"
            answer = await response.json()
    except TimeoutError:
        return f"no token within {timeout_s:.0f}s"
    except (aiohttp.ClientError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return None if choices else f"no completion in the answer: {str(answer)[:200]}"


def probe_generation(url: str, model: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """`generation_probe` for callers without an event loop (the pod's liveness command, `grporun local`)."""
    async def once() -> str | None:
        async with aiohttp.ClientSession() as session:
            return await generation_probe(session, url, model, timeout_s)

    return asyncio.run(once())


def wait_healthy(url: str, timeout_s: float = STARTUP_WAIT_S) -> str | None:
    """None as soon as `url`'s `/health` answers 200 (the server has loaded its model); after `timeout_s` without
    that, why not, in one line."""
    async def poll() -> str | None:
        loop = asyncio.get_running_loop()
        deadline, last = loop.time() + timeout_s, "no answer yet"
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(f"{url}/health",
                                           timeout=aiohttp.ClientTimeout(total=HEALTH_REQUEST_TIMEOUT_S)) as response:
                        if response.status == 200:
                            return None
                        last = f"HTTP {response.status}"
                except (aiohttp.ClientError, TimeoutError) as error:
                    last = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                if loop.time() + STARTUP_POLL_S > deadline:
                    return f"/health did not answer within {timeout_s:.0f}s ({last})"
                await asyncio.sleep(STARTUP_POLL_S)

    return asyncio.run(poll())
