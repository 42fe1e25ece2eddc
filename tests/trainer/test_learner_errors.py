"""What a crashed learner's termination message keeps: the root cause's type and the frame that raised it."""

from __future__ import annotations

from grpo_trainer.contract import (
    TERMINATION_MESSAGE_MAX_BYTES,
    LearnerPhase,
    ProgressReport,
)
from grpo_trainer.learner_main import describe_error
from grpo_trainer.progress import RolloutPipelineError


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
