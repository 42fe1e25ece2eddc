"""A vLLM-shaped server in its own process, so a test can SIGSTOP it (a hung engine).

It answers `/v1/completions` and, as if it succeeded, the weight sync's calls (`/pause`, `/collective_rpc`
reload_weights, `/update_weight_version`, `/reset_prefix_cache`, `/resume`, `/health`).

`completions_server.py NAME [PORT] [--hang PATH ...] [--slow PATH ...] [--delay S] [--pause-holds]` prints its URL
on the first line of stdout and answers every completion with NAME as the text, after `--delay` seconds (0.05; a
one-token probe always after 0.05); a request to a PATH given with --hang is never answered (a server that hangs in
the weight update while the rest of it answers), one to a PATH given with --slow is answered after `SLOW_S`. Each
hung or slow request prints `began PATH` on stdout as it arrives. With --pause-holds, completions wait between
`/pause` and `/resume`, as vLLM's `pause(mode=keep)` freezes them.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

SLOW_S = 5.0


async def main(name: str, port: int, hang: frozenset[str] = frozenset(), delay_s: float = 0.05,
               pause_holds: bool = False, slow: frozenset[str] = frozenset()) -> None:
    running = asyncio.Event()
    running.set()

    async def complete(request: web.Request) -> web.Response:
        probe = (await request.json()).get("max_tokens") == 1  # the supervision's one-token probe: never delayed
        await asyncio.sleep(0.05 if probe else delay_s)
        await running.wait()
        # One token with its logprob: what TRL's rollout worker reads from vLLM's answer.
        choice = {"text": name, "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}
        return web.json_response({"choices": [choice]})

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def pause(_request: web.Request) -> web.Response:
        if pause_holds:
            running.clear()
        return web.json_response({})

    async def resume(_request: web.Request) -> web.Response:
        running.set()
        return web.json_response({})

    async def reload(_request: web.Request) -> web.Response:
        return web.json_response({"results": [None]})

    async def reset(_request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def never(request: web.Request) -> web.Response:
        print(f"began {request.path}", flush=True)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def slowly(handler):
        async def answer_late(request: web.Request) -> web.Response:
            print(f"began {request.path}", flush=True)
            await asyncio.sleep(SLOW_S)
            return await handler(request)
        return answer_late

    app = web.Application()
    posts = {"/v1/completions": complete, "/resume": resume, "/pause": pause, "/update_weight_version": ok,
             "/collective_rpc": reload, "/reset_prefix_cache": reset}
    for path, handler in posts.items():
        app.router.add_post(path, never if path in hang else slowly(handler) if path in slow else handler)
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
    parser.add_argument("--slow", action="append", default=[], help=f"a path answered after {SLOW_S:.0f} s")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds each completion (not a probe) takes")
    parser.add_argument("--pause-holds", action="store_true", help="completions wait while paused")
    args = parser.parse_args()
    asyncio.run(main(args.name, args.port, frozenset(args.hang), args.delay, args.pause_holds, frozenset(args.slow)))
