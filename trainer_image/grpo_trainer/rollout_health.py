"""Health that proves generation: a one-token completion with a timeout.

A vLLM server whose engine died keeps answering `GET /health` for a while (the API process outlives its engine), and
a hung engine answers it forever; only a generated token proves the server can serve the learner.
"""

from __future__ import annotations

import asyncio

import aiohttp

PROBE_TIMEOUT_S = 30.0
PROBE_PROMPT = [1, 2, 3]
#: The rollout server's liveness (the pod's probe, and `grporun local`'s): one generation probe every
#: LIVENESS_PERIOD_S; LIVENESS_FAILURE_THRESHOLD failures in a row (a minute and more without a token) mean hung,
#: and the server is restarted. A weight sync holds a server paused for seconds, far below that.
LIVENESS_PERIOD_S = 20
LIVENESS_FAILURE_THRESHOLD = 3


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
