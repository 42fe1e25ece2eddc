"""The rollout worker's router in a process of its own, as in the learner (TRL's worker child), for tests and benches.

`python -m tests.support.router_client BOARD COUNT [--model M] [--window W] [--timeout S] [--wait S]` sends COUNT
generation requests through grpo_trainer.rollout.router, reading the routes from the route board at BOARD, W at a
time (TRL's worker keeps such a window in flight), each naming model M. It prints one JSON line when it is done: per
request `[status, text]` (200 and the completion's text, or the error's status, 0 for none, and the error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp

from grpo_trainer.rollout.router import RouterSettings, ServerRouter


async def send(router: ServerRouter, count: int, window: int, timeout_s: float,
               model: str) -> list[tuple[int, str]]:
    payload = {"model": model, "prompt": [0, 1, 2], "max_tokens": 4}
    results: list[tuple[int, str]] = [(0, "not sent")] * count
    queue = list(range(count))

    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while queue:
                index = queue.pop(0)
                try:
                    answer = await router.post(session, "/v1/completions", payload, timeout_s)
                    results[index] = (200, answer["choices"][0]["text"])
                except (aiohttp.ClientError, TimeoutError) as error:
                    results[index] = (getattr(error, "status", 0), f"{type(error).__name__}: {error}")

        await asyncio.gather(*(client() for _ in range(window)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.router_client")
    parser.add_argument("board")
    parser.add_argument("count", type=int)
    parser.add_argument("--model", default="m", help="the model each request names")
    parser.add_argument("--window", type=int, default=None, help="requests in flight at once (default: all)")
    parser.add_argument("--timeout", type=float, default=30.0, help="each attempt's timeout on one server")
    parser.add_argument("--wait", type=float, default=60.0, help="how long a request waits for a ready server")
    args = parser.parse_args(argv)
    router = ServerRouter(RouterSettings(args.board, wait_s=args.wait, check_interval_s=0.05))
    results = asyncio.run(send(router, args.count, args.window or args.count, args.timeout, args.model))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
