"""The trackers' guard: each integration on a thread of its own, dropped with one warning when it fails mid-run, the
run's start and end waiting for it a bounded time."""

from __future__ import annotations

import threading

import pytest
from transformers import TrainerCallback, TrainerControl, TrainerState

from grpo_trainer.learner.tracking import guard

WHERE = "http://mlflow:5000"


class Integration(TrainerCallback):
    """A tracker's integration that records what it was called with, on which thread; `fail_at` raises at that step,
    `hang` holds its end until released."""

    def __init__(self, fail_at: int | None = None):
        self.steps: list[int] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at
        self.hang = threading.Event()
        self.ended = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.threads.add(threading.current_thread().name)
        if state.global_step == self.fail_at:
            raise ConnectionError(f"cannot reach {WHERE}\nretried 3 times")
        self.steps.append(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.hang.wait()
        self.ended = True


def log(callback, state, steps) -> None:
    for step in steps:
        state.global_step = step
        callback.on_log(None, state, TrainerControl(), logs={"loss": 1.0})


def settle(callback) -> None:
    """Wait for the calls made so far (what the run's end does)."""
    assert callback.settle(30)


def test_a_tracker_is_called_in_order_on_its_own_thread_with_the_state_as_it_was(caplog):
    integration, losses = Integration(), guard.TrackerLosses()
    guarded = guard.guarded(integration, "mlflow", WHERE, losses)
    assert guarded.integration is integration
    state = TrainerState()
    log(guarded, state, (1, 2, 3))
    settle(guarded)
    assert integration.steps == [1, 2, 3]  # each call saw its own step, though the state moved on
    assert integration.threads == {"tracker-mlflow"}
    integration.hang.set()
    guarded.on_train_end(None, state, TrainerControl())
    assert integration.ended and losses.reports() == [] and "dropped" not in caplog.text


def test_a_tracker_that_fails_mid_run_is_dropped_once_with_a_warning_naming_it_and_its_uri(caplog):
    integration, losses, released = Integration(fail_at=2), guard.TrackerLosses(), []
    hooks = guard.ThreadHooks(release=lambda: released.append(threading.current_thread().name))
    guarded = guard.guarded(integration, "mlflow", WHERE, losses, hooks)
    state = TrainerState()
    with caplog.at_level("WARNING", logger=guard.__name__):
        log(guarded, state, (1, 2))
        settle(guarded)
        log(guarded, state, (3, 4))  # the first call after the failure sees it
        settle(guarded)
        integration.hang.set()
        guarded.on_train_end(None, state, TrainerControl())
    (lost,) = losses.reports()
    assert (lost.tracker, lost.reason) == ("mlflow", f"ConnectionError: cannot reach {WHERE} ({WHERE})")
    assert integration.steps == [1] and not integration.ended  # nothing more reached it, its end included
    assert released == ["tracker-mlflow"]  # what its client held let go, once
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warning.startswith(f"tracking: mlflow at {WHERE} dropped for the rest of the run: ConnectionError")


class Refused(Exception):
    """What a tracker's server answers for data it will not take."""


def test_a_call_the_server_refuses_loses_its_data_only_and_the_tracker_goes_on(caplog):
    class Refusing(Integration):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step == 2:
                raise Refused("INVALID_PARAMETER_VALUE: metric name 'x' is not valid")
            super().on_log(args, state, control, logs, **kwargs)

    integration, losses = Refusing(), guard.TrackerLosses()
    hooks = guard.ThreadHooks(refused=lambda error: isinstance(error, Refused))
    guarded = guard.guarded(integration, "mlflow", WHERE, losses, hooks)
    state = TrainerState()
    with caplog.at_level("WARNING", logger=guard.__name__):
        log(guarded, state, (1, 2, 3))
        settle(guarded)
        integration.hang.set()
        guarded.on_train_end(None, state, TrainerControl())
    assert integration.steps == [1, 3] and integration.ended and losses.reports() == []
    (warning,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert warning.startswith(f"tracking: mlflow at {WHERE} refused the data of on_log (step 2): Refused: "
                              "INVALID_PARAMETER_VALUE")


def test_an_end_that_does_not_finish_is_left_behind_at_the_deadline(monkeypatch):
    monkeypatch.setattr(guard, "END_WAIT_S", 1.0)
    integration, losses = Integration(), guard.TrackerLosses()
    guarded = guard.guarded(integration, "tensorboard", "/ckpt/tensorboard", losses)
    guarded.on_train_end(None, TrainerState(), TrainerControl())  # returns: the end hangs on its thread
    (lost,) = losses.reports()
    assert lost.reason == "its run's end did not finish within 1s (/ckpt/tensorboard)"
    assert not integration.ended
    integration.hang.set()


def test_calls_still_unfinished_long_after_they_were_made_drop_the_tracker(monkeypatch):
    monkeypatch.setattr(guard, "STUCK_AFTER_S", 0.0)
    blocked = threading.Event()

    class Stuck(Integration):
        def on_log(self, args, state, control, logs=None, **kwargs):
            blocked.wait()

    losses = guard.TrackerLosses()
    guarded = guard.guarded(Stuck(), "wandb", "W&B project grpo", losses)
    log(guarded, TrainerState(), (1, 2))  # the second call finds the first unfinished: training did not wait
    (lost,) = losses.reports()
    assert lost.tracker == "wandb" and "has not finished" in lost.reason
    blocked.set()


@pytest.mark.parametrize("event", ["on_step_end", "on_save", "on_evaluate"])
def test_events_the_integration_does_not_handle_are_not_forwarded(event):
    guarded = guard.guarded(Integration(), "mlflow", WHERE, guard.TrackerLosses())
    assert getattr(type(guarded), event) is getattr(TrainerCallback, event)
