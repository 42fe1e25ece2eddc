"""The higher/lower game (grpo_trainer.testing.higher_lower_env): its rules on the server, what a policy that ignores
the answers can win against one that follows them, and its factory playing through the learner's transport."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from grpo_trainer.agentic.tools import CallBounds, episode_of, load_environment_factory
from grpo_trainer.agentic.transport import ToolCallRejected
from grpo_trainer.contract.pod_env import environment_url_variable
from grpo_trainer.testing import higher_lower_env
from grpo_trainer.testing.higher_lower_env import (
    FIRST_EPISODE_LINE,
    GUESSES,
    HIGHER,
    LOWER,
    NUMBERS,
    OVER,
    RIGHT,
    SUMMARY_EVERY,
    HigherLowerGame,
    make_server,
)

FACTORY = "grpo_trainer.testing.higher_lower_env:make_environment"
BOUNDS = CallBounds(call_timeout_s=30.0, episode_timeout_s=60.0)


def test_each_guess_is_answered_higher_lower_or_right_and_only_the_episodes_guesses_count():
    game = HigherLowerGame()
    game.reset("a", target=3)
    assert [game.guess("a", 2), game.guess("a", 3), game.guess("a", 3)] == [HIGHER, RIGHT, OVER]
    assert game.reward("a") == 1.0
    game.reset("b", target=1)
    assert [game.guess("b", 2), game.guess("b", 3), game.guess("b", 1)] == [LOWER, LOWER, OVER]
    assert game.reward("b") == 0.0  # the right number came after the episode's guesses were spent
    game.reset("c", target=2)
    assert game.reward("c") == 0.0  # no guess
    with pytest.raises(KeyError):
        game.reward("c")  # an episode is scored once
    with pytest.raises(ValueError, match="target 4 is not in 1..3"):
        game.reset("d", target=4)


def test_the_server_draws_each_episodes_number_evenly():
    game = HigherLowerGame(random.Random(0))
    drawn = Counter()
    for index in range(3000):
        game.reset(str(index))
        answers = [game.guess(str(index), 1), game.guess(str(index), 2)]
        drawn[1 if answers[0] == RIGHT else 2 if answers[1] == RIGHT else 3] += 1
    assert set(drawn) == set(NUMBERS) and min(drawn.values()) > 900, drawn


def _win_rate(first: int, second, rng: random.Random, episodes: int = 3000) -> float:
    """A policy's right-answer rate: `first`, then `second(first, answer)`."""
    game = HigherLowerGame(rng)
    wins = 0.0
    for index in range(episodes):
        episode = str(index)
        game.reset(episode)
        answer = game.guess(episode, first)
        if answer != RIGHT:
            game.guess(episode, second(first, answer))
        wins += game.reward(episode)
    return wins / episodes


def test_only_a_policy_that_follows_the_answers_wins_more_than_two_thirds():
    rng = random.Random(1)
    follows = _win_rate(2, lambda first, answer: first + 1 if answer == HIGHER else first - 1, rng)
    assert follows == 1.0
    # Ignoring the answers: the best is two different numbers (2/3); two numbers drawn evenly and independently, 5/9.
    assert _win_rate(1, lambda first, answer: 3, rng) == pytest.approx(2 / 3, abs=0.03)
    assert _win_rate(2, lambda first, answer: 1, rng) == pytest.approx(2 / 3, abs=0.03)
    taught = HigherLowerGame(rng)
    wins = 0.0
    for index in range(3000):
        taught.reset(str(index))
        for _ in range(GUESSES):
            taught.guess(str(index), rng.choice(NUMBERS))
        wins += taught.reward(str(index))
    assert wins / 3000 == pytest.approx(5 / 9, abs=0.03)


def test_the_server_counts_the_second_guesses_that_followed_the_answer_and_logs_its_tallies(capsys):
    game = HigherLowerGame()
    for index in range(SUMMARY_EVERY):
        episode = str(index)
        game.reset(episode, target=3)
        game.guess(episode, 1)  # higher
        game.guess(episode, 3 if index % 4 else 1)  # a quarter go back to 1, against the answer
        game.reward(episode)
    assert capsys.readouterr().out.splitlines() == [
        FIRST_EPISODE_LINE,
        f"higher-lower environment: {SUMMARY_EVERY} episodes scored, right 0.75 (48), second guesses that followed the"
        f" answer 0.75 (48/{SUMMARY_EVERY})"]


@pytest.fixture()
def game_server():
    server = make_server(0, seed=3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_factory_plays_through_the_transport_against_the_server_named_for_an_environment_called_higher_lower(
        game_server, monkeypatch):
    url = f"http://127.0.0.1:{game_server.server_address[1]}"
    assert environment_url_variable("higher-lower") == higher_lower_env.SERVICE_URL_ENV
    monkeypatch.setenv(higher_lower_env.URL_ENV, "http://127.0.0.1:9")  # the run's own server comes first
    monkeypatch.setenv(higher_lower_env.SERVICE_URL_ENV, url)
    rewards = []
    for _ in range(30):
        environment = load_environment_factory(FACTORY, BOUNDS)()  # guarded, as TRL's pool holds it
        assert environment.reset(prompt="guess my number from 1 to 3") is None
        answer = environment.guess(number=2)
        if answer != RIGHT:
            assert environment.guess(number=3 if answer == HIGHER else 1) == RIGHT
        rewards.append(environment.get_reward())
        assert episode_of(environment).failure is None
    assert rewards == [1.0] * 30 and game_server.game.opened == 30
    environment = load_environment_factory(FACTORY, BOUNDS)()
    environment.reset()
    with pytest.raises(ToolCallRejected, match="HTTP 400"):  # the server refuses it; the policy is shown why
        environment.guess(number="two")
