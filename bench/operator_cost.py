"""Section 4: what the operator costs per GRPORun, with 1, 100 and 1,000 runs.

The real kopf operator runs in its own process (bench.operator_soak's `--serve-operator`, wired as `grporun
operator` wires it, at the operator's default reconcile interval) against the API emulator
(tests/support/emulator/kube_emulator.py, real HTTP, every request logged). Every run's learner is one real
ProgressServer that counts the polls it answers; a Kubelet (tests/support/emulator/operator_fixtures.py) marks the pods
Running. Measured per size, on a fresh emulator and operator:
- apply -> all children: from each GRPORun's create to its ConfigMap, Services and Pods existing (bench polls
  every 0.1 s);
- progress -> status lag: the learner's trained-group count changes once, for every run at the same moment; the
  time until each run's status shows it;
- steady state (every run Running, the learner's count growing every second, after a warm-up of two intervals):
  the operator's API requests (the emulator's log, the bench's own client excluded by user agent), its learner
  polls, its CPU time (/proc) and RSS.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .report import Context, SectionUnavailable, percentile, spread, table

NAME = "operator"
TITLE = "4. Operator cost per run (real kopf operator, API emulator)"
ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 100, 1000)
#: Learner stand-ins sharing the runs' polls: with one, at 1,000 runs (200 polls a second on the loaded 2-core
#: machine) some polls outlasted the operator's 3 s timeout and one run's passes spread to 8.6 s apart.
LEARNER_SERVERS = 4
KUBERAY_REQUESTS_PER_RUN_MINUTE = 60 / 3  # KubeRay polls each RayJob's dashboard every 3 s
BENCH_USER_AGENT = "python-requests"  # tests' KubeClient (the bench and the Kubelet); kopf sends kopf/<version>


def _components():
    # The names are handed back through locals(): importing here keeps the section optional.
    try:
        import yaml  # noqa: F401

        from grpo_operator import builders  # noqa: F401
        from tests.support.emulator.kube_emulator import (  # noqa: F401
            DEFAULT_RESOURCES,
            GRPORUNS,
            PODS,
            EmulatorThread,
            KubeClient,
            KubeEmulator,
        )
        from tests.support.emulator.operator_fixtures import CRDS, Kubelet  # noqa: F401
        from tests.support.specs import grporun, minimal_spec  # noqa: F401
    except ImportError as error:
        raise SectionUnavailable(f"the operator or its API emulator is not importable here ({error})") from error
    return locals()


def default_status_interval() -> float:
    from grpo_operator.api import ProgressSpec

    return float(ProgressSpec.model_fields["status_interval_seconds"].default)


def default_reconcile_interval() -> float:
    from grpo_operator.cluster.reconcile import OperatorContext

    return OperatorContext.__dataclass_fields__["reconcile_interval"].default


def _cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class CountingLearner:
    """Real ProgressServers answering for every run, each in a process of its own; counts the polls they answer.

    Own processes, not a thread of the bench: at 1,000 runs the operator polls 200 times a second (a real learner
    answers its own run's 0.2 a second), and a server sharing the GIL with the emulator answered past the operator's
    3 s poll timeout, so runs read as progress-unknown: a cost of the bench, not of the operator. `servers` splits
    the runs' polls between that many (the operator picks one per pod, by name).
    """

    def __init__(self, servers: int = 1):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._trained, self._polls = context.Value("q", 1), context.Value("q", 0)
        ready = context.Queue()
        self._processes = [context.Process(target=_serve_learner, args=(self._trained, self._polls, ready),
                                           daemon=True) for _ in range(servers)]
        for process in self._processes:
            process.start()
        self.url = ",".join(f"{ready.get(timeout=60)}/progress" for _ in self._processes)

    @property
    def trained(self) -> int:
        return self._trained.value

    @trained.setter
    def trained(self, value: int) -> None:
        self._trained.value = value

    @property
    def polls(self) -> int:
        return self._polls.value

    def tick(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            with self._trained.get_lock():
                self._trained.value += 1

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
            process.join(10)


def _serve_learner(trained, polls, ready) -> None:
    from grpo_trainer.contract.report import ProgressReport
    from grpo_trainer.learner.exporter import ProgressServer

    def report() -> ProgressReport:
        with polls.get_lock():
            polls.value += 1
        count = trained.value
        return ProgressReport(phase="Running", groups_total=1_000_000, groups_consumed=count, groups_trained=count)

    server = ProgressServer(report, port=0, host="127.0.0.1").start()
    ready.put(server.url)
    threading.Event().wait()


def _load() -> float:
    """The machine's 1-minute load average (2 cores shared with other work: above 2, everything waits for CPU)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def _stage(runs: int, what: str) -> None:
    print(f"[bench] operator, {runs} runs: {what} ({time.strftime('%H:%M:%S')}, load {_load():.1f})",
          file=sys.stderr, flush=True)


def _poll_every(runs: int) -> float:
    """How often the bench lists the API while it waits: every list deep-copies every object in the emulator's one
    thread, so at 1,000 runs (8,000 objects) a 0.1 s poll alone would keep the emulator busy."""
    return 0.1 if runs <= 100 else 1.0


def _wait(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def measure(runs: int, interval: float, window: float, status_interval: float) -> dict:
    c = _components()
    import yaml

    emulator_thread = c["EmulatorThread"](c["KubeEmulator"](resources=c["DEFAULT_RESOURCES"] + (c["CRDS"],))).start()
    emulator = emulator_thread.emulator
    client = c["KubeClient"](emulator_thread.url, timeout=120)  # a busy emulator answers late, not wrongly
    client.create(c["CRDS"], None, yaml.safe_load((ROOT / "crds" / "grporun.yaml").read_text()))
    learner = CountingLearner(servers=LEARNER_SERVERS)
    from grpo_operator.local.processes import free_port

    metrics_port = free_port()
    # Its log goes to a file: a pipe nobody reads fills up (64 KiB) at 1,000 runs, and the operator then blocks on
    # its next log line, frozen mid-measurement.
    log = tempfile.NamedTemporaryFile(prefix="bench-operator-", suffix=".log", delete=False)  # noqa: SIM115
    operator = subprocess.Popen(
        [sys.executable, "-m", "bench.operator_soak", "--serve-operator", emulator_thread.url, learner.url,
         "--interval", str(interval), "--metrics-port", str(metrics_port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    builders, GRPORUNS, PODS = c["builders"], c["GRPORUNS"], c["PODS"]

    def operator_requests() -> int:
        return sum(1 for r in list(emulator.request_log) if not r.user_agent.startswith(BENCH_USER_AGENT))

    try:
        _wait(lambda: any(r.verb == "watch" and r.resource == "grporuns" and not r.user_agent.startswith(
            BENCH_USER_AGENT) for r in list(emulator.request_log)) or operator.poll() is not None, 60,
            "the operator to watch GRPORuns")
        if operator.poll() is not None:
            raise RuntimeError(f"the operator exited: {Path(log.name).read_text()[-1500:]}")
        progress = {"progressDeadlineSeconds": 3600, "statusIntervalSeconds": int(status_interval)}
        spec = c["minimal_spec"](progress=progress)
        names = [f"bench-{index:03d}" for index in range(runs)]
        expected = {
            name: {("configmaps", builders.config_map_name(name)),
                   ("services", builders.rollout_service_name(name)),
                   ("services", builders.learner_service_name(name)),
                   *(("pods", builders.rollout_pod_name(name, i)) for i in range(spec["rollout"]["replicas"])),
                   *(("pods", builders.learner_pod_name(name, r)) for r in range(spec["learner"]["nodes"]))}
            for name in names
        }
        applied, complete = {}, {}
        for name in names:
            applied[name] = time.monotonic()
            client.create(GRPORUNS, "default", c["grporun"](name, spec))

        child_keys = {rdef.key: kind for kind, rdef in _child_kinds(c)}

        def stored_children() -> set[tuple[str, str]]:
            # The names straight from the emulator's store (on its own loop): listing over HTTP would deep-copy
            # thousands of objects every poll and slow the emulator the operator is being measured against.
            return {(child_keys[key], name) for key, _, name in list(emulator.store) if key in child_keys}

        def all_children() -> bool:
            now = time.monotonic()
            existing = emulator_thread.call(stored_children)
            for name in names:
                if name not in complete and expected[name] <= existing:
                    complete[name] = now
            return len(complete) == len(names)

        _stage(runs, "runs applied")
        _wait(all_children, 120 + runs, "every run's children")
        _stage(runs, "children created")
        creation = [complete[name] - applied[name] for name in names]
        kubelet = c["Kubelet"](client)
        for pod in client.list(PODS, "default"):
            kubelet.run(pod["metadata"]["name"])

        def phases() -> list[str]:
            return [(r.get("status") or {}).get("phase") for r in client.list(GRPORUNS, "default")]

        _stage(runs, "pods running")
        _wait(lambda: all(phase == "Running" for phase in phases()), 60 + runs, "every run Running",
              poll=max(0.5, _poll_every(runs)))
        _stage(runs, "every run Running; steady-state window")
        # A training run's progress moves all the time, and each change is a status patch: the learner's count
        # grows every second through the steady-state window, as in bench.operator_soak.
        ticking = threading.Event()
        ticker = threading.Thread(target=learner.tick, args=(ticking,), daemon=True)
        ticker.start()
        time.sleep(2 * interval)  # warm-up: the passes that took the runs to Running are not steady state
        requests0, polls0, cpu0, t0 = operator_requests(), learner.polls, _cpu_seconds(operator.pid), time.monotonic()
        load0 = _load()
        time.sleep(window)
        requests1, polls1, cpu1, t1 = operator_requests(), learner.polls, _cpu_seconds(operator.pid), time.monotonic()
        load = max(load0, _load())
        rss = _rss_mib(operator.pid)
        minutes = (t1 - t0) / 60
        ticking.set()
        ticker.join()
        time.sleep(status_interval + interval + 1)  # every status caught up with the last tick
        # Lag: one change of the learner's count for every run at the same moment.
        learner.trained += 1000
        changed, seen, metric_seen = time.monotonic(), {}, {}

        def status_caught_up() -> bool:
            now = time.monotonic()
            for run in client.list(GRPORUNS, "default"):
                progress = (run.get("status") or {}).get("progress") or {}
                name = run["metadata"]["name"]
                if name not in seen and progress.get("groupsTrained") == learner.trained:
                    seen[name] = now - changed
            now = time.monotonic()  # each source's own request time: a scrape can take a while at 1,000 runs
            for name, value in _metric_groups_trained(metrics_port).items():
                if name not in metric_seen and value == learner.trained:
                    metric_seen[name] = now - changed
            return len(seen) == len(names) and len(metric_seen) == len(names)

        _wait(status_caught_up, status_interval + 4 * interval + runs, "the status to show the learner's progress",
              poll=0.05 if runs <= 100 else _poll_every(runs))
        return {
            "runs": runs,
            "creation": creation,
            "lag": list(seen.values()),
            "metric_lag": list(metric_seen.values()),
            "requests_per_run_minute": (requests1 - requests0) / runs / minutes,
            "polls_per_run_minute": (polls1 - polls0) / runs / minutes,
            "cpu_per_run_hour": (cpu1 - cpu0) / runs / ((t1 - t0) / 3600),
            "cpu_fraction": (cpu1 - cpu0) / (t1 - t0),
            "rss": rss,
            "rss_per_run": rss / runs,
            "load": load,
            "poll": _poll_every(runs),
            "window": t1 - t0,
        }
    finally:
        operator.terminate()
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
        emulator_thread.stop()
        learner.stop()
        _stage(runs, f"done; the operator's log: {log.name}")


def _metric_groups_trained(port: int) -> dict[str, float]:
    """run -> the operator's grpo_operator_run_groups_trained, as Prometheus would scrape it now."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    from grpo_operator.metric_names import RUN_GROUPS_TRAINED

    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {sample.labels["run"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == RUN_GROUPS_TRAINED}


def _child_kinds(c):
    from tests.support.emulator.kube_emulator import CONFIGMAPS, SERVICES

    return (("configmaps", CONFIGMAPS), ("services", SERVICES), ("pods", c["PODS"]))


def run(context: Context) -> str:
    _components()
    interval = default_reconcile_interval()
    sizes = (1, 10) if context.quick else SIZES
    status_interval = default_status_interval()
    window = max(4 * interval, 2 * status_interval)
    results = [measure(runs, interval, window, status_interval) for runs in sizes]
    rows = [[
        r["runs"],
        f"{percentile(r['creation'], 50):.2f} / {percentile(r['creation'], 95):.2f}",
        f"{percentile(r['lag'], 50):.2f} / {percentile(r['lag'], 95):.2f}",
        f"{percentile(r['metric_lag'], 50):.2f} / {percentile(r['metric_lag'], 95):.2f}",
        f"{r['requests_per_run_minute']:.1f}",
        f"{r['requests_per_run_minute'] / KUBERAY_REQUESTS_PER_RUN_MINUTE:.2f}",
        f"{r['polls_per_run_minute']:.1f}",
        f"{r['cpu_per_run_hour']:.1f}",
        f"{100 * r['cpu_fraction']:.1f}%",
        f"{r['rss']:.0f}",
        f"{1024 * (r['rss'] - results[0]['rss']) / max(1, r['runs'] - 1):.0f}" if r["runs"] > 1 else "–",
        f"{r['load']:.1f}",
    ] for r in results]
    per_run_requests = [r["requests_per_run_minute"] for r in results]
    per_run_polls = [r["polls_per_run_minute"] for r in results]
    pass_gaps = [60 / polls for polls in per_run_polls if polls]
    return "\n".join([
        f"## {TITLE}",
        "",
        f"One measurement per size, each on a fresh emulator and operator; reconcile interval {interval:g} s (the "
        f"operator's default); progress.statusIntervalSeconds {status_interval:g} s (the default: progress reaches "
        f"the status at most this often, while the operator's Prometheus metrics follow every {interval:g} s pass); "
        f"steady-state window {window:.0f} s with every run Running and its learner's trained "
        "count growing every second (so progress changes on every pass). p50 / p95 are over the runs of a size; the "
        "bench looks at the emulator's store every 0.1 s for the children, and lists the runs and scrapes the "
        "operator's metrics every 0.05 s for the lags (every 1 s at 1,000 runs, where a list copies 1,000 runs), "
        "which is the resolution of those columns. The learner stand-in serves every run's /progress from a process "
        "of its own. The machine's 1-minute load average during the window is listed: "
        "the 2 cores are shared, and above 2 the operator, the emulator and the bench wait for CPU. "
        "KubeRay's comparable per-run cost is its 3-second poll of each RayJob's dashboard, "
        f"{KUBERAY_REQUESTS_PER_RUN_MINUTE:.0f} requests per run per minute (to the Ray dashboard; ours go to the "
        "API server, and our learner polls are listed separately).",
        "",
        table(["runs", "apply → all children created, s (p50 / p95)", "learner progress → status, s (p50 / p95)",
               "learner progress → operator metric, s (p50 / p95)",
               "API requests / run / min", "÷ KubeRay's 20", "learner polls / run / min",
               "operator CPU s / run / hour", "operator CPU (of one core)", "operator RSS MiB",
               "RSS KiB / run (above 1 run)", "load avg"], rows),
        "",
        f"Per run per minute in steady state, across sizes: {spread(per_run_requests, '{:.1f}')} API requests "
        f"(the goal is at most 2; {max(per_run_requests):.1f} at most here) and {spread(per_run_polls, '{:.1f}')} "
        f"polls of the learner's /progress (the counterpart of KubeRay's {KUBERAY_REQUESTS_PER_RUN_MINUTE:.0f} "
        "dashboard polls), one per reconcile pass: one run's passes came every "
        f"{spread(pass_gaps, '{:.1f}')} s against the {interval:g} s interval. Where passes come further apart "
        "than the interval, the status and the metric follow the learner later by as much.",
    ])
