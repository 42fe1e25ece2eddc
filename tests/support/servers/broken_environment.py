"""An environment server gone wrong, and an environment that plays against it through the learner's transport.

`BrokenEnvironmentServer(answers)`: `/reset` answers as a healthy server does; every other path as `answers` says
(default "ok"): "garbage" (200, not JSON), "5xx" (503), "hang" (no answer until the server stops), "nan" (a reward
of NaN), "nan_or_hang" (NaN, and no answer once in eight calls: each hang costs its episode the whole call
timeout, and a group an environment failed is generated again up to twice). `make_environment` (an
`environmentFactory`) is an environment with no tool, which any model plays: its reset and reward are calls to the
server at $BROKEN_ENVIRONMENT_URL.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo_trainer.agentic.transport import EnvironmentClient

#: "nan_or_hang": one call in this many hangs.
HANG_EVERY = 8

URL_ENV = "BROKEN_ENVIRONMENT_URL"


class BrokenEnvironmentServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, answers: dict[str, str] | None = None):
        self.answers = answers or {}
        self.release = threading.Event()
        self.turns = itertools.count()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> BrokenEnvironmentServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: BrokenEnvironmentServer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = "ok" if self.path == "/reset" else self.server.answers.get(self.path, "ok")
        if mode == "nan_or_hang":
            mode = "hang" if next(self.server.turns) % HANG_EVERY == 0 else "nan"
        if mode == "hang":
            self.server.release.wait()
            return
        status, body = {"ok": (200, b'{"observation": "", "result": "ok", "reward": 1.0}'),
                        "nan": (200, b'{"reward": NaN}'), "garbage": (200, b"<html>busy</html>"),
                        "5xx": (503, b"overloaded")}[mode]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        pass


class ScoringEnvironment:
    """Resets its episode on the server and asks it for the reward; no tool."""

    def __init__(self, url: str):
        self.server = EnvironmentClient(url)
        self.episode = ""

    def reset(self, **_row: object) -> None:
        self.episode = uuid.uuid4().hex
        self.server.post("/reset", {"episode": self.episode})

    def get_reward(self) -> object:
        return self.server.post("/reward", {"episode": self.episode})["reward"]


def make_environment() -> ScoringEnvironment:
    return ScoringEnvironment(os.environ[URL_ENV])
