"""grpo_operator.cluster.progress_poller: the learner's /progress URL and the async poll."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from grpo_operator.cluster.progress_poller import MAX_REPORT_BYTES, pod_progress_url, poll_progress
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport
from grpo_trainer.learner.exporter import ProgressServer


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
    assert good.report.groups_trained == 4 and good.error is None
    assert missing.report is None and "HTTP 404" in missing.error and not missing.invalid
    assert dead.report is None and dead.error.startswith("http://127.0.0.1:9/progress") and not dead.invalid


class RawLearner:
    """A /progress that answers whatever bytes the test sets, with or without a Content-Length (chunked then)."""

    def __init__(self, body: bytes, *, length: bool = True):
        raw = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if raw.length:
                    self.send_header("Content-Length", str(len(raw.body)))
                    self.end_headers()
                    self.wfile.write(raw.body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for start in range(0, len(raw.body), 65536):
                    chunk = raw.body[start:start + 65536]
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *_: object) -> None:
                pass

        self.body, self.length = body, length
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/progress"

    def poll(self):
        async def once():
            async with aiohttp.ClientSession() as session:
                return await poll_progress(session, self.url, timeout=5)
        try:
            return asyncio.run(once())
        finally:
            self.server.shutdown()
            self.server.server_close()


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
def test_a_report_larger_than_the_cap_is_refused_unread(length):
    padding = b"x" * (MAX_REPORT_BYTES + 1)
    read = RawLearner(b'{"message": "' + padding + b'"}', length=length).poll()
    assert read.report is None and read.invalid
    assert f"larger than {MAX_REPORT_BYTES} bytes" in read.error


def test_an_invalid_report_is_refused_naming_the_field_and_marked_invalid():
    read = RawLearner(b'{"phase": "Running", "globalStep": 1e400, "rewardMean": NaN}').poll()
    assert read.report is None and read.invalid
    assert "invalid report: globalStep: " in read.error and "rewardMean: " in read.error


def test_a_report_of_the_most_rollout_servers_status_holds_fits_well_under_the_cap():
    servers = [RolloutReplicaReport(replica=i, url=f"http://run-rollout-{i}.run-rollout.ns.svc:8000", ready=True,
                                    weight_version="v123456", samples=2**40, failures=2**40, retried=2**40,
                                    request_seconds=1e12, last_error="RuntimeError: " + "e" * 200)
               for i in range(1024)]
    report = ProgressReport(phase="Running", groups_total=2**40, rollout=servers, message="m" * 1000)
    size = len(report.model_dump_json(by_alias=True).encode())
    assert size < MAX_REPORT_BYTES / 2, size
    assert RawLearner(report.model_dump_json(by_alias=True).encode()).poll().report == report


def test_a_newer_learners_report_is_read_not_refused():
    """A learner image upgraded before the operator: fields, drop reasons and phases this version does not know
    must not make the report unreadable (the run's Stalled and Progressing would go Unknown)."""
    body = (b'{"phase": "Balancing", "groupsTotal": 10, "groupsTrained": 4, "tokensPerSecond": 9.5, '
            b'"dropped": {"stale": 1, "reward_timeout": 2}, '
            b'"rollout": [{"replica": 0, "url": "u", "ready": true, "kvCacheUsage": 0.5}]}')
    read = RawLearner(body).poll()
    assert read.error is None and not read.invalid
    assert read.report.phase == "Balancing" and read.report.groups_trained == 4 and read.report.dropped_total == 3
    assert read.report.rollout[0].ready
