"""The learner's HTTP endpoint: `GET /progress` (JSON, the contract's ProgressReport) and `GET /metrics`.

Torch-free: it only reads a snapshot function, so the metrics are a pure rendering of the same report the operator reads
and the termination message carries, and the two can never disagree. A custom collector (rather than gauges updated by
the trainer) means a scrape always sees one consistent snapshot. Only figures that count in this process from 0 and
never decrease are counters (`_total`); totals since the run began (they carry over a resume) and figures that can go
down (trained, consumed, dropped: grpo_trainer.contract.metrics says when) are gauges. TRL's per-step curves (loss,
entropy...) are not part of the report: `StepMetrics` keeps the last logged value of each, rendered beside it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..contract.codes import (
    DEFAULT_TERMINATION_MESSAGE_PATH,
    LEARNER_HTTP_PORT,
    METRICS_PATH,
    PROGRESS_PATH,
    ReplicaState,
    weight_version_number,
)
from ..contract.metrics import (
    METRIC_ATTENTION_KERNEL,
    METRIC_ENVIRONMENT_FAILURES,
    METRIC_EPISODE_TURNS,
    METRIC_EPISODES,
    METRIC_EPISODES_FORKED,
    METRIC_EPOCHS,
    METRIC_EPOCHS_DONE,
    METRIC_GLOBAL_STEP,
    METRIC_GROUPS_COLLATED,
    METRIC_GROUPS_CONSUMED,
    METRIC_GROUPS_DROPPED,
    METRIC_GROUPS_REGENERATED,
    METRIC_GROUPS_REGENERATED_ENVIRONMENT,
    METRIC_GROUPS_RETURNED,
    METRIC_GROUPS_TOTAL,
    METRIC_GROUPS_TRAINED,
    METRIC_LAST_TRAINED,
    METRIC_REPLICA_FAILURES,
    METRIC_REPLICA_READY,
    METRIC_REPLICA_SAMPLES,
    METRIC_REPLICA_VERSION_LAG,
    METRIC_REPLICA_WEIGHT_VERSION,
    METRIC_REWARD_MEAN,
    METRIC_ROLLOUT_QUEUE_SAMPLES,
    METRIC_ROLLOUT_WAIT_SECONDS,
    METRIC_SAMPLES_MASKED,
    METRIC_SAMPLES_SCORED,
    METRIC_STALL_LIMIT,
    METRIC_STALL_STREAK,
    METRIC_STALLED,
    METRIC_STEP_CLIP_RATIO,
    METRIC_STEP_COMPLETION_TOKENS_MAX,
    METRIC_STEP_COMPLETION_TOKENS_MEAN,
    METRIC_STEP_ENTROPY,
    METRIC_STEP_GRAD_NORM,
    METRIC_STEP_KL,
    METRIC_STEP_LEARNING_RATE,
    METRIC_STEP_LOSS,
    METRIC_STEP_STALENESS_MAX,
    METRIC_STEP_STALENESS_MEAN,
    METRIC_TOOL_CALLS,
    METRIC_TOOL_FAILURES,
    METRIC_WEIGHT_SYNC_DEADLINE,
    METRIC_WEIGHT_SYNC_LAST_SECONDS,
    METRIC_WEIGHT_SYNC_RUNNING_SECONDS,
    METRIC_WEIGHT_SYNC_SECONDS,
    METRIC_WEIGHT_SYNCS,
    METRIC_WEIGHT_VERSION,
    TRL_LOG_METRICS,
)
from ..contract.report import EpisodeReport, ProgressReport, RolloutReplicaReport

logger = logging.getLogger(__name__)

ReportFn = Callable[[], ProgressReport]


def _without_total(name: str) -> str:
    # prometheus_client appends `_total` to counter families itself.
    return name.removesuffix("_total")


class StepMetrics:
    """The last value TRL logged for each of the step curves /metrics exports (contract.metrics.TRL_LOG_METRICS).

    Fed from the trainer's `log()` on the training thread, read by scrapes on the server's: a lock keeps a scrape
    from seeing half a step. A non-finite value (TRL logs NaN for a window without the figure) or one that is not a
    number leaves the series as it was, so a dashboard never plots NaN.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def record(self, logs: dict) -> None:
        updates = {}
        for key, (name, labels) in TRL_LOG_METRICS.items():
            value = logs.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            updates[(name, tuple(sorted(labels.items())))] = float(value)
        with self._lock:
            self._values.update(updates)

    def families(self) -> list[Metric]:
        with self._lock:
            values = dict(self._values)
        by_name: dict[str, GaugeMetricFamily] = {}
        for (name, labels), value in sorted(values.items()):
            family = by_name.get(name)
            if family is None:
                family = by_name[name] = GaugeMetricFamily(name, _STEP_DOCS[name], labels=[k for k, _ in labels])
            family.add_metric([v for _, v in labels], value)
        return list(by_name.values())


_STEP_DOCS = {
    METRIC_STEP_LOSS: "Training loss TRL logged for the last step.",
    METRIC_STEP_GRAD_NORM: "Gradient norm before clipping, last logged step.",
    METRIC_STEP_LEARNING_RATE: "Learning rate of the last logged step.",
    METRIC_STEP_ENTROPY: "Mean token entropy of the policy (nats), last logged step.",
    METRIC_STEP_KL: "Mean approximate KL of the policy from the policy that sampled, last logged step.",
    METRIC_STEP_CLIP_RATIO: "Share of tokens whose importance ratio was clipped, by bound, last logged step.",
    METRIC_STEP_COMPLETION_TOKENS_MEAN: "Mean completion length (tokens) generated since the last logged step.",
    METRIC_STEP_COMPLETION_TOKENS_MAX: "Longest completion (tokens) generated since the last logged step.",
    METRIC_STEP_STALENESS_MEAN: "Mean weight versions a trained sample was behind, last logged step.",
    METRIC_STEP_STALENESS_MAX: "Most weight versions a trained sample was behind, last logged step.",
}


class ProgressCollector:
    def __init__(self, report_fn: ReportFn, step_metrics: StepMetrics | None = None):
        self._report_fn = report_fn
        self._step_metrics = step_metrics

    def collect(self) -> Iterator[Metric]:
        report = self._report_fn()

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
            return None if value is None else GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(_without_total(name), doc, value=value)

        dropped = GaugeMetricFamily(METRIC_GROUPS_DROPPED, "Prompt groups consumed without training, by reason.",
                                    labels=["reason"])
        for reason, count in report.dropped.items():
            dropped.add_metric([reason], count)
        masked = CounterMetricFamily(_without_total(METRIC_SAMPLES_MASKED),
                                     "Samples the training step's scoring took out of the loss, by reason.",
                                     labels=["reason"])
        for reason, count in report.samples_masked.items():
            masked.add_metric([reason], count)
        attention = None
        if report.attention_kernel is not None:
            attention = GaugeMetricFamily(METRIC_ATTENTION_KERNEL, "1, labelled with the kernel that answers the "
                                          "tree attention (fa3, varlen or sdpa).", labels=["kernel"])
            attention.add_metric([getattr(report.attention_kernel, "value", report.attention_kernel)], 1)
        families = [
            gauge(METRIC_GROUPS_TOTAL, "Prompt groups the run must consume (prompts x epochs).", report.groups_total),
            gauge(METRIC_GROUPS_CONSUMED, "Prompt groups consumed: trained or dropped.", report.groups_consumed),
            gauge(METRIC_GROUPS_TRAINED, "Prompt groups that reached an optimizer step.", report.groups_trained),
            counter(METRIC_GROUPS_COLLATED, "Prompt groups counted at collation by this learner process.",
                    report.groups_collated),
            counter(METRIC_GROUPS_RETURNED, "Collated groups a stop returned before their optimizer step, in this "
                    "learner process.", report.groups_returned),
            dropped,
            gauge(METRIC_GROUPS_REGENERATED, "Prompt groups regenerated since the run began (stale, or left "
                  "untrained by an environment's failure): neither trained nor dropped.", report.regenerated),
            gauge(METRIC_GROUPS_REGENERATED_ENVIRONMENT, "Of the regenerated prompt groups, those an environment's "
                  "failure left untrained.", report.regenerated_environment),
            gauge(METRIC_EPOCHS_DONE, "Full passes over the prompts consumed.", report.epochs_done),
            gauge(METRIC_EPOCHS, "The run's epoch bound.", report.epochs),
            gauge(METRIC_STALL_STREAK, "Groups consumed in a row without one training.", report.stall_streak),
            gauge(METRIC_STALL_LIMIT, "Stall streak at which the run fails as stalled.", report.stall_limit),
            gauge(METRIC_GLOBAL_STEP, "Optimizer steps taken.", report.global_step),
            gauge(METRIC_LAST_TRAINED, "Unix time the last group trained.", report.last_trained_time),
            gauge(METRIC_STALLED, "1 when the learner's stall rules say it stalled.", float(report.stall_verdict)),
            gauge(METRIC_REWARD_MEAN, "Mean reward of the last trained micro-batch.", report.reward_mean),
            counter(METRIC_WEIGHT_SYNCS, "Weight syncs pushed to the rollout servers.", report.weight_syncs),
            counter(METRIC_SAMPLES_SCORED, "Samples the training step's scoring saw, every rank's.",
                    report.samples_scored),
            masked,
            counter(METRIC_WEIGHT_SYNC_SECONDS, "Seconds spent in finished weight syncs.",
                    report.weight_sync_seconds),
            gauge(METRIC_WEIGHT_SYNC_LAST_SECONDS, "How long the last finished weight sync took.",
                  report.weight_sync_last_seconds),
            gauge(METRIC_WEIGHT_SYNC_RUNNING_SECONDS, "How long the weight sync now running has run (0: none).",
                  report.weight_sync_running_seconds),
            gauge(METRIC_WEIGHT_SYNC_DEADLINE, "A weight sync running this long ends the learner as stalled.",
                  report.weight_sync_deadline_seconds),
            gauge(METRIC_WEIGHT_VERSION, "Weight version the learner last pushed (N of vN).", report.weight_version),
            attention,
            counter(METRIC_ROLLOUT_WAIT_SECONDS, "Seconds this learner process waited for a sample from the rollout "
                    "queue (rate: the share of time it waited).", report.rollout_wait_seconds),
            gauge(METRIC_ROLLOUT_QUEUE_SAMPLES, "Scored samples waiting in the rollout queue for the learner.",
                  report.rollout_queue_samples),
        ]
        yield from (family for family in families if family is not None)
        if report.episodes is not None:
            yield from episode_families(report.episodes)
        yield from server_families(report.rollout, report.weight_version)
        if self._step_metrics is not None:
            yield from self._step_metrics.families()


def episode_families(episodes: EpisodeReport) -> list[Metric]:
    """Tool calls and environments (grpo_trainer.agentic.episodes), counted by this learner process."""
    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(_without_total(name), doc, value=value)

    failures = CounterMetricFamily(_without_total(METRIC_ENVIRONMENT_FAILURES),
                                   "Episodes whose environment failed (unscorable), by environment.",
                                   labels=["environment"])
    for environment, count in episodes.environment_failures.items():
        failures.add_metric([environment], count)
    return [
        counter(METRIC_EPISODES, "Conversations the rollout worker finished.", episodes.episodes),
        counter(METRIC_EPISODE_TURNS, "Model turns, summed over episodes.", episodes.turns),
        counter(METRIC_EPISODES_FORKED, "Episodes that became more than one training row.", episodes.forked),
        counter(METRIC_TOOL_CALLS, "Tool calls the policy made.", episodes.tool_calls),
        counter(METRIC_TOOL_FAILURES, "Tool calls that raised or named no tool.", episodes.tool_failures),
        failures,
    ]


def server_families(servers: list[RolloutReplicaReport], learner_version: int = 0) -> list[Metric]:
    """One series per rollout server, label `replica` (its index in rollout.urls)."""
    ready = GaugeMetricFamily(METRIC_REPLICA_READY, "1 when the rollout server takes generation requests.",
                              labels=["replica"])
    version = GaugeMetricFamily(METRIC_REPLICA_WEIGHT_VERSION,
                                "Weight version the rollout server serves (N of vN; 0 = the initial weights).",
                                labels=["replica"])
    samples = CounterMetricFamily(_without_total(METRIC_REPLICA_SAMPLES),
                                  "Completions the rollout server produced.", labels=["replica"])
    failures = CounterMetricFamily(_without_total(METRIC_REPLICA_FAILURES),
                                   "Requests that failed on the rollout server (retried elsewhere).",
                                   labels=["replica"])
    lag = GaugeMetricFamily(METRIC_REPLICA_VERSION_LAG,
                            "Weight versions the rollout server is behind the learner's last push.", labels=["replica"])
    # A draining server keeps its ordinal; should a new server hold that ordinal meanwhile, the member's series wins
    # (one series per label, or the scrape fails).
    members_first = sorted(servers, key=lambda server: server.state == ReplicaState.DRAINING)
    labels_seen: set[int] = set()
    for server in members_first:
        if server.replica in labels_seen:
            continue
        labels_seen.add(server.replica)
        label = [str(server.replica)]
        served = weight_version_number(server.weight_version)
        ready.add_metric(label, float(server.ready and server.state == ReplicaState.SERVING))
        version.add_metric(label, float(served))
        lag.add_metric(label, float(max(learner_version - served, 0)))
        samples.add_metric(label, server.samples)
        failures.add_metric(label, server.failures)
    return [ready, version, samples, failures, lag]


def render_metrics(report_fn: ReportFn, step_metrics: StepMetrics | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProgressCollector(report_fn, step_metrics))
    return generate_latest(registry)


class ProgressServer:
    """Serves /progress and /metrics from `report_fn` (and TRL's step curves from `step_metrics`) on a daemon thread
    (rank 0 only)."""

    def __init__(self, report_fn: ReportFn, port: int = LEARNER_HTTP_PORT, host: str = "0.0.0.0",
                 step_metrics: StepMetrics | None = None):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ProgressCollector(report_fn, step_metrics))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if path == PROGRESS_PATH:
                        body, ctype = report_fn().model_dump_json(by_alias=True).encode(), "application/json"
                    elif path == METRICS_PATH:
                        body, ctype = generate_latest(registry), CONTENT_TYPE_LATEST
                    elif path in ("/healthz", "/readyz"):
                        body, ctype = b"ok", "text/plain"
                    else:
                        self.send_error(404, "try /progress or /metrics")
                        return
                except Exception as error:  # noqa: BLE001 - a report that cannot be made (broken accounting) says why
                    logger.error(f"progress server: {error}")
                    self.send_error(500, str(error).splitlines()[0])
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                logger.debug("progress server: " + fmt, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="grpo-progress-server", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProgressServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def write_termination_message(report: ProgressReport, path: str = DEFAULT_TERMINATION_MESSAGE_PATH) -> bool:
    """Write the final progress where Kubernetes reads the termination message; False if the path is unwritable
    (a local run without /dev/termination-log), which must not turn a finished run into a crash."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # a local run writes under runs/<name>/
        with open(path, "w", encoding="utf-8") as f:
            f.write(report.termination_message())
        return True
    except OSError as error:
        logger.warning(f"could not write the termination message to {path}: {error}")
        return False
