"""The operator's own Prometheus metrics: per-run series from each run's status, and reconcile errors.

Names come from metric_names (one place). Per-run series are removed when the run is deleted, so a cluster that
runs thousands of short runs does not grow the operator's /metrics forever.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from grpo_trainer.contract.codes import DROP_REASONS

from .. import metric_names as m
from ..api import ConditionType, Phase, parse_status
from ..status import parse_time


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*m.RUN_LABELS, *extra], registry=r)

        self.info = gauge(m.RUN_INFO, "A GRPORun the operator manages (value 1).", ("model",))
        self.phase = gauge(m.RUN_PHASE, "1 for the run's current phase, 0 for the others.", ("phase",))
        self.progress_ratio = gauge(m.RUN_PROGRESS_RATIO, "Prompt groups consumed / groups the run must consume.")
        self.groups_trained = gauge(m.RUN_GROUPS_TRAINED, "Prompt groups that reached an optimizer step.")
        self.groups_consumed = gauge(m.RUN_GROUPS_CONSUMED, "Prompt groups consumed: trained or dropped.")
        self.groups_dropped = gauge(m.RUN_GROUPS_DROPPED, "Prompt groups consumed without training.", ("reason",))
        self.epoch = gauge(m.RUN_EPOCH, "Epochs completed.")
        self.stall_streak = gauge(m.RUN_STALL_STREAK, "Groups consumed in a row without one training.")
        self.stall_limit = gauge(m.RUN_STALL_LIMIT, "Stall streak at which the learner stops as stalled.")
        self.stalled = gauge(m.RUN_STALLED, "1 while the run's Stalled condition is True.")
        self.restarts = gauge(m.RUN_RESTARTS, "Learner restarts after crashes (within runPolicy.backoffLimit).")
        self.last_progress = gauge(m.RUN_LAST_PROGRESS, "Unix time the run last trained a group.")
        self.progress_deadline = gauge(m.RUN_PROGRESS_DEADLINE, "The run's progressDeadlineSeconds.")
        self.estimated_remaining = gauge(m.RUN_ESTIMATED_REMAINING,
                                         "Seconds to the epoch bound at the recent rate (status.progress).")
        self.rollout_replicas = gauge(m.RUN_ROLLOUT_REPLICAS, "Rollout servers the run asks for.")
        self.rollout_ready = gauge(m.RUN_ROLLOUT_READY, "Rollout servers ready.")
        self.rollout_restarts = gauge(m.RUN_ROLLOUT_RESTARTS, "Rollout servers replaced after they exited.")
        self.reconcile_errors = Counter(m.RECONCILE_ERRORS.removesuffix("_total"),
                                        "Reconcile passes that raised.", ["handler"], registry=r)
        self.reconcile_seconds = Histogram(m.RECONCILE_SECONDS, "Duration of reconcile passes.", ["handler"],
                                           registry=r)
        self._run_gauges = [
            self.info, self.phase, self.progress_ratio, self.groups_trained, self.groups_consumed,
            self.groups_dropped, self.epoch, self.stall_streak, self.stall_limit, self.stalled, self.restarts,
            self.last_progress, self.progress_deadline, self.rollout_replicas, self.rollout_ready,
            self.rollout_restarts, self.estimated_remaining,
        ]
        self._models: dict[tuple[str, str], str] = {}

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def observe_run(self, namespace: str, name: str, model: str, progress_deadline_seconds: int,
                    status: dict[str, Any], *, rollout_wanted: int | None = None) -> None:
        """`rollout_wanted`: the servers the run asks for (spec.rollout.replicas in effect); status.rollout.replicas
        counts the pods that exist, draining ones included, so it says that only when nothing drains."""
        labels = (namespace, name)
        parsed = parse_status(status)
        previous_model = self._models.get(labels)
        if previous_model is not None and previous_model != model:
            self.info.remove(*labels, previous_model)
        self._models[labels] = model
        self.info.labels(*labels, model).set(1)
        for phase in Phase:
            self.phase.labels(*labels, phase.value).set(1.0 if parsed.phase == phase else 0.0)
        progress = parsed.progress
        if progress is not None:
            self.progress_ratio.labels(*labels).set(
                min(progress.groups_consumed, progress.groups_total) / progress.groups_total
                if progress.groups_total else 0.0)
            self.groups_trained.labels(*labels).set(progress.groups_trained)
            self.groups_consumed.labels(*labels).set(progress.groups_consumed)
            for reason in DROP_REASONS:
                self.groups_dropped.labels(*labels, reason).set(progress.dropped.get(reason, 0))
            self.epoch.labels(*labels).set(progress.epoch)
            self.stall_streak.labels(*labels).set(progress.stall_streak)
            self.stall_limit.labels(*labels).set(progress.stall_limit)
        if progress is not None and progress.estimated_remaining_seconds is not None:
            self.estimated_remaining.labels(*labels).set(progress.estimated_remaining_seconds)
        else:  # no estimate: no series, rather than a stale or a zero one
            self.estimated_remaining.remove_by_labels({"namespace": namespace, "run": name})
        stalled = any(c.type == ConditionType.STALLED.value and c.status == "True" for c in parsed.conditions)
        self.stalled.labels(*labels).set(1.0 if stalled else 0.0)
        self.restarts.labels(*labels).set(parsed.restarts)
        if parsed.last_progress_time:
            self.last_progress.labels(*labels).set(parse_time(parsed.last_progress_time).timestamp())
        self.progress_deadline.labels(*labels).set(progress_deadline_seconds)
        if parsed.rollout is not None:
            self.rollout_replicas.labels(*labels).set(
                parsed.rollout.replicas if rollout_wanted is None else rollout_wanted)
            self.rollout_ready.labels(*labels).set(parsed.rollout.ready)
            self.rollout_restarts.labels(*labels).set(parsed.rollout.restarts)

    def forget_run(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted run."""
        self._models.pop((namespace, name), None)
        for gauge in self._run_gauges:
            gauge.remove_by_labels({"namespace": namespace, "run": name})
