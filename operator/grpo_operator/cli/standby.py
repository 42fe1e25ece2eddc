"""The liveness endpoint of a replica waiting for the Lease: kopf serves it once it runs, and the kubelet would
otherwise restart a healthy standby every few probes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import aiohttp.web


@contextlib.asynccontextmanager
async def standby_liveness(endpoint: str | None) -> AsyncIterator[None]:
    """Answer `endpoint` (kopf's --liveness URL form) with 200 until the block ends; nothing when it is None."""
    if endpoint is None:
        yield
        return
    url = urlparse(endpoint)

    async def healthy(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get(url.path or "/", healthy)
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, url.hostname, url.port or 80, reuse_address=True).start()
    try:
        yield
    finally:
        await runner.cleanup()  # frees the port for kopf's own endpoint
