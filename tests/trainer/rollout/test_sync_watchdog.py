"""The weight-sync deadline: every sync timed, one that hangs ends the learner as stalled by the weight sync."""

from __future__ import annotations

import threading
import time

import pytest

from grpo_trainer.contract.codes import EXIT_STALLED
from grpo_trainer.rollout.sync_watchdog import SyncTimer, WeightSyncStuck
from tests.support.paths import COMPLETIONS_SERVER
from tests.trainer.learner.test_learner_runs import run

SERVER = str(COMPLETIONS_SERVER)


def test_a_sync_past_its_deadline_raises_while_it_is_still_blocked():
    blocked = threading.Event()
    timer = SyncTimer(deadline_s=0.3, waiting_on=lambda: "http://b:8000 did not answer /resume (resume)")
    started = time.monotonic()
    with pytest.raises(WeightSyncStuck, match=r"deadlineSeconds 0.3\): http://b:8000 did not answer /resume"):
        timer.run(lambda: blocked.wait(60))
    assert time.monotonic() - started < 5
    assert timer.running_s >= 0.3 and timer.syncs == 0  # the stuck sync shows how long it ran
    declared = timer.running_s
    time.sleep(0.05)
    assert timer.running_s == declared  # and stops there: the learner is ending, the sync is not running on
    blocked.set()


def test_finished_syncs_are_timed_and_their_errors_reach_the_caller():
    timer = SyncTimer(deadline_s=10)
    timer.run(lambda: time.sleep(0.05))
    assert timer.syncs == 1 and timer.last_s >= 0.05 and timer.total_s == timer.last_s and timer.running_s == 0

    def failing() -> None:
        raise ValueError("the server said no")

    with pytest.raises(ValueError, match="the server said no"):
        timer.run(failing)
    assert timer.syncs == 1


def test_the_sync_runs_with_the_thread_setup_first():
    seen = []
    timer = SyncTimer(deadline_s=None, thread_setup=lambda: seen.append(threading.current_thread().name))
    timer.run(lambda: seen.append("sync"))
    assert seen == ["grpo-weight-sync", "sync"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_sync_the_server_never_answers_ends_the_run_as_stalled_within_the_deadline(
        tiny_model_dir, tmp_path, update_never_answered, ranks):
    # With 2 gloo ranks, rank 1 waits in the sync's barrier for rank 0, which waits for the server: a blocked
    # collective on one rank, a hung request on the other. The filesystem sync's own request timeout is 300 s.
    deadline = 8
    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "6",
                  "--weights-dir", str(tmp_path / "weights"), "--weights-server", update_never_answered,
                  "--weight-sync-deadline", str(deadline), ranks=ranks, expect=EXIT_STALLED)
    assert [r["outcome"] for r in results] == ["WeightSyncStuck"] * ranks
    assert all(r["seconds"] < deadline + 60 for r in results)  # ended by the deadline, not a server timeout
    progress = results[0]["progress"]
    assert progress["phase"] == "Stalled" and progress["stallCause"] == "weight_sync"
    assert "weight sync stuck" in progress["message"] and progress["globalStep"] == 0  # the cold sync hung
    # Rank 0's report names the server and the step; rank 1 waited in the barrier behind it.
    assert f"{update_never_answered} did not answer /collective_rpc (reload_weights)" in progress["message"]
    assert progress["weightSyncRunningSeconds"] >= deadline and progress["weightSyncs"] == 0
