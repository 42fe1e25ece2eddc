"""The rollout worker's router in a process of its own, as in the learner (TRL's worker child), for tests and benches.

`python -m tests.support.router_client BOARD COUNT [--window W] [--timeout S] [--wait S] [--seconds S]` sends COUNT
generation requests through grpo_trainer.rollout.router, reading the routes from the route board at BOARD, W at a
time (TRL's worker keeps such a window in flight). It prints one JSON line when it is done: per request
`[status, text]` (200 and the completion's text, or 0 and the error). With `--seconds S` it sends requests for S
seconds instead and prints how many completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from grpo_trainer.rollout.router import RouterSettings, ServerRouter

PAYLOAD = {"model": "m", "prompt": [0, 1, 2], "max_tokens": 4}


async def send(router: ServerRouter, count: int, window: int, timeout_s: float) -> list[tuple[int, str]]:
    results: list[tuple[int, str]] = [(0, "not sent")] * count
    queue = list(range(count))

    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while queue:
                index = queue.pop(0)
                try:
                    answer = await router.post(session, "/v1/completions", PAYLOAD, timeout_s)
                    results[index] = (200, answer["choices"][0]["text"])
                except (aiohttp.ClientError, TimeoutError) as error:
                    results[index] = (getattr(error, "status", 0), f"{type(error).__name__}: {error}")

        await asyncio.gather(*(client() for _ in range(window)))
    return results


async def send_for(router: ServerRouter, seconds: float, window: int, payload: dict) -> int:
    completed, deadline = 0, time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            nonlocal completed
            while time.monotonic() < deadline:
                await router.post(session, "/v1/completions", payload, 60.0)
                completed += 1

        await asyncio.gather(*(client() for _ in range(window)))
    return completed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.router_client")
    parser.add_argument("board")
    parser.add_argument("count", type=int)
    parser.add_argument("--window", type=int, default=None, help="requests in flight at once (default: all)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each attempt's timeout on one server")
    parser.add_argument("--wait", type=float, default=60.0, help="how long a request waits for a ready server")
    parser.add_argument("--seconds", type=float, default=None, help="send for this long instead of COUNT requests")
    args = parser.parse_args(argv)
    router = ServerRouter(RouterSettings(args.board, wait_s=args.wait, check_interval_s=0.05))
    if args.seconds is not None:
        print(asyncio.run(send_for(router, args.seconds, args.window or 1, PAYLOAD)), flush=True)
        return 0
    results = asyncio.run(send(router, args.count, args.window or args.count, args.timeout))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
