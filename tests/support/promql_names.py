"""Pull the metric names out of a PromQL expression, so the chart's alerts and dashboard can be checked against the
metric names the project exports (grpo_operator.metric_names, grpo_trainer.contract).

Not a PromQL parser (promtool parses; see test_dashboard.py): it removes what cannot be a metric name (strings,
label matchers, range and offset durations, grouping label lists) and returns the identifiers left that are neither
functions nor keywords.
"""

from __future__ import annotations

import re

from grpo_operator.metric_names import OPERATOR_METRIC_NAMES, RECONCILE_SECONDS
from grpo_trainer.contract.metrics import LEARNER_METRIC_NAMES

#: Series a query may name besides the project's own: Prometheus' scrape health, and kube-state-metrics' view of
#: the autoscaler of a run's rollout servers.
PROMETHEUS_SERIES = frozenset({
    "up", "ALERTS", "kube_horizontalpodautoscaler_status_current_replicas",
    "kube_horizontalpodautoscaler_spec_max_replicas", "kube_horizontalpodautoscaler_info",
})
_HISTOGRAM_SERIES = {f"{RECONCILE_SECONDS}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
KNOWN_METRICS = (frozenset(OPERATOR_METRIC_NAMES) | frozenset(LEARNER_METRIC_NAMES) | PROMETHEUS_SERIES
                 | _HISTOGRAM_SERIES)

PROMQL_FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count", "count_over_time", "count_values", "delta", "deriv", "exp", "floor",
    "group", "histogram_quantile", "holt_winters", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log2", "log10", "max", "max_over_time", "min", "min_over_time", "predict_linear",
    "quantile", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "stddev",
    "stdvar", "sum", "sum_over_time", "time", "timestamp", "topk", "vector", "label_values",
})
_KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_LABEL_VALUES = re.compile(r"\blabel_values\(\s*([^,()]*(?:\{[^{}]*\})?)\s*,[^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names_in(expr: str) -> set[str]:
    """Metric names an expression reads. Raises ValueError for an unknown function."""
    expr = _STRING.sub('""', expr)
    expr = _LABEL_VALUES.sub(r"\1", expr)  # Grafana's label_values(metric, label): the label is not a metric
    expr = _MATCHERS.sub("", expr)
    expr = _BRACKETS.sub("", expr)
    expr = _GROUPING.sub("", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        name, call = match.group(1), match.group(2)
        if name in _KEYWORDS:
            continue
        if call:
            if name not in PROMQL_FUNCTIONS:
                raise ValueError(f"unknown PromQL function {name!r} in {expr!r}")
        else:
            names.add(name)
    return names


def unknown_metrics(expr: str) -> set[str]:
    return metric_names_in(expr) - KNOWN_METRICS
