"""Section 5: `grporun local examples/tiny.yaml` (what `make demo` runs) end to end on CPU, split into phases.

The bench starts the real command and watches it from outside, as a user could: the rollout server's /health and
/metrics (vLLM's `vllm:request_success_total`: TRL's worker asks for one completion per request, so requests are
samples) and the learner's /progress, at the ports `grporun local` wrote into runs/tiny/run.json. Phases:
server start = command start -> rollout /health answers; first sample = -> the learner reports its first consumed
group; training = -> the learner reports Succeeded (or stops answering: it exits right after); shutdown = -> the
command exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .report import Context, SectionUnavailable, table

NAME = "e2e"
TITLE = "5. End-to-end CPU run: `grporun local examples/tiny.yaml`"
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "examples" / "tiny.yaml"
TIMEOUT_S = 420.0
# As `make demo` runs it, then with one OpenMP thread per process: with torch's default of one thread per core, the
# learner's steps on the shared cores took ~9 s instead of ~0.1 s (measured while developing this bench); the second
# run keeps checking that `grporun local`'s own thread setting holds.
VARIANTS = (("as `make demo` runs it", {}), ("with `OMP_NUM_THREADS=1` exported", {"OMP_NUM_THREADS": "1"}))
#: The replica rows: the demo with rollout.replicas 1 and 2 (the learner's router spreads the requests).
REPLICA_COUNTS = (1, 2)


def replica_manifest(scratch: Path, replicas: int) -> Path:
    """examples/tiny.yaml with `rollout.replicas` set and its relative paths made absolute (it is written elsewhere)."""
    import yaml

    manifest = yaml.safe_load(MANIFEST.read_text())
    spec = manifest["spec"]
    spec["rollout"]["replicas"] = replicas
    spec["model"] = str((MANIFEST.parent / spec["model"]).resolve())
    spec["dataset"]["path"] = str((MANIFEST.parent / spec["dataset"]["path"]).resolve())
    path = scratch / f"tiny-{replicas}-replicas.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _samples_generated(metrics_text: str | None) -> float | None:
    if not metrics_text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                total = (total or 0.0) + sample.value
    return total


def run_once(context: Context, label: str, env: dict[str, str], manifest: Path = MANIFEST) -> dict:
    from grpo_operator.local.processes import http_get, http_ok, read_progress_blocking
    from grpo_trainer.contract.config import RunConfig

    runs_dir = context.scratch / f"e2e-{label}"
    grporun = ROOT / ".venv" / "bin" / "grporun"
    started = time.time()
    log_path = context.scratch / f"e2e-{label}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(grporun), "local", "--fresh", str(manifest), "--runs-dir", str(runs_dir)],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env)
    times: dict[str, float] = {}
    config = None
    report = None
    generated: list[tuple[float, float]] = []  # (time, vLLM requests so far, all servers)
    split: list[int] = []  # completions per replica, from the learner's report
    last_metrics = 0.0
    silent_since: float | None = None
    try:
        while process.poll() is None:
            now = time.time()
            if now - started > TIMEOUT_S:
                process.send_signal(signal.SIGINT)  # grporun local stops its processes on Ctrl-C
                process.wait(60)
                break
            if config is None:
                config_path = runs_dir / "tiny" / "run.json"
                if config_path.exists():
                    try:
                        config = RunConfig.model_validate_json(config_path.read_text())
                    except ValueError:
                        config = None  # still being written
            if config is not None:
                urls = config.rollout.urls
                if "server_ready" not in times and all(http_ok(f"{url}/health") for url in urls):
                    times["server_ready"] = time.time()
                if "server_ready" in times and now - last_metrics >= 1.0:
                    last_metrics = now
                    counts = [_samples_generated(http_get(f"{url}/metrics")) for url in urls]
                    if None not in counts:
                        generated.append((now, sum(counts)))
                polled = read_progress_blocking(f"http://127.0.0.1:{config.learner.http_port}")
                if polled is not None and "trained_end" not in times:
                    report = polled
                    split = [replica.samples for replica in polled.rollout] or split
                    if "first_group" not in times and polled.groups_consumed > 0:
                        times["first_group"] = time.time()
                    if polled.phase == "Succeeded":
                        times["trained_end"] = time.time()
                # The learner exits right after Succeeded; a poll may never see that phase, only the silence that
                # lasts until the command exits (a single slow answer under load is not the end).
                if polled is None and "first_group" in times:
                    silent_since = silent_since or time.time()
                elif polled is not None:
                    silent_since = None
            time.sleep(0.25)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(60)
    times["exit"] = time.time()
    if "trained_end" not in times and silent_since is not None:
        times["trained_end"] = silent_since
    timed_out = times["exit"] - started > TIMEOUT_S
    if process.returncode != 0 and not timed_out:
        raise RuntimeError(f"grporun local exited {process.returncode}: {log_path.read_text()[-1500:]}")
    missing = [phase for phase in ("server_ready", "first_group") if phase not in times]
    if missing:
        raise RuntimeError(f"the run ended before the bench saw {', '.join(missing)}: {log_path.read_text()[-1500:]}")
    end = times.get("trained_end", times["exit"])
    before_end = [count for at, count in generated if at <= end]
    return {"started": started, **times, "report": report, "generated": before_end[-1] if before_end else None,
            "timed_out": timed_out, "split": split,
            "generations": config.training.num_generations}


def run(context: Context) -> str:
    rollout_python = ROOT / ".venv-rollout" / "bin" / "python"
    if not rollout_python.exists():
        raise SectionUnavailable(".venv-rollout (vLLM CPU) is missing; `make setup-rollout` builds it")
    model = ROOT / "examples" / "tiny-assets" / "model"
    if not (model / "config.json").exists():
        from grpo_trainer.testing.tiny_assets import build_tiny_model

        build_tiny_model(model)  # what the demo's first run does
    results = [(label, run_once(context, str(index), env)) for index, (label, env) in enumerate(VARIANTS)]
    phase_rows, rate_rows = [], []
    for label, result in results:
        report, generations = result["report"], result["generations"]
        end = result.get("trained_end", result["exit"])
        finished = not result["timed_out"]
        phase_rows.append([
            label,
            f"{result['server_ready'] - result['started']:.1f}",
            f"{result['first_group'] - result['server_ready']:.1f}",
            f"{end - result['first_group']:.1f}" + ("" if finished else f" (stopped at {TIMEOUT_S:.0f} s)"),
            f"{result['exit'] - end:.1f}" if finished else "—",
            f"{result['exit'] - result['started']:.1f}",
        ])
        generated = result["generated"]
        trained = report.groups_trained * generations if report else 0
        rate_rows.append([
            label,
            f"{report.groups_consumed}/{report.groups_total} / {report.groups_trained} / {report.dropped_total}"
            if report else "n/a",
            report.global_step if report else "n/a",
            f"{generated:.0f} ({generated / (end - result['server_ready']):.1f}/s)" if generated else "n/a",
            f"{trained} ({trained / (end - result['first_group']):.1f}/s)",
        ])
    replica_rows = []
    for replicas in REPLICA_COUNTS:
        result = run_once(context, f"replicas-{replicas}", {}, replica_manifest(context.scratch, replicas))
        report, end = result["report"], result.get("trained_end", result["exit"])
        split = result["split"]
        share = " / ".join(f"{100 * n / sum(split):.0f}%" for n in split) if split and sum(split) else "n/a"
        generated = result["generated"]
        trained = report.groups_trained * result["generations"] if report else 0
        replica_rows.append([
            replicas, f"{result['server_ready'] - result['started']:.1f}",
            f"{end - result['first_group']:.1f}" + ("" if not result["timed_out"] else " (stopped)"),
            f"{' / '.join(str(n) for n in split) or 'n/a'} ({share})",
            f"{generated / (end - result['server_ready']):.1f}" if generated else "n/a",
            f"{trained / (end - result['first_group']):.1f}",
        ])
    text = [
        f"## {TITLE}",
        "",
        "One run per row (a run takes minutes; the 20-minute budget of `make bench` has room for one each), watched "
        "from outside through the rollout server's /health and /metrics and the learner's /progress, polled every "
        "0.25 s (the phase boundaries carry that resolution). Phases: server start = command → rollout /health "
        "answers; first sample = → the learner reports its first consumed group; training = → the learner reports "
        "Succeeded, or stops answering (it exits right after); shutdown = → the command exits.",
        "",
        table(["run", "server start s", "first sample s", "training s", "shutdown s", "total s"], phase_rows),
        "",
        table(["run", "groups consumed / trained / dropped", "optimizer steps",
               "samples generated (vLLM requests; per s from server ready to training end)",
               f"samples trained (groups trained × {results[0][1]['generations']}; per s of training)"], rate_rows),
    ]
    text += [
        "",
        "The same run with `rollout.replicas` 1 and 2 (all servers ready before the first sample; the learner's "
        "router spreads generation by least outstanding requests). Request split: completions per replica as the "
        "learner's `/progress` counts them. On this 2-core machine two CPU servers and the learner share two cores, "
        "so a second replica adds no compute: it can only show the split, not a speed-up. The split follows how fast "
        "each server answers (least outstanding requests sends more to the one that frees its slots sooner), and on "
        "cores shared with other jobs that varies from run to run (58 % / 42 % in one run of "
        "tests/trainer/rollout/test_replicas.py).",
        "",
        table(["replicas", "server start s", "training s", "request split (completions per replica)",
               "samples generated per s", "samples trained per s"], replica_rows),
    ]
    (_, as_is), (_, one_thread) = results
    finished = all(not r["timed_out"] and "trained_end" in r for r in (as_is, one_thread))
    if finished:
        training = [r["trained_end"] - r["first_group"] for r in (as_is, one_thread)]
        ratio = training[0] / training[1]
        text += ["", f"Training phase as `make demo` runs it / with one OpenMP thread exported: {ratio:.1f}×."]
        if ratio >= 1.5:
            text[-1] += (" The likely cause: with torch's default (one intra-op thread per core) on two cores shared "
                         "with the vLLM server, OpenMP's threads wait on each other whenever one is descheduled. "
                         "Follow-up: give CPU learners one OpenMP thread each (`OMP_NUM_THREADS`).")
        else:
            text[-1] += (" `grporun local` now gives a CPU learner its share of the cores as OpenMP threads (one "
                         "each for the learner here, as in the second row, which also gives the vLLM server one), "
                         "so the rows differ by the server's threads and the noise of single runs on shared cores. "
                         "Before that change training was 4.5× slower as `make demo` ran it (BENCHMARKS.md at "
                         "commit 1b236b2).")
    return "\n".join(text)
