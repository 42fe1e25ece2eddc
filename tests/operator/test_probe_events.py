"""Reading the kubelet's `Unhealthy` Events of a pod into its latest probe failure (grpo_operator.cluster.probe_events);
the read itself runs against the emulator and the real API server in tests/operator/test_lifecycle.py."""

from __future__ import annotations

from typing import Any

from grpo_operator.cluster.probe_events import latest_probe_failure
from grpo_operator.status import ProbeFailure

REFUSED = 'Get "http://10.0.0.5:8765/health": dial tcp 10.0.0.5:8765: connect: connection refused'


def event(message: str, first: str, last: str, count: Any = 1, reason: str = "Unhealthy") -> dict[str, Any]:
    return {"reason": reason, "message": message, "count": count, "firstTimestamp": first, "lastTimestamp": last,
            "type": "Warning"}


def test_the_kubelets_counted_event_is_read_with_its_probe_its_cause_and_its_span():
    read = latest_probe_failure([event(f"Readiness probe failed: {REFUSED}", "2026-12-05T10:00:00Z",
                                       "2026-12-05T10:00:40Z", count=5)])
    assert read == ProbeFailure("readiness", REFUSED, count=5, seconds=40)


def test_the_latest_failure_wins_and_other_events_are_left_out():
    events = [
        event("Liveness probe failed: command timed out", "2026-12-05T10:00:00Z", "2026-12-05T10:05:00Z", count=3),
        event("Readiness probe errored: rpc error", "2026-12-05T10:00:00Z", "2026-12-05T10:06:00Z"),
        event("Back-off restarting failed container", "2026-12-05T10:00:00Z", "2026-12-05T10:09:00Z",
              reason="BackOff"),
        event("Readiness probe failed: x", "yesterday", "2026-12-05T11:00:00Z"),  # torn: not read
        event("Startup probe failed: x", "2026-12-05T10:00:00Z", "2026-12-05T11:00:00Z", count="many"),  # torn
    ]
    assert latest_probe_failure(events) == ProbeFailure("readiness", "rpc error", count=1, seconds=360)
    assert latest_probe_failure(events[2:]) is None


def test_an_events_k8s_io_series_is_read_too():
    """An Event written through events.k8s.io/v1 shows in core/v1 with eventTime and series, not count."""
    read = latest_probe_failure([{"reason": "Unhealthy", "message": "Startup probe failed: HTTP probe failed with "
                                  "statuscode: 500", "eventTime": "2026-12-05T10:00:00.123456Z",
                                  "series": {"count": 4, "lastObservedTime": "2026-12-05T10:00:30.123456Z"}}])
    assert read == ProbeFailure("startup", "HTTP probe failed with statuscode: 500", count=4, seconds=30)
