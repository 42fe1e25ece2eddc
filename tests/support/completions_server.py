"""A vLLM-shaped `/v1/completions` server in its own process, so a test can SIGSTOP it (a hung engine).

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

    async def resume(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/resume", resume)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
