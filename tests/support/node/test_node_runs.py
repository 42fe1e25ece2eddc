"""The node tier's run helper, without a node: what `NodeRun.wait_for` concludes from a run's phase."""

from __future__ import annotations

import pytest

from tests.support.node.node_runs import NodeRun, reader_result


class ScriptedRun(NodeRun):
    """A run whose phase turns to `Failed` at the `failed_from`-th read (no cluster behind it)."""

    def __init__(self, failed_from: int):  # none of NodeRun's fields: nothing is asked of a cluster
        self.reads, self.failed_from = 0, failed_from

    def phase(self) -> str:
        self.reads += 1
        return "Failed" if self.reads >= self.failed_from else "Running"

    def what_a_user_sees(self) -> str:
        return "(what a user sees)"


def test_a_run_that_fails_between_two_reads_is_what_a_check_waiting_for_failed_sees():
    run = ScriptedRun(failed_from=2)
    assert run.wait_for(lambda: run.phase() == "Failed", "the run Failed", timeout=5)


def test_a_run_that_failed_before_what_is_awaited_stops_the_wait_at_once():
    run = ScriptedRun(failed_from=1)
    with pytest.raises(AssertionError, match="the learner's log: not seen in 600 s \\(run Failed\\)"):
        run.wait_for(lambda: False, "the learner's log", timeout=600)
    assert run.reads == 1


def test_the_readers_result_is_found_with_a_warning_after_it():
    # The pod's log holds stderr too: multiprocessing's resource tracker warned after the result line, under load.
    log = ('INFO vllm: serving\nexported model read: {"sha256": "ab", "step": 3}\n'
           "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear"
           " to be 1 leaked semaphore objects to clean up at shutdown\n"
           "  warnings.warn('resource_tracker: There appear to be %d '\n")
    assert reader_result(log) == {"sha256": "ab", "step": 3}


def test_a_reader_log_without_a_result_says_so_and_shows_the_log():
    with pytest.raises(AssertionError, match="no result line in the reader's log:\n.*Traceback"):
        reader_result("Traceback (most recent call last):\nValueError: no model\n")
