"""Section 12: the generation request path beside the training thread.

The learner's rank-0 process trains on its main thread. Generation requests go from TRL's worker child straight to
the rollout servers: in ours through the router (grpo_trainer.rollout.router) in that child, while the learner's
process keeps only the supervision of the servers (grpo_trainer.rollout.supervisor: an event-loop thread that reads
the router's tallies and publishes its routes every 0.2 s, and probes servers that prove nothing). Whatever of that
runs in the training process holds the interpreter lock the training thread needs between its torch calls.
Measured here: a training loop (the tiny model's forward, backward and optimizer step on 500 tokens, one thread,
gradient checkpointing as the learner trains) on the main thread, while a client process keeps 16 generation
requests in flight against the stand-in completions server (tests/support/servers/completions_server.py, each
answer after the row's delay), in three layouts: no requests at all; TRL's path (the client straight to the server,
nothing in the training process); ours (the client routing each request through the router, over a route board the
training process's supervision keeps, as the learner's). Per row (the server's delay, so the request rate) the three
layouts run in turn, the order rotating between repetitions, each in a fresh process, for the same wall time;
figures: the training loop's median step time, the requests the client completed per second, the client's CPU per
request, and the supervision thread's CPU in the training process. On 2 or more cores the training process is bound
to the last core and the server and client to the others, so that what the step shows is the interpreter lock, not
a shared core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from grpo_trainer.rollout.supervisor import THREAD_NAME

from .report import Context, spread, table

NAME = "request_path"
TITLE = "12. The generation request path beside the training thread"
ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("idle", "direct", "ours")
LAYOUT_LABELS = {"idle": "no requests", "direct": "TRL's path", "ours": "ours"}
#: The stand-in server's delay per answer (s): with IN_FLIGHT requests in flight, at most IN_FLIGHT / delay per s.
DELAYS_S = (0.3, 0.1, 0.05, 0.02)
IN_FLIGHT = 16
SECONDS, QUICK_SECONDS = 12.0, 5.0
REPS, QUICK_REPS = 10, 1
TOKENS = 500
PAYLOAD = {"model": "m", "prompt": list(range(60)), "max_tokens": 16, "return_token_ids": True, "logprobs": 0}


@dataclass(frozen=True)
class Measurement:
    layout: str
    delay_s: float
    rep: int
    step_ms: float  # the training loop's median step
    requests_per_s: float
    client_cpu_ms_per_request: float  # NaN without requests
    supervision_cpu_s: float  # the supervision thread's CPU over the run (0 without one)
    load_average: float = math.nan  # the machine's 1-minute load average as the run started


def _python() -> list[str]:
    return [sys.executable, "-m", "bench.request_path"]


def _cores() -> tuple[set[int] | None, set[int] | None]:
    """(the training process's cores, the server's and client's): apart where there are 2 or more."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[-1]}, set(cores[:-1])


def _spawn(args: list[str], cores: set[int] | None = None) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'trainer_image'}"}
    if cores is not None:
        args = ["taskset", "--cpu-list", ",".join(map(str, sorted(cores))), *args]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def measure(layout: str, delay_s: float, seconds: float, model_dir: str) -> dict:
    """One layout at one delay, in this (fresh) process: the training loop on the main thread for `seconds`."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.traced_learner import cpu_by_thread
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
    load_average = os.getloadavg()[0]
    _, others = _cores()
    with ExitStack() as stack:
        client = None
        if layout != "idle":
            server = stack.enter_context(_spawn([sys.executable, str(COMPLETIONS_SERVER), "s", str(free_port()),
                                                 "--delay", str(delay_s)], others))
            stack.callback(server.kill)
            url = server.stdout.readline().strip()
            target = url
            if layout == "ours":
                target = _supervise(stack, url)
            client = stack.enter_context(_spawn([*_python(), "--client", layout, target, str(seconds + 1.0)], others))
            stack.callback(client.kill)
            time.sleep(0.5)  # the client's window fills
        supervision_before = cpu_by_thread().get(THREAD_NAME, 0.0)
        times, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        supervision_s = cpu_by_thread().get(THREAD_NAME, 0.0) - supervision_before
        completed, cpu_s = (json.loads(client.stdout.readline()) if client is not None else (0, 0.0))
    return {"layout": layout, "delay_s": delay_s, "step_ms": 1000 * statistics.median(times),
            "requests_per_s": completed / (seconds + 1.0),
            "client_cpu_ms_per_request": 1000 * cpu_s / completed if completed else float("nan"),
            "supervision_cpu_s": supervision_s, "load_average": load_average}


def _supervise(stack: ExitStack, url: str) -> str:
    """The learner's supervision of `url` in this process, as rank 0 runs it; the route board's path."""
    from grpo_trainer.rollout.route_board import RouteBoard
    from grpo_trainer.rollout.server_set import ServerSet
    from grpo_trainer.rollout.supervisor import RolloutSupervisor

    servers = ServerSet([url])
    board = RouteBoard.create()
    stack.callback(board.close)
    supervisor = RolloutSupervisor(servers, board, "m").start()
    stack.callback(supervisor.stop)
    while not servers.ready_urls():
        time.sleep(0.05)
    supervisor.exchange()
    return board.path


def run_client(layout: str, target: str, seconds: float) -> None:
    """IN_FLIGHT requests in flight for `seconds`: straight to the server at `target` (direct), or through the
    router over the route board at `target` (ours). Prints how many completed and this process's CPU seconds."""
    import aiohttp

    from grpo_trainer.rollout.router import RouterSettings, ServerRouter

    router = ServerRouter(RouterSettings(target)) if layout == "ours" else None

    async def main() -> int:
        completed, deadline = 0, time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            async def direct() -> dict:
                async with session.post(f"{target}/v1/completions", json=PAYLOAD) as response:
                    response.raise_for_status()
                    return await response.json()

            async def one() -> None:
                nonlocal completed
                while time.monotonic() < deadline:
                    if router is None:
                        await direct()
                    else:
                        await router.post(session, "/v1/completions", PAYLOAD, 60.0)
                    completed += 1

            await asyncio.gather(*(one() for _ in range(IN_FLIGHT)))
        return completed

    started_cpu = time.process_time()
    completed = asyncio.run(main())
    print(json.dumps([completed, time.process_time() - started_cpu]), flush=True)


# ----------------------------------------------------------------------------------------------- figures (pure)
def render(measurements: list[Measurement], *, seconds: float, reps: int) -> str:
    rows = []
    for delay_s in sorted({m.delay_s for m in measurements}, reverse=True):
        at = [m for m in measurements if m.delay_s == delay_s]
        by = {layout: [m for m in at if m.layout == layout] for layout in LAYOUTS}
        step = {layout: [m.step_ms for m in runs] for layout, runs in by.items()}
        ratios = {base: _ratios(by["ours"], by[base]) for base in ("idle", "direct")}
        rate = [m.requests_per_s for m in at if m.layout != "idle"]
        cpu = {layout: [m.client_cpu_ms_per_request for m in by[layout]] for layout in ("direct", "ours")}
        supervision = [1000 * m.supervision_cpu_s / seconds for m in by["ours"]]
        load = [m.load_average for m in at]
        rows.append([f"{delay_s:g} s", spread(rate, "{:.0f}"), *(spread(step[layout], "{:.1f}") for layout in LAYOUTS),
                     spread(ratios["idle"], "{:.2f}"), spread(ratios["direct"], "{:.2f}"),
                     spread(cpu["direct"], "{:.2f}"), spread(cpu["ours"], "{:.2f}"), spread(supervision, "{:.1f}"),
                     spread(load, "{:.1f}")])
    return "\n".join([
        f"## {TITLE}",
        "",
        __doc__.split("\n", 1)[1].strip(),
        "",
        f"{reps} repetition{'s' if reps != 1 else ''} of {seconds:g} s per layout and row; median (min–max) over "
        "them. Ratios are taken within a repetition (the three layouts run back to back).",
        "",
        table(["server delay per answer", "requests completed per s", "training step ms, no requests",
               "TRL's path", "ours", "ours / no requests", "ours / TRL's path",
               "client CPU ms per request, TRL's path", "ours (the router)",
               "supervision thread CPU, ms per s (ours)", "load average (1 min) as each run started"], rows),
    ])


def _ratios(ours: list[Measurement], base: list[Measurement]) -> list[float]:
    """Ours' step over the base layout's in the same repetition."""
    by_rep = {m.rep: m.step_ms for m in base}
    return [m.step_ms / by_rep[m.rep] for m in ours if m.rep in by_rep]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(NAME)
    group.add_argument("--delays", default=",".join(f"{delay:g}" for delay in DELAYS_S),
                       help="comma-separated server delays per answer (s), one row each (default: "
                            f"{','.join(f'{delay:g}' for delay in DELAYS_S)}; 0.02 gives ~700 requests per s)")
    group.add_argument("--repetitions", type=int, default=None,
                       help=f"repetitions per row (default {REPS}; --quick: {QUICK_REPS})")


def options(args: argparse.Namespace) -> dict[str, object]:
    """The section's options from the bench's command line; a wrong one is the parser's error."""
    try:
        delays = tuple(float(delay) for delay in args.delays.split(",") if delay.strip())
    except ValueError:
        raise ValueError(f"--delays: {args.delays!r} is not a comma-separated list of seconds") from None
    if not delays or not all(0 < delay < 60 for delay in delays):
        raise ValueError("--delays: name at least one delay, each above 0 and below 60 s")
    if args.repetitions is not None and args.repetitions < 1:
        raise ValueError("--repetitions: must be at least 1")
    return {"delays": delays, "repetitions": args.repetitions}


def run(context: Context) -> str:
    chosen = context.options.get(NAME, {})
    seconds = QUICK_SECONDS if context.quick else SECONDS
    reps = chosen.get("repetitions") or context.reps(REPS, QUICK_REPS)
    model_dir = context.model_dir
    training_cores, _ = _cores()
    measurements = []
    for delay_s in chosen.get("delays") or DELAYS_S:
        for rep in range(reps):
            order = LAYOUTS[rep % len(LAYOUTS):] + LAYOUTS[:rep % len(LAYOUTS)]
            for layout in order:
                child = _spawn([*_python(), "--measure", layout, str(delay_s), str(seconds), model_dir],
                               training_cores)
                out, _ = child.communicate(timeout=seconds * 10 + 120)
                if child.returncode != 0:
                    raise RuntimeError(f"{layout} at {delay_s:g} s: exit {child.returncode}")
                measurements.append(Measurement(rep=rep, **json.loads(out.strip().splitlines()[-1])))
                print(f"[bench] {NAME}: {measurements[-1]}", file=sys.stderr, flush=True)
    return render(measurements, seconds=seconds, reps=reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs=4, metavar=("LAYOUT", "DELAY_S", "SECONDS", "MODEL"))
    parser.add_argument("--client", nargs=3, metavar=("LAYOUT", "TARGET", "SECONDS"))
    args = parser.parse_args(argv)
    if args.client:
        run_client(args.client[0], args.client[1], float(args.client[2]))
    elif args.measure:
        layout, delay_s, seconds, model_dir = args.measure
        result = measure(layout, float(delay_s), float(seconds), model_dir)
        print(json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)  # the supervision's loop thread and the children are done with
    else:
        parser.error("one of --measure, --client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
