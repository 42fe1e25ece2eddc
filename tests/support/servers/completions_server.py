"""A vLLM-shaped server in its own process, so a test can SIGSTOP it (a hung engine).

It answers `/v1/completions` and, as if it succeeded, the weight sync's calls (`/pause`, `/collective_rpc`
reload_weights, `/update_weight_version`, `/reset_prefix_cache`, `/resume`, `/health`).

`completions_server.py NAME [PORT] [--hang PATH ...] [--slow PATH ...] [--delay S] [--pause-holds]
[--random-tokens LOW:HIGH [--logprob L]] [--verify-reload]` prints its URL on the first line of stdout and answers
every completion with NAME as the text, after `--delay` seconds (0.05; a one-token probe always after 0.05); a
request to a PATH given with --hang is never answered (a server that hangs in the weight update while the rest of it
answers), one to a PATH given with --slow is answered after `SLOW_S`. Each hung or slow request prints `began PATH`
on stdout as it arrives. With --pause-holds, completions wait between `/pause` and `/resume`, as vLLM's
`pause(mode=keep)` freezes them.

The completion is token 1 alone, unless --random-tokens: then `max_tokens` ids drawn uniformly from [LOW, HIGH) with
the request's seed, each with logprob L (a random model's is about -ln(vocabulary)), so rewards vary within a group
and a learner trains on them. With --verify-reload, a `reload_weights` call is answered only after the safetensors
files in its `weights_path` are read (their tensors counted, `reloaded PATH N` on stdout); a folder without any is a
500, as vLLM fails a reload it cannot read.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

SLOW_S = 5.0


@dataclass(frozen=True)
class Completions:
    """What a completion holds: token 1 alone, or `max_tokens` ids drawn from `tokens` (range(LOW, HIGH))."""

    tokens: range | None = None
    logprob: float = -1.0

    def answer(self, request: dict) -> tuple[list[int], list[float]]:
        if self.tokens is None:
            return [1], [self.logprob]
        draw = random.Random(request.get("seed"))
        ids = [draw.choice(self.tokens) for _ in range(int(request.get("max_tokens") or 1))]
        return ids, [self.logprob] * len(ids)


def tensors_in(folder: str) -> int:
    """The tensors of the safetensors files in `folder` (their headers read, as a reload opens them); 0 for none."""
    from safetensors import safe_open

    count = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as checkpoint:
            count += len(list(checkpoint.keys()))
    return count


async def main(name: str, port: int, hang: frozenset[str] = frozenset(), delay_s: float = 0.05,
               pause_holds: bool = False, slow: frozenset[str] = frozenset(),
               completions: Completions = Completions(), verify_reload: bool = False) -> None:
    running = asyncio.Event()
    running.set()

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        probe = body.get("max_tokens") == 1  # the supervision's one-token probe: never delayed
        await asyncio.sleep(0.05 if probe else delay_s)
        await running.wait()
        # Token ids with their logprobs: what TRL's rollout worker reads from vLLM's answer.
        ids, logprobs = completions.answer(body)
        choice = {"text": name, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}
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

    async def reload(request: web.Request) -> web.Response:
        if verify_reload:
            folder = ((await request.json()).get("kwargs") or {}).get("weights_path", "")
            count = await asyncio.to_thread(tensors_in, folder) if folder else 0
            if not count:
                return web.json_response({"error": f"no safetensors in {folder!r}"}, status=500)
            print(f"reloaded {folder} {count}", flush=True)
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
    parser.add_argument("--random-tokens", metavar="LOW:HIGH", help="completions of max_tokens ids from [LOW, HIGH)")
    parser.add_argument("--logprob", type=float, default=-1.0, help="each completion token's logprob")
    parser.add_argument("--verify-reload", action="store_true", help="read the weights a reload names")
    args = parser.parse_args()
    tokens = range(*map(int, args.random_tokens.split(":"))) if args.random_tokens else None
    asyncio.run(main(args.name, args.port, frozenset(args.hang), args.delay, args.pause_holds, frozenset(args.slow),
                     Completions(tokens, args.logprob), args.verify_reload))
