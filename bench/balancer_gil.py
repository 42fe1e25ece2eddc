"""Section 12: the rollout balancer beside the training thread, in the learner's process or in a process of its own.

The balancer (grpo_trainer.rollout.balancer) proxies every generation request on an event-loop thread of the learner
process. Its Python work holds the interpreter lock that the training thread needs between its torch calls, so the
two take turns even where a core is free. Measured here: a training loop (the tiny model's forward, backward and
optimizer step on 500 tokens, one thread, gradient checkpointing as the learner trains) on the main thread, while a
client process keeps 16 generation requests in flight against the stand-in completions server
(tests/support/servers/completions_server.py, each answer after the row's delay), in three layouts: straight to the
server (no balancer), through a balancer in the training process (the learner's layout), and through a balancer in a
process of its own. Per row (the server's delay, so the request rate) the three layouts run in turn, the order
rotating between repetitions, each in a fresh process, for the same wall time; figures: the training loop's median
step time and the requests the client completed per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from .report import Context, spread, table

NAME = "balancer"
TITLE = "12. The rollout balancer beside the training thread: in the learner's process or its own"
ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("direct", "in-process", "own-process")
#: The stand-in server's delay per answer (s): with IN_FLIGHT requests in flight, at most IN_FLIGHT / delay per s.
DELAYS_S = (0.3, 0.1, 0.05, 0.02)
IN_FLIGHT = 16
SECONDS, QUICK_SECONDS = 12.0, 5.0
REPS, QUICK_REPS = 2, 1
TOKENS = 500


@dataclass(frozen=True)
class Measurement:
    layout: str
    delay_s: float
    step_ms: float  # the training loop's median step
    requests_per_s: float


def _python() -> list[str]:
    return [sys.executable, "-m", "bench.balancer_gil"]


def _spawn(args: list[str]) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'trainer_image'}"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def measure(layout: str, delay_s: float, seconds: float, model_dir: str) -> Measurement:
    """One layout at one delay, in this (fresh) process: the training loop on the main thread for `seconds`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.paths import COMPLETIONS_SERVER
    from tests.support.ports import free_port

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    with ExitStack() as stack:
        port = free_port()
        server = stack.enter_context(_spawn([sys.executable, str(COMPLETIONS_SERVER), "s", str(port), "--delay",
                                             str(delay_s)]))
        stack.callback(server.kill)
        url = server.stdout.readline().strip()
        if layout == "in-process":
            from grpo_trainer.rollout.balancer import RolloutBalancer
            from grpo_trainer.rollout.server_set import ServerSet

            balancer = RolloutBalancer(ServerSet([url]), "m").start()
            stack.callback(balancer.stop)
            while not balancer.servers.ready_urls():
                time.sleep(0.05)
            url = balancer.url
        elif layout == "own-process":
            own = stack.enter_context(_spawn([*_python(), "--balancer", url]))
            stack.callback(own.kill)
            url = own.stdout.readline().strip()
        client = stack.enter_context(_spawn([*_python(), "--client", url, str(seconds + 1.0)]))
        stack.callback(client.kill)
        time.sleep(0.5)  # the client's window fills
        times, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        completed = int(client.stdout.readline() or 0)
    return Measurement(layout, delay_s, 1000 * statistics.median(times), completed / (seconds + 1.0))


def serve_balancer(server_url: str) -> None:
    """A balancer over `server_url` in this process; prints its URL, then serves until killed."""
    from grpo_trainer.rollout.balancer import RolloutBalancer
    from grpo_trainer.rollout.server_set import ServerSet

    balancer = RolloutBalancer(ServerSet([server_url]), "m").start()
    while not balancer.servers.ready_urls():
        time.sleep(0.05)
    print(balancer.url, flush=True)
    while True:
        time.sleep(3600)


def run_client(url: str, seconds: float) -> None:
    """IN_FLIGHT requests in flight against `url` for `seconds`; prints how many completed."""
    import aiohttp

    body = {"model": "m", "prompt": list(range(60)), "max_tokens": 16, "return_token_ids": True, "logprobs": 0}

    async def main() -> int:
        completed, deadline = 0, time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            async def one() -> None:
                nonlocal completed
                while time.monotonic() < deadline:
                    async with session.post(f"{url}/v1/completions", json=body) as response:
                        await response.read()
                        completed += response.status == 200

            await asyncio.gather(*(one() for _ in range(IN_FLIGHT)))
        return completed

    print(asyncio.run(main()), flush=True)


# ----------------------------------------------------------------------------------------------- figures (pure)
def render(measurements: list[Measurement], *, seconds: float, reps: int) -> str:
    rows = []
    for delay_s in sorted({m.delay_s for m in measurements}, reverse=True):
        at = [m for m in measurements if m.delay_s == delay_s]
        step = {layout: [m.step_ms for m in at if m.layout == layout] for layout in LAYOUTS}
        rate = [m.requests_per_s for m in at if m.layout != "direct"]
        base = statistics.median(step["direct"]) if step["direct"] else float("nan")
        rows.append([f"{delay_s:g} s", spread(rate, "{:.0f}"),
                     *(spread(step[layout], "{:.1f}") for layout in LAYOUTS),
                     *(f"{statistics.median(step[layout]) / base:.2f}" if step[layout] else "n/a"
                       for layout in LAYOUTS[1:])])
    return "\n".join([
        f"## {TITLE}",
        "",
        __doc__.split("\n", 1)[1].strip(),
        "",
        f"{reps} repetition{'s' if reps != 1 else ''} of {seconds:g} s per layout and row; median (min–max) over "
        "them of each run's median step.",
        "",
        table(["server delay per answer", "requests completed per s (through a balancer)",
               "training step ms, no balancer", "balancer in the training process", "balancer in its own process",
               "in the training process / none", "in its own process / none"], rows),
    ])


def run(context: Context) -> str:
    seconds = QUICK_SECONDS if context.quick else SECONDS
    reps = context.reps(REPS, QUICK_REPS)
    model_dir = context.model_dir
    measurements = []
    for delay_s in DELAYS_S:
        for rep in range(reps):
            order = LAYOUTS[rep % len(LAYOUTS):] + LAYOUTS[:rep % len(LAYOUTS)]
            for layout in order:
                child = _spawn([*_python(), "--measure", layout, str(delay_s), str(seconds), model_dir])
                out, _ = child.communicate(timeout=seconds * 10 + 120)
                if child.returncode != 0:
                    raise RuntimeError(f"{layout} at {delay_s:g} s: exit {child.returncode}")
                measurements.append(Measurement(**json.loads(out.strip().splitlines()[-1])))
                print(f"[bench] {NAME}: {measurements[-1]}", file=sys.stderr, flush=True)
    return render(measurements, seconds=seconds, reps=reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.balancer_gil", description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs=4, metavar=("LAYOUT", "DELAY_S", "SECONDS", "MODEL"))
    parser.add_argument("--balancer", metavar="SERVER_URL")
    parser.add_argument("--client", nargs=2, metavar=("URL", "SECONDS"))
    args = parser.parse_args(argv)
    if args.balancer:
        serve_balancer(args.balancer)
    elif args.client:
        run_client(args.client[0], float(args.client[1]))
    elif args.measure:
        layout, delay_s, seconds, model_dir = args.measure
        result = measure(layout, float(delay_s), float(seconds), model_dir)
        print(json.dumps(result.__dict__), flush=True)
        sys.stdout.flush()
        os._exit(0)  # the balancer's loop thread and the children are done with
    else:
        parser.error("one of --measure, --balancer, --client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
