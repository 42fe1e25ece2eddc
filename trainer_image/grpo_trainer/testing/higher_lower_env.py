"""A game whose answers matter, over plain HTTP, in a process of its own: find the server's number with `guess` calls,
each answered "higher", "lower" or "right".

`python -m grpo_trainer.testing.higher_lower_env --port 8766` serves the game; `make_environment` (the run's
`training.environmentFactory: grpo_trainer.testing.higher_lower_env:make_environment`) returns a client for the server
at `$GRPO_ENVIRONMENT_HIGHER_LOWER_URL`, else `$HIGHER_LOWER_ENV_URL`. One episode: `reset()` opens it on the server,
which draws its number evenly from NUMBERS (the prompt says nothing of it); the policy has GUESSES calls of the tool
`guess(number)`, and `get_reward()` is 1.0 when one of them was right, else 0.0: the reward is the episode's
right answer, so a run's mean reward is its right-answer rate.

Why the answers matter: a first guess is right a third of the time, whatever it is. A policy that ignores the answers
wins at most 2/3 of its episodes (two different numbers); one that guesses 2 and then goes where the answer points
wins every episode. A rate above 2/3 needs the environment's answers. The server also counts, over every episode it
scored, how many second guesses went where the answer pointed, and logs its tallies every SUMMARY_EVERY episodes.

The server is the guess game's (grpo_trainer.testing.guess_env.serve_game: stdlib only) and holds the episodes;
the client reaches it through the learner's transport (grpo_trainer.agentic.transport), so a server down, hung or
answering garbage fails the episode as the environment's, and a guess it refuses (400) is the policy's mistake,
shown to it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import uuid
from dataclasses import dataclass, field

from .guess_env import GameServer, serve_game

#: An environment named `higher-lower` in spec.environments: the operator hands its Service's URL to the learner's
#: pods in this variable (grpo_trainer.contract.pod_env.environment_url_variable; spelled out, as the server imports
#: nothing of ours).
SERVICE_URL_ENV = "GRPO_ENVIRONMENT_HIGHER_LOWER_URL"
URL_ENV = "HIGHER_LOWER_ENV_URL"
DEFAULT_URL = "http://127.0.0.1:8766"
#: The numbers the server draws from, and the guesses an episode has: after a first guess of 2 the answer decides the
#: second, and a policy that ignores the answers is right in at most 2/3 of its episodes.
NUMBERS = range(1, 4)
GUESSES = 2
RIGHT, HIGHER, LOWER = "right", "higher", "lower"
#: The answer to a guess once the episode's guesses are spent or its number found: it scores nothing.
OVER = "the game is over"
FIRST_EPISODE_LINE = "higher-lower environment: first episode opened"
#: Every so many scored episodes the server logs its tallies (one line per episode would drown the log).
SUMMARY_EVERY = 64


@dataclass
class Episode:
    target: int
    guesses: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return RIGHT in self.answers

    def followed_the_answer(self) -> bool | None:
        """Whether the second guess went where the first answer pointed; None where there was no second guess."""
        if len(self.guesses) < 2:
            return None
        first, second = self.guesses[:2]
        return second > first if self.answers[0] == HIGHER else second < first


@dataclass(frozen=True)
class Tallies:
    """What the server scored: episodes, those found, and the second guesses and those that followed the answer."""

    episodes: int = 0
    right: int = 0
    second_guesses: int = 0
    followed: int = 0

    def line(self) -> str:
        def rate(part: int, whole: int) -> str:
            return f"{part / whole:.2f}" if whole else "n/a"

        return (f"higher-lower environment: {self.episodes} episodes scored, right {rate(self.right, self.episodes)}"
                f" ({self.right}),"
                f" second guesses that followed the answer {rate(self.followed, self.second_guesses)}"
                f" ({self.followed}/{self.second_guesses})")


class HigherLowerGame:
    """The server's state: episode id -> Episode, and the tallies of those scored."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._lock = threading.Lock()
        self._rng = rng or random.Random()
        self._episodes: dict[str, Episode] = {}
        self.opened = 0  # episodes ever opened
        self.tallies = Tallies()

    def reset(self, episode: str, target: int | None = None) -> str:
        """Open an episode on a number drawn evenly from NUMBERS (or `target`, which a test names)."""
        if target is not None and target not in NUMBERS:
            raise ValueError(f"target {target} is not in {NUMBERS.start}..{NUMBERS.stop - 1}")
        with self._lock:
            drawn = self._rng.choice(NUMBERS) if target is None else target
            self._episodes[episode] = Episode(drawn)
            self.opened += 1
            first = self.opened == 1
        if first:
            print(FIRST_EPISODE_LINE, flush=True)
        return f"guess my number from {NUMBERS.start} to {NUMBERS.stop - 1}"

    def guess(self, episode: str, number: int) -> str:
        with self._lock:
            state = self._episodes[episode]
            if state.found or len(state.guesses) >= GUESSES:
                return OVER
            answer = RIGHT if number == state.target else HIGHER if state.target > number else LOWER
            state.guesses.append(number)
            state.answers.append(answer)
            return answer

    def reward(self, episode: str) -> float:
        with self._lock:
            state = self._episodes.pop(episode)
            followed = state.followed_the_answer()
            tallies = self.tallies = Tallies(
                episodes=self.tallies.episodes + 1, right=self.tallies.right + state.found,
                second_guesses=self.tallies.second_guesses + (followed is not None),
                followed=self.tallies.followed + bool(followed))
        if tallies.episodes % SUMMARY_EVERY == 0:
            print(tallies.line(), flush=True)
        return 1.0 if state.found else 0.0


def make_server(port: int, host: str = "127.0.0.1", seed: int | None = None) -> GameServer:
    """The game over HTTP as the guess game's server serves it (grpo_trainer.testing.guess_env.serve_game)."""
    return serve_game(HigherLowerGame(random.Random(seed)), port, host)


class HigherLowerEnvironment:
    """One client of the game server: TRL resets it per episode and offers `guess` to the policy as a tool."""

    def __init__(self, url: str):
        from grpo_trainer.agentic.transport import EnvironmentClient  # the learner's; the server needs none of it

        self.server = EnvironmentClient(url)
        self.episode = ""

    def reset(self, **_row: object) -> str | None:
        self.episode = uuid.uuid4().hex
        self.server.post("/reset", {"episode": self.episode})
        return None  # the dataset's prompt says what to do

    def guess(self, number: int) -> str:
        """Guess the number: the answer says higher, lower or right.

        Args:
            number: The guess.
        """
        return self.server.post("/guess", {"episode": self.episode, "number": number})["result"]

    def get_reward(self) -> float:
        return self.server.post("/reward", {"episode": self.episode})["reward"]


def make_environment() -> HigherLowerEnvironment:
    """The run's environment factory: a client of the run's own `higher-lower` environment server
    (`$GRPO_ENVIRONMENT_HIGHER_LOWER_URL`), else of the server at `$HIGHER_LOWER_ENV_URL`."""
    return HigherLowerEnvironment(os.environ.get(SERVICE_URL_ENV) or os.environ.get(URL_ENV, DEFAULT_URL))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer.testing.higher_lower_env",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=None, help="the numbers' seed (default: a fresh one)")
    args = parser.parse_args(argv)
    server = make_server(args.port, args.host, args.seed)
    print(f"higher-lower environment serving on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
