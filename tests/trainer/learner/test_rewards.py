"""Built-in rewards, and loading rewards by name or `module:function` with one-line errors."""

from __future__ import annotations

import math
import pickle

import pytest

from grpo_trainer.contract.config import BUILTIN_REWARD_NAMES, RewardConfig
from grpo_trainer.learner.rewards import (
    BUILTIN_REWARDS,
    CheckedReward,
    RewardError,
    RewardFunctionError,
    RewardResultError,
    accuracy,
    completion_text,
    constant,
    letter_a_fraction,
    load_reward,
    load_rewards,
)


def assistant(content: str, reasoning: str | None = None) -> list[dict]:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return [message]


def test_completion_text_reads_strings_and_trl_message_lists():
    assert completion_text("plain") == "plain"
    assert completion_text(assistant("answer", reasoning="think ")) == "think answer"
    assert completion_text([]) == ""


def test_letter_a_fraction_counts_letters_only():
    scores = letter_a_fraction([assistant("aaaa"), assistant("a b"), assistant("xyz"), assistant("1 2 ?")])
    assert scores == [1.0, 0.5, 0.0, 0.0]


def test_letter_a_fraction_spreads_over_random_text_so_groups_carry_signal():
    # The tiny example needs groups whose rewards differ from the first step on (else every group is dropped as
    # no_signal and the run stalls).
    texts = ["banana split", "kite", "apple pie", "moon", "a cat"]
    scores = letter_a_fraction([assistant(t) for t in texts])
    assert len(set(scores)) > 1


def test_constant_gives_every_completion_the_same_score():
    assert constant(["x", "y", "z"]) == [1.0, 1.0, 1.0]


def test_accuracy_compares_the_last_number_with_gsm8k_answers():
    completions = [assistant("so 3 + 4 = 7"), assistant("it is 1,234."), assistant("no idea"), assistant("8")]
    answers = ["steps #### 7", "#### 1234", "#### 5", "no number here"]
    assert accuracy(completions, answer=answers) == [1.0, 1.0, 0.0, None]


def test_accuracy_without_an_answer_column_says_so():
    with pytest.raises(ValueError, match="'answer' column"):
        accuracy([assistant("1")])


def test_load_builtin_and_user_rewards():
    assert load_reward(RewardConfig(name="constant")).func is constant
    user = load_reward(RewardConfig(function="grpo_trainer.learner.rewards:letter_a_fraction"))
    assert user.func is letter_a_fraction and user(completions=[assistant("ab")]) == [0.5]


def test_a_weight_other_than_one_scales_the_scores_and_keeps_the_name():
    reward = load_reward(RewardConfig(name="letter_a_fraction", weight=2.0))
    assert isinstance(reward, CheckedReward) and reward.__name__ == "letter_a_fraction"
    assert reward(completions=[assistant("aa"), assistant("ab")]) == [2.0, 1.0]
    unscorable = load_reward(RewardConfig(name="accuracy", weight=0.5))(completions=[assistant("1")], answer=["x"])
    assert unscorable == [None]


def test_rewards_survive_pickling_for_trl_spawned_worker():
    rewards = load_rewards([RewardConfig(name=n, weight=w) for n, w in [("constant", 1.0), ("accuracy", 3.0)]])
    restored = pickle.loads(pickle.dumps(rewards))
    assert restored[1](completions=[assistant("4")], answer=["#### 4"]) == [3.0]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (RewardConfig(name="letters"),
         "unknown reward 'letters'; built-in rewards: accuracy, constant, letter_a_fraction"),
        (RewardConfig(function="no_such_module_xyz:f"), "cannot import module 'no_such_module_xyz'"),
        (RewardConfig(function="grpo_trainer.learner.rewards:nope"),
         "module 'grpo_trainer.learner.rewards' has no attribute 'nope'"),
        (RewardConfig(function="grpo_trainer.learner.rewards:TARGET_LETTER"), "'TARGET_LETTER' is not callable"),
    ],
)
def test_bad_rewards_give_one_line_naming_them(config, expected):
    with pytest.raises(RewardError) as error:
        load_reward(config)
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_the_contract_names_exactly_the_builtin_rewards():
    """The operator refuses a reward name by the contract's list; the learner runs the functions of this module."""
    assert sorted(BUILTIN_REWARD_NAMES) == sorted(BUILTIN_REWARDS)


def test_every_builtin_returns_one_score_per_completion():
    completions = [assistant("a 1"), assistant("b 2")]
    for name, reward in BUILTIN_REWARDS.items():
        scores = reward(completions=completions, prompts=[[], []], completion_ids=[[1], [2]],
                        answer=["#### 1", "#### 3"])
        assert len(scores) == 2, name
        assert all(s is None or math.isfinite(s) for s in scores), name


def _user_reward(function: str):
    return load_reward(RewardConfig(function=f"tests.support.learner.bad_rewards:{function}"))


@pytest.mark.parametrize(
    ("function", "error", "expected"),
    [
        ("raises", RewardFunctionError,
         "reward function 'tests.support.learner.bad_rewards:raises' raised ValueError: could not convert string to "
         "float: 'bad'"),
        ("one_short", RewardResultError,
         "reward function 'tests.support.learner.bad_rewards:one_short' returned 1 scores for 2 completions"),
        ("strings", RewardResultError,
         "reward function 'tests.support.learner.bad_rewards:strings' returned 'bad' (str) for completion 0"),
    ],
)
def test_a_reward_that_breaks_the_contract_is_named_where_it_is_called(function, error, expected):
    with pytest.raises(error) as raised:
        _user_reward(function)(completions=[assistant("a"), assistant("b")])
    assert str(raised.value).startswith(expected)


def test_numpy_scores_and_none_pass_the_check():
    import numpy as np

    reward = CheckedReward(lambda completions, **_: np.array([1, 0.5]), weight=2.0, label="m:f")
    assert reward(completions=["a", "b"]) == [2.0, 1.0]
    assert CheckedReward(lambda completions, **_: (None, True))(completions=["a", "b"]) == [None, 1.0]
