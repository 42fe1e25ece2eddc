"""What a crashed learner's termination message keeps: the root cause's type and the frame that raised it; and a
learner whose rollout worker child dies (a broken reward, a kill) ends, naming why."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_trainer.contract.codes import (
    EXIT_INVALID_CONFIG,
    EXIT_PREEMPTED,
    PERMANENT_EXIT_CODES,
    TERMINATION_MESSAGE_MAX_BYTES,
    LearnerPhase,
)
from grpo_trainer.contract.config import RewardConfig
from grpo_trainer.contract.report import ProgressReport
from grpo_trainer.learner.main import describe_error
from grpo_trainer.progress import RolloutPipelineError
from grpo_trainer.rollout.worker import STOP_JOIN_S
from tests.support.learner.bad_rewards import PREEMPT_MARK_ENV
from tests.support.paths import COMPLETIONS_SERVER
from tests.trainer.learner.test_e2e_cpu import run_learner, termination_report, tiny_run_config


def _health_check():
    raise ConnectionError("rollout server 10.0.0.7:8000 refused the connection")


def test_the_root_cause_and_its_last_frame_survive_the_wrapping():
    try:
        try:
            _health_check()
        except ConnectionError as cause:
            raise RolloutPipelineError("ConnectionError: rollout server refused") from cause
    except RolloutPipelineError as error:
        text = describe_error(error)
    assert text.startswith("RolloutPipelineError: ConnectionError: rollout server refused; caused by ConnectionError: ")
    assert "(at test_learner_errors.py:" in text and "in _health_check)" in text


def test_a_wrapper_that_only_repeats_its_cause_is_not_said_twice():
    try:
        try:
            _health_check()
        except ConnectionError as cause:
            raise RolloutPipelineError(f"ConnectionError: {cause}") from cause
    except RolloutPipelineError as error:
        text = describe_error(error)
    assert text.startswith("RolloutPipelineError: ConnectionError: rollout server 10.0.0.7:8000 refused the "
                           "connection (at test_learner_errors.py:")
    assert "caused by" not in text


def test_an_unchained_error_names_its_own_frame():
    try:
        _health_check()
    except ConnectionError as error:
        assert describe_error(error).endswith("in _health_check)")


def test_a_long_error_still_fits_the_termination_message_with_its_frame():
    try:
        try:
            raise ValueError("x" * 10_000)
        except ValueError as cause:
            raise RolloutPipelineError("y" * 10_000) from cause
    except RolloutPipelineError as error:
        text = describe_error(error)
    message = ProgressReport(phase=LearnerPhase.FAILED, message=text).termination_message()
    assert len(message.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    assert "caused by ValueError: xxx" in message and "(at test_learner_errors.py:" in message


@pytest.fixture
def completions_server(tiny_model_dir):
    """A stand-in rollout server that answers generations and weight syncs
    (tests/support/servers/completions_server.py)."""
    from tests.support.ports import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "a",
                               str(port)], stdout=subprocess.PIPE, text=True)
    server.stdout.readline()
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", model=tiny_model_dir)
    server.kill()
    server.wait()


def _run_with_reward(tmp_path: Path, server, function: str) -> tuple[int, ProgressReport, str]:
    config_path, config = tiny_run_config(
        tmp_path, server, rewards=[RewardConfig(function=f"tests.support.learner.bad_rewards:{function}")],
        training__epochs=1.0,
    )
    code, _seconds = run_learner(config_path, tmp_path / "learner.log")
    return code, termination_report(config), (tmp_path / "learner.log").read_text(errors="replace")


@pytest.mark.slow
def test_a_reward_returning_strings_ends_the_learner_as_invalid_config_naming_the_reward(
        tmp_path, completions_server):
    # TRL's worker child died on it ("could not convert string to float: 'bad'") and the learner hung in TRL's
    # stop, on the event the dead child had been waiting on.
    code, report, log = _run_with_reward(tmp_path, completions_server, "strings")
    assert code == EXIT_INVALID_CONFIG, log[-4000:]
    assert report.phase == LearnerPhase.FAILED
    assert report.message.startswith("reward function 'tests.support.learner.bad_rewards:strings' returned 'bad' (str)")


@pytest.mark.slow
def test_a_killed_rollout_worker_child_ends_the_learner_as_a_crash_naming_the_signal(tmp_path, completions_server):
    # What the OOM killer does: the child leaves no error behind, and TRL's parent would wait for its heartbeat.
    code, report, log = _run_with_reward(tmp_path, completions_server, "kills_its_process")
    assert code == 1 and code not in PERMANENT_EXIT_CODES, log[-4000:]
    assert report.phase == LearnerPhase.FAILED
    assert "rollout worker child (pid " in report.message
    assert ("killed by signal 9 (SIGKILL); it runs the reward functions "
            "'tests.support.learner.bad_rewards:kills_its_process'") in report.message
    assert "Empty" not in report.message  # the queue poll that found the death is not its cause


@pytest.mark.slow
def test_a_sigterm_while_the_worker_child_is_stuck_checkpoints_and_exits_preempted_without_waiting_on_it(
        tmp_path, completions_server, monkeypatch):
    # A drain stops the rollout servers with the learner: the child's generations in flight may never finish. The
    # pod has its grace period to checkpoint and leave; waiting out the child's stop was most of the time it took.
    mark = tmp_path / "sigterm-sent"
    monkeypatch.setenv(PREEMPT_MARK_ENV, str(mark))
    code, report, log = _run_with_reward(tmp_path, completions_server, "preempts_its_learner_then_hangs")
    exited = time.time()
    assert code == EXIT_PREEMPTED, log[-4000:]
    assert report.phase == LearnerPhase.PREEMPTED and report.message.startswith("preempted"), report.message
    assert list((tmp_path / "checkpoints").glob("checkpoint-*")), log[-4000:]
    seconds = exited - float(mark.read_text())
    assert seconds < STOP_JOIN_S, log[-4000:]  # the stuck child is not waited out
    print(f"SIGTERM to exit with the worker child stuck: {seconds:.1f}s")
