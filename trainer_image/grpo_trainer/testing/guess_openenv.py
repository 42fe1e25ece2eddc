"""The guess game (grpo_trainer.testing.guess_env) as an OpenEnv environment, on openenv-core's server library: an
environment of `protocol: openenv`, which the learner plays with OpenEnv's client and no factory of the user's.

`python -m grpo_trainer.testing.guess_openenv --port 8765` serves it (openenv's FastAPI app under uvicorn): each
WebSocket session is one episode's environment. `reset(target=...)` (the dataset row's `target` column; the server
passes the row's other columns on only where reset takes them) opens the episode with reward 0.0 (no guess yet); the
MCP tool `guess(number)` answers "right" or "wrong", and its observation carries the episode's reward so far: 1.0 for
a right guess, guess_env.WRONG_GUESS_REWARD for a wrong one. The learner scores the episode with the last reward
reported, so the game scores as the HTTP one does.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

from .guess_env import FIRST_EPISODE_LINE, WRONG_GUESS_REWARD

#: The sessions (episodes in flight) one server holds at most: the rollout worker's `max_inflight_tasks` spread over
#: the servers, with room to spare.
MAX_SESSIONS = 256

_opened = 0
_opened_lock = threading.Lock()


def _note_opened() -> None:
    """Log one line when the server's first episode opens (one per episode would drown the log)."""
    global _opened
    with _opened_lock:
        _opened += 1
        first = _opened == 1
    if first:
        print(FIRST_EPISODE_LINE, flush=True)


class GuessOpenEnvironment(MCPEnvironment):
    """One session's game: the target, the last guess, and the tool `guess`."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self.target: int | None = None
        self.last_guess: int | None = None
        self._state = State()
        mcp = FastMCP("guess")

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the number.

            Args:
                number: The guess.
            """
            if self.target is None:
                raise ValueError("no episode: reset first")
            self.last_guess = int(number)
            return "right" if self.last_guess == self.target else "wrong"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None,
              **_: Any) -> Observation:
        if target is None:
            raise ValueError("reset needs the row's target")
        self.target, self.last_guess = int(target), None
        self._state = State(episode_id=episode_id, step_count=0)
        _note_opened()
        return Observation(done=False, reward=0.0)

    def reward(self) -> float:
        if self.last_guess is None:
            return 0.0
        return 1.0 if self.last_guess == self.target else WRONG_GUESS_REWARD

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            observation.reward = self.reward()
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=self.reward(),
                           metadata={"error": f"unknown action {type(action).__name__}: call the tool guess"})

    @property
    def state(self) -> State:
        return self._state


def make_app() -> Any:
    """The game's OpenEnv app (FastAPI): a GuessOpenEnvironment per session, up to MAX_SESSIONS at once."""
    return create_app(GuessOpenEnvironment, CallToolAction, CallToolObservation, env_name="guess",
                      max_concurrent_envs=MAX_SESSIONS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer.testing.guess_openenv",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    import uvicorn

    print(f"guess environment (openenv) serving on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(make_app(), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
