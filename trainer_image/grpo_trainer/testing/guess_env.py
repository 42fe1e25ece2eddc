"""A small real environment for agentic runs: guess a prompt's number, over plain HTTP, in a process of its own.

`python -m grpo_trainer.testing.guess_env --port 8765` serves the game; `make_environment` (the run's
`training.environmentFactory: grpo_trainer.testing.guess_env:make_environment`) returns a client for the server at
`$GUESS_ENV_URL`. One episode: `reset(target=...)` (the dataset row's `target` column) opens it on the server, the
policy calls the tool `guess(number)` (the server answers "right" or "wrong"), and `get_reward()` is 1.0 when the
last guess was right, WRONG_GUESS_REWARD when it was wrong, and 0.0 when the policy made no guess: playing by the
rules is worth half a right guess on every prompt alike, which a policy learns across prompts (the tiny tool
model, taught to play in a third of its episodes, learns to play in most), while the right number is each prompt's
own. The server
holds the episodes, as a sandbox or game server would. The client reaches it through the learner's transport
(grpo_trainer.agentic.transport): when the server is down, hung or answers garbage, the episode's environment failed
and the episode is unscorable; a guess the server refuses (400) is the policy's mistake, shown to it.

The server is stdlib only (http.server): the environment's image needs nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

#: An environment named `guess` in spec.environments: the operator hands its Service's URL to the learner's pods in this
#: variable (grpo_trainer.contract.pod_env.environment_url_variable; spelled out, as the server imports nothing of
#: ours).
SERVICE_URL_ENV = "GRPO_ENVIRONMENT_GUESS_URL"
URL_ENV = "GUESS_ENV_URL"
DEFAULT_URL = "http://127.0.0.1:8765"
#: A wrong guess's reward: more than no guess at all, and enough that playing, not luck, is most of the reward.
WRONG_GUESS_REWARD = 0.5
#: The one line the server logs about its episodes, when the first one opens (one per request would drown the log):
#: from there the run's episodes are under way.
FIRST_EPISODE_LINE = "guess environment: first episode opened"


class GuessGame:
    """The server's state: episode id -> (target, last guess)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, list[int | None]] = {}
        self.opened = 0  # episodes ever opened

    def reset(self, episode: str, target: int) -> str:
        with self._lock:
            self._episodes[episode] = [int(target), None]
            self.opened += 1
            first = self.opened == 1
        if first:
            print(FIRST_EPISODE_LINE, flush=True)
        return ""

    def guess(self, episode: str, number: int) -> str:
        with self._lock:
            state = self._episodes[episode]
            state[1] = int(number)
            return "right" if state[0] == state[1] else "wrong"

    def reward(self, episode: str) -> float:
        with self._lock:
            target, last = self._episodes.pop(episode)
        if last is None:
            return 0.0
        return 1.0 if last == target else WRONG_GUESS_REWARD


class Game(Protocol):
    """What a game server serves: episodes opened, played and scored by id (GuessGame, and the other games here)."""

    opened: int

    def reset(self, episode: str, target: int) -> str: ...

    def guess(self, episode: str, number: int) -> str: ...

    def reward(self, episode: str) -> float: ...


class GameServer(ThreadingHTTPServer):
    """Every client request is a new connection, and a run keeps as many episodes in flight as the rollout worker's
    `max_inflight_tasks`: the standard library's backlog of 5 connections reset the ones past it."""

    request_queue_size = 256
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], game: Game):
        super().__init__(address, handler)
        self.game = game  # what it serves: its episodes, and how many opened


def serve_game(game: Game, port: int, host: str = "127.0.0.1") -> GameServer:
    """`game` over HTTP: POST /reset, /guess and /reward with the episode's id (a reset's `target` passed when the
    request names one), GET /health; a request the game refuses (a missing field, a wrong type) answers 400."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/reset":
                    target = {} if body.get("target") is None else {"target": int(body["target"])}
                    self._reply(200, {"observation": game.reset(str(body["episode"]), **target)})
                elif self.path == "/guess":
                    self._reply(200, {"result": game.guess(str(body["episode"]), int(body["number"]))})
                elif self.path == "/reward":
                    self._reply(200, {"reward": game.reward(str(body["episode"]))})
                else:
                    self._reply(404, {"error": f"no {self.path}"})
            except (KeyError, ValueError, TypeError) as error:
                self._reply(400, {"error": f"{type(error).__name__}: {error}"})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: object) -> None:
            pass  # one line per request would drown the run's logs

    return GameServer((host, port), Handler, game)


def make_server(port: int, host: str = "127.0.0.1") -> GameServer:
    return serve_game(GuessGame(), port, host)


class GuessEnvironment:
    """One client of the game server: TRL resets it per episode and offers `guess` to the policy as a tool."""

    def __init__(self, url: str):
        from grpo_trainer.agentic.transport import EnvironmentClient  # the learner's; the server needs none of it

        self.server = EnvironmentClient(url)
        self.episode = ""

    def reset(self, target: int, **_row: object) -> str | None:
        self.episode = uuid.uuid4().hex
        self.server.post("/reset", {"episode": self.episode, "target": int(target)})
        return None  # the dataset's prompt says what to do

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: The guess.
        """
        return self.server.post("/guess", {"episode": self.episode, "number": number})["result"]

    def get_reward(self) -> float:
        return self.server.post("/reward", {"episode": self.episode})["reward"]


def make_environment() -> GuessEnvironment:
    """The run's environment factory: a client of the run's own `guess` environment server
    (`$GRPO_ENVIRONMENT_GUESS_URL`), else of the server at `$GUESS_ENV_URL`."""
    return GuessEnvironment(os.environ.get(SERVICE_URL_ENV) or os.environ.get(URL_ENV, DEFAULT_URL))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer.testing.guess_env",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = make_server(args.port, args.host)
    print(f"guess environment serving on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
