"""Which status changes reach the API server at once (phase, conditions, restarts, failures, a rollout restart) and
which may wait for the status interval (progress counters, clocks, a running message's text)."""

from __future__ import annotations

import copy

import pytest

from grpo_operator.status.urgency import urgent_change

WRITTEN = {
    "phase": "Running", "observedGeneration": 1, "startTime": "2026-01-01T00:00:00Z", "restarts": 0,
    "conditions": [{"type": "Running", "status": "True", "reason": "Training", "message": "step 3"}],
    "message": "training: 3/40 groups", "progress": {"groupsTrained": 3},
    "rollout": {"servers": [{"replica": 0, "restarts": 0, "ready": True}]},
}


def changed(path: tuple, value) -> dict:
    status = copy.deepcopy(WRITTEN)
    target = status
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return status


@pytest.mark.parametrize("path, value", [
    (("progress", "groupsTrained"), 4),
    (("message",), "training: 4/40 groups"),
    (("conditions", 0, "message"), "step 4"),
    (("rollout", "servers", 0, "ready"), False),
])
def test_progress_clocks_and_running_text_may_wait(path, value):
    assert not urgent_change(WRITTEN, changed(path, value))


@pytest.mark.parametrize("path, value", [
    (("phase",), "Succeeded"),
    (("observedGeneration",), 2),
    (("restarts",), 1),
    (("failure",), {"reason": "OOMKilled"}),
    (("completionTime",), "2026-01-01T01:00:00Z"),
    (("conditions", 0, "status"), "False"),
    (("conditions", 0, "reason"), "Stalled"),
    (("message",), None),
    (("rollout", "servers", 0, "restarts"), 1),
])
def test_what_users_and_the_next_pass_act_on_is_written_at_once(path, value):
    assert urgent_change(WRITTEN, changed(path, value))
