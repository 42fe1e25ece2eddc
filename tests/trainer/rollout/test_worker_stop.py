"""The rollout worker child's stop: a child that sent more than its queue's pipe holds still leaves on its own.

The real child does this at every run's end (it generates ahead of training); a learner run that stalls shows it too
(tests/trainer/learner/test_e2e_cpu.py, the environment whose rewards are NaN or never come).
"""

from __future__ import annotations

import multiprocessing

#: Far more than a pipe holds (64 KiB on Linux): the child's feeder thread blocks until someone reads.
SENT_BYTES = 4 * 1024 * 1024


def _send_and_leave(samples, metrics, sent) -> None:
    for _ in range(SENT_BYTES // 4096):
        samples.put(b"x" * 4096)
    metrics.put({"rollout/tokens": 1.0})
    sent.set()


def test_a_child_whose_queue_nobody_reads_leaves_once_the_stop_reads_it():
    from grpo_trainer.rollout.worker import join_reading  # here: the spawned child imports this module, not TRL

    context = multiprocessing.get_context("spawn")  # as TRL starts its child
    samples, metrics, sent = context.Queue(), context.Queue(), context.Event()
    unread = context.Process(target=_send_and_leave, args=(samples, metrics, sent))
    unread.start()
    assert sent.wait(60)
    unread.join(2)
    assert unread.exitcode is None  # its work done, held by its feeder thread: the stop waited it out, then killed it
    join_reading(unread, (samples, metrics), timeout_s=60)
    assert unread.exitcode == 0
