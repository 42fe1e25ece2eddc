"""A vLLM-shaped server in its own process, so a test can SIGSTOP it (a hung engine).

It answers `/v1/completions` and, as if it succeeded, the weight sync's calls (`/pause`, `/collective_rpc`
reload_weights, `/update_weight_version`, `/reset_prefix_cache`, `/resume`, `/health`).

`completions_server.py NAME [PORT] [--hang PATH ...]` prints its URL on the first line of stdout and answers every
completion with NAME as the text; a request to a PATH given with --hang is never answered (a server that hangs in
the weight update while the rest of it answers).
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web


async def main(name: str, port: int, hang: frozenset[str] = frozenset()) -> None:
    async def complete(_request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response({"choices": [{"text": name, "token_ids": [1]}]})

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def reload(_request: web.Request) -> web.Response:
        return web.json_response({"results": [None]})

    async def reset(_request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def never(_request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    posts = {"/v1/completions": complete, "/resume": ok, "/pause": ok, "/update_weight_version": ok,
             "/collective_rpc": reload, "/reset_prefix_cache": reset}
    for path, handler in posts.items():
        app.router.add_post(path, never if path in hang else handler)
    app.router.add_get("/health", never if "/health" in hang else ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("port", type=int, nargs="?", default=0)
    parser.add_argument("--hang", action="append", default=[], help="a path never answered")
    args = parser.parse_args()
    asyncio.run(main(args.name, args.port, frozenset(args.hang)))
