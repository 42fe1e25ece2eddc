"""Operator memory soak: the real kopf operator (its own process) managing N running GRPORuns against the API
emulator, every run's status patched on every pass; prints the operator's RSS over time.

`python -m bench.operator_soak [--runs 50] [--seconds 120] [--interval 1]`

Why: a memory leak in kopf >= 1.42 when patching status was reported (kopf#1172). Each run here is Running with a
learner whose trained-group count moves every second, so each reconcile pass writes status (the leaking path), at a
pass interval 5x shorter than the operator's default to stress it. The operator runs in a subprocess so its RSS is
its own, not the emulator's or the fake learners'.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TITLE = "Operator memory with many runs (kopf soak)"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def serve_operator(api_url: str, progress_url: str, interval: float, metrics_port: int = 0) -> None:
    """The subprocess: the operator exactly as `grporun operator` wires it, logged in to the emulator.
    `progress_url` may list several learner stand-ins, comma-separated: each pod polls one of them (by name)."""
    import logging
    import zlib

    import kopf
    from kopf._cogs.structs.credentials import Vault

    import grpo_operator.cluster.handlers  # noqa: F401
    from grpo_operator.cluster.reconcile import OperatorContext

    logging.basicConfig(level=logging.WARNING)
    urls = progress_url.split(",")
    context = OperatorContext(trainer_image="grpo-trainer:soak", reconcile_interval=interval,
                              progress_url=lambda namespace, pod, ip: urls[zlib.crc32(pod.encode()) % len(urls)])
    if metrics_port:
        context.metrics.serve(metrics_port)
    vault = Vault({"emulator": kopf.ConnectionInfo(server=api_url, default_namespace="default")})
    asyncio.run(kopf.operator(standalone=True, namespaces=["default"], memo=kopf.Memo(context=context), vault=vault))


def soak(runs: int, seconds: float, interval: float, sample_every: float = 10.0) -> list[tuple[float, float, int, int]]:
    """(elapsed seconds, operator RSS MiB, runs Running, status patches so far) samples."""
    import yaml

    from grpo_trainer.contract.report import ProgressReport
    from grpo_trainer.learner.exporter import ProgressServer
    from tests.support.emulator.kube_emulator import (
        DEFAULT_RESOURCES,
        GRPORUNS,
        PODS,
        EmulatorThread,
        KubeClient,
        KubeEmulator,
    )

    def status_patches() -> int:
        return sum(1 for r in emulator.emulator.request_log if r.rbac_resource == "grporuns/status")
    from tests.support.emulator.operator_fixtures import CRDS, Kubelet
    from tests.support.specs import grporun, minimal_spec

    trained = {"groups": 0}
    stop = threading.Event()

    def report() -> ProgressReport:
        return ProgressReport(phase="Running", groups_total=1_000_000, groups_consumed=trained["groups"],
                              groups_trained=trained["groups"])

    def tick() -> None:
        while not stop.wait(1.0):
            trained["groups"] += 1

    learner = ProgressServer(report, port=0, host="127.0.0.1").start()
    emulator = EmulatorThread(KubeEmulator(resources=DEFAULT_RESOURCES + (CRDS,))).start()
    client = KubeClient(emulator.url)
    client.create(CRDS, None, yaml.safe_load((ROOT / "crds" / "grporun.yaml").read_text()))
    operator = subprocess.Popen([sys.executable, "-m", "bench.operator_soak", "--serve-operator", emulator.url,
                                 f"{learner.url}/progress", "--interval", str(interval)], cwd=ROOT)
    threading.Thread(target=tick, daemon=True).start()
    samples = []
    try:
        spec = minimal_spec(progress={"progressDeadlineSeconds": 3600, "statusIntervalSeconds": 30})
        for index in range(runs):
            client.create(GRPORUNS, "default", grporun(f"soak-{index:03d}", spec))
        kubelet = Kubelet(client)
        deadline = time.monotonic() + 120
        while len(client.list(PODS, "default")) < 2 * runs:
            if time.monotonic() > deadline or operator.poll() is not None:
                raise RuntimeError("the operator did not create the pods")
            time.sleep(0.5)
        for pod in client.list(PODS, "default"):
            kubelet.run(pod["metadata"]["name"])
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) <= seconds:
            runs = client.list(GRPORUNS, "default")
            running = sum(1 for r in runs if (r.get("status") or {}).get("phase") == "Running")
            samples.append((elapsed, _rss_mib(operator.pid), running, status_patches()))
            print(f"t={elapsed:6.1f}s  operator RSS {samples[-1][1]:7.1f} MiB  runs Running {running}/{runs}  "
                  f"status patches so far {samples[-1][3]}", flush=True)
            time.sleep(sample_every)
    finally:
        stop.set()
        operator.terminate()
        operator.wait(30)
        emulator.stop()
        learner.stop()
    return samples


def summary(samples: list[tuple[float, float, int, int]], runs: int) -> str:
    warm = [rss for elapsed, rss, _, _ in samples if elapsed >= 30] or [samples[-1][1]]
    span = samples[-1][0] - samples[0][0]
    rate = (samples[-1][3] - samples[0][3]) / span if span else 0.0
    return (f"{runs} runs, all Running, {rate:.0f} status patches/s: RSS {samples[0][1]:.1f} MiB at start of the "
            f"soak, {min(warm):.1f}-{max(warm):.1f} MiB from 30 s on, {samples[-1][1]:.1f} MiB at "
            f"{samples[-1][0]:.0f} s (growth after warm-up {max(warm) - warm[0]:+.1f} MiB)")


def run(context) -> str:  # bench section hook (bench/__main__.py)
    runs, seconds = (10, 30) if context.quick else (50, 120)
    samples = soak(runs, seconds, interval=1.0)
    rows = "\n".join(f"| {elapsed:.0f} | {rss:.1f} | {running} |" for elapsed, rss, running, _ in samples)
    return (f"## {TITLE}\n\n{summary(samples, runs)}.\n\n| seconds | operator RSS MiB | runs Running |\n|---|---|---|\n"
            f"{rows}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--interval", type=float, default=1.0, help="operator reconcile interval (s)")
    parser.add_argument("--serve-operator", nargs=2, metavar=("API_URL", "PROGRESS_URL"), help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_operator:
        serve_operator(*args.serve_operator, interval=args.interval, metrics_port=args.metrics_port)
        return 0
    samples = soak(args.runs, args.seconds, args.interval)
    print(summary(samples, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
