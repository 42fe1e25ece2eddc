"""The worker child's rollout metrics merged before they go to the learner: TRL's logged figures stay the same."""

from __future__ import annotations

import math
import queue
from collections import defaultdict

from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from grpo_trainer.rollout.metrics_batch import MetricsBatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def logged(payloads: list[dict]) -> dict[str, float]:
    """What TRL's `log` makes of the payloads it drains: each key's values reduced by `_reduce_metric`."""
    window = defaultdict(list)
    for payload in payloads:
        for key, value in payload.items():
            window[key].append(value)
    valid = {key: [v for v in values if isinstance(v, tuple) or not math.isnan(v)] for key, values in window.items()}
    return {key: _reduce_metric(key, values) for key, values in valid.items() if values}


def completion(duration_s: float, tokens: int) -> dict:
    """One completion's payload as TRL's `_push_rollout_metrics` pushes it (with a rate and a counter)."""
    return {"rollout/duration_s": duration_s, "rollout/turns_max": 1.0, "completions/max_length": float(tokens),
            "completions/min_length": float(tokens), "completions/mean_length": (float(tokens), 1.0),
            "tools/guess/call_total": 2.0, "rollout/drift_tokens_max": math.nan}


def test_merged_payloads_log_what_each_payload_sent_alone_would_have():
    payloads = [completion(0.5, 12), completion(1.5, 16), completion(0.25, 9),
                {"rollout/score_s": 0.01, "rollout/generated_tok_s": (37.0, 0.5)}, completion(2.0, 15)]
    sent = queue.Queue()
    clock = Clock()
    batch = MetricsBatch(sent, interval_s=0.8, clock=clock)
    for payload in payloads:
        batch.put_nowait(payload)
        clock.now += 0.3
    batch.flush()
    merged = [sent.get_nowait() for _ in range(sent.qsize())]
    assert len(merged) == 2  # the first four at 0.9 s, the last at the flush
    assert logged(merged) == logged(payloads)
    assert logged(merged)["rollout/duration_s"] == (0.5 + 1.5 + 0.25 + 2.0) / 4  # a gauge's mean, not its sum
    assert logged(merged)["tools/guess/call_total"] == 8.0 and logged(merged)["completions/min_length"] == 9.0
    assert "rollout/drift_tokens_max" not in merged[0]  # NaN: left out, as TRL's log leaves it out


def test_nothing_is_sent_before_the_interval_nor_an_empty_payload_and_a_full_queue_drops_it():
    sent = queue.Queue(maxsize=1)
    clock = Clock()
    batch = MetricsBatch(sent, interval_s=0.25, clock=clock)
    batch.put_nowait(completion(0.5, 12))
    assert sent.empty()
    clock.now = 0.25
    batch.put_nowait(completion(0.5, 12))
    assert sent.qsize() == 1
    batch.flush()  # nothing pending
    clock.now = 0.5
    batch.put_nowait(completion(0.5, 12))  # the learner has not drained the queue: dropped, generation goes on
    assert sent.qsize() == 1 and logged([sent.get_nowait()])["completions/max_length"] == 12.0


def test_per_tool_metrics_of_tool_names_the_policy_made_up_are_not_sent():
    sent = queue.Queue()
    batch = MetricsBatch(sent, interval_s=60.0)
    batch.put_nowait({"tools/guess/call_total": 3.0, "tools/guess/latency_s": 0.1, "tools/make-move/failure_total": 1.0,
                      "tools//call_total": 1.0, "tools/guess//call_total": 1.0, "tools/../call_total": 1.0,
                      "tools/a/b/latency_s": 0.2, "tools/guess(/failure_total": 1.0, "tools/gu ess/call_total": 1.0,
                      "tools/unknown_name_total": 6.0, "tools/latency_s": (0.1, 1.0), "tools/call_frequency": 0.5})
    batch.flush()
    assert sorted(sent.get_nowait()) == ["tools/call_frequency", "tools/guess/call_total", "tools/guess/latency_s",
                                         "tools/latency_s", "tools/make-move/failure_total",
                                         "tools/unknown_name_total"]
