"""Cluster.wait_passes: the operator's passes are the wait's clock, not the seconds they take."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from grpo_operator.cluster.reconcile import OperatorContext
from tests.support.emulator.operator_fixtures import PASSES_TO_LAND, Cluster


def _cluster() -> tuple[Cluster, OperatorContext]:
    cluster = Cluster.__new__(Cluster)  # the waits alone: no emulator, an operator that is only its metrics
    context = OperatorContext(trainer_image="t")
    cluster.operator = SimpleNamespace(context=context)
    return cluster, context


def _make_passes(context: OperatorContext, count: int, every_s: float) -> threading.Thread:
    def passes() -> None:
        for _ in range(count):
            time.sleep(every_s)
            context.metrics.reconcile_seconds.labels("lifecycle").observe(0.001)
    thread = threading.Thread(target=passes, daemon=True)
    thread.start()
    return thread


def test_a_wait_the_operator_never_satisfies_fails_after_its_passes_not_at_a_time():
    cluster, context = _cluster()
    _make_passes(context, PASSES_TO_LAND + 5, every_s=0.001)
    with pytest.raises(AssertionError, match=r"never: not seen in \d+ passes of the operator") as failed:
        cluster.wait_passes(lambda: False, "never")
    assert int(str(failed.value).split()[4]) >= PASSES_TO_LAND


def test_an_operator_is_waited_for_while_its_passes_are_fewer_than_the_bound():
    cluster, context = _cluster()
    passes = _make_passes(context, PASSES_TO_LAND - 1, every_s=0.05)  # seconds in all, fewer passes than the bound
    assert cluster.wait_passes(lambda: not passes.is_alive() and "done", "the last pass") == "done"
