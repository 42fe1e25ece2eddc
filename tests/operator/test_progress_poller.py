"""grpo_operator.progress_poller: the learner's /progress URL and the async poll."""

from __future__ import annotations

import asyncio

import aiohttp

from grpo_operator.progress_poller import pod_progress_url, poll_progress
from grpo_trainer.contract import ProgressReport
from grpo_trainer.exporter import ProgressServer


def test_progress_urls():
    assert pod_progress_url("ns", "p", "10.0.0.7") == "http://10.0.0.7:9400/progress"
    assert pod_progress_url("ns", "p", "fd00::7") == "http://[fd00::7]:9400/progress"



def test_poll_progress_reads_a_real_progress_server_and_says_why_when_it_cannot():
    server = ProgressServer(lambda: ProgressReport(groups_total=10, groups_trained=4), port=0, host="127.0.0.1")
    server.start()

    async def poll() -> tuple:
        async with aiohttp.ClientSession() as session:
            good = await poll_progress(session, f"{server.url}/progress", timeout=2)
            missing = await poll_progress(session, f"{server.url}/nothing", timeout=2)
            dead = await poll_progress(session, "http://127.0.0.1:9/progress", timeout=2)
            return good, missing, dead
    try:
        good, missing, dead = asyncio.run(poll())
    finally:
        server.stop()
    (report, error), (no_report, missing_error), (nothing, dead_error) = good, missing, dead
    assert report.groups_trained == 4 and error is None
    assert no_report is None and "HTTP 404" in missing_error
    assert nothing is None and dead_error.startswith("http://127.0.0.1:9/progress")
