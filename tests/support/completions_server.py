"""A vLLM-shaped server in its own process, so a test can SIGSTOP it (a hung engine).

It answers `/v1/completions` and, as if it succeeded, the weight sync's calls (`/pause`, `/collective_rpc`
reload_weights, `/update_weight_version`, `/reset_prefix_cache`, `/resume`, `/health`).

`completions_server.py NAME [PORT]` prints its URL on the first line of stdout and answers every completion with
NAME as the text.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web


async def main(name: str, port: int) -> None:
    async def complete(_request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response({"choices": [{"text": name, "token_ids": [1]}]})

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def reload(_request: web.Request) -> web.Response:
        return web.json_response({"results": [None]})

    async def reset(_request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    for path in ("/resume", "/pause", "/update_weight_version"):
        app.router.add_post(path, ok)
    app.router.add_get("/health", ok)
    app.router.add_post("/collective_rpc", reload)
    app.router.add_post("/reset_prefix_cache", reset)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
