"""Tools and environments: loaded as rewards are, guarded so a failing environment server makes its episode
unscorable, and the rollout loop's stamps that keep a forked group's accounting exact."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
from accelerate import PartialState
from pydantic import ValidationError
from transformers.utils import get_json_schema
from trl.experimental.async_grpo.async_rollout_worker import TrainingSequence

from grpo_trainer.agentic.episodes import (
    ENVIRONMENT_FAILED_KEY,
    EPISODES_KEY,
    GROUP_ROWS_KEY,
    EpisodeCounts,
    EpisodeQueue,
)
from grpo_trainer.agentic.tools import (
    CallBounds,
    ToolError,
    episode_of,
    is_abandoned,
    load_environment_factory,
    load_tools,
)
from grpo_trainer.agentic.transport import EnvironmentClient, EnvironmentFailure, ToolCallRejected
from grpo_trainer.contract.config import TrainingConfig
from grpo_trainer.rollout.worker import EpisodeRolloutLoop
from grpo_trainer.testing.guess_env import FIRST_EPISODE_LINE, WRONG_GUESS_REWARD, GuessEnvironment, make_server
from tests.support.servers.broken_environment import BrokenEnvironmentServer


# ---------------------------------------------------------------------------------------------------- loading
def test_a_tool_that_does_not_import_is_one_line_naming_it():
    with pytest.raises(ToolError, match=r"^tool 'no_such_module:f': cannot import module 'no_such_module'"):
        load_tools(["no_such_module:f"])
    with pytest.raises(ToolError, match=r"^tool 'math:no_such': module 'math' has no attribute 'no_such'$"):
        load_tools(["math:no_such"])
    with pytest.raises(ToolError, match=r"^environment factory 'game' 'math:nope'"):
        load_environment_factory({"game": "math:nope"}, BOUNDS)


@pytest.mark.parametrize("training, message", [
    ({"tools": ["not an import path"]}, "tool 'not an import path' must look like 'module:function'"),
    ({"environmentFactory": "nocolon"}, "environment factory 'nocolon' must look like 'module:function'"),
    ({"environmentFactories": {"9lives": "m:f"}}, "environment name '9lives' is not a name"),
    ({"environmentFactory": "m:f", "environmentFactories": {"a": "m:f"}}, "not both"),
    ({"maxToolCallingIterations": 0}, "greater than or equal to 1"),
])
def test_the_spec_refuses_what_cannot_name_user_code(training, message):
    with pytest.raises(ValidationError, match=message):
        TrainingConfig.model_validate(training)


def test_grporun_local_refuses_a_tool_that_does_not_import_as_it_does_a_reward(tmp_path):
    from grpo_operator.api import parse_spec
    from grpo_operator.local.plan import check_rewards
    from grpo_operator.manifest import ManifestInvalid

    spec = parse_spec({"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "constant"}],
                       "training": {"tools": ["json:dumps", "no_such_module:search"]}})
    with pytest.raises(ManifestInvalid) as refused:
        check_rewards(spec)
    assert str(refused.value).startswith("spec.training.tools[1]: tool 'no_such_module:search': cannot import")


# ---------------------------------------------------------------------------------------------------- guarding
@pytest.fixture(scope="module")
def game_url():
    server = make_server(0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class Guess(GuessEnvironment):
    pass


#: Bounds no call of a test's healthy server comes near.
BOUNDS = CallBounds(call_timeout_s=30.0, episode_timeout_s=60.0)


def guarded(url: str, bounds: CallBounds = BOUNDS, factory: str = "grpo_trainer.testing.guess_env:make_environment"):
    """A guarded environment from `factory` (its TRL pool's instance), playing against the server at `url`."""
    environment = load_environment_factory(factory, bounds)()
    environment.server = EnvironmentClient(url)
    return environment


def test_a_guarded_environment_plays_as_the_users_and_keeps_its_tool_schema(game_url):
    environment = guarded(game_url)
    environment.reset(target=3, prompt="ignored")
    assert environment.guess(number=3) == "right" and environment.get_reward() == 1.0
    assert episode_of(environment).failure is None
    assert type(environment).__name__ == "GuessEnvironment"
    assert get_json_schema(environment.guess) == get_json_schema(GuessEnvironment("http://x").guess)


def test_the_guess_factory_plays_against_the_server_the_operator_named_for_an_environment_called_guess(
        game_url, monkeypatch):
    from grpo_trainer.contract.pod_env import environment_url_variable
    from grpo_trainer.testing import guess_env

    assert environment_url_variable("guess") == guess_env.SERVICE_URL_ENV
    monkeypatch.setenv(guess_env.URL_ENV, "http://127.0.0.1:9")  # the run's own server comes first
    monkeypatch.setenv(guess_env.SERVICE_URL_ENV, game_url)
    environment = guess_env.make_environment()
    environment.reset(target=2)
    assert environment.guess(number=2) == "right" and environment.get_reward() == 1.0


def test_the_game_server_takes_as_many_episodes_at_once_as_a_run_keeps_in_flight(game_url):
    """A client opens a connection per request: with the standard library's backlog of 5, a burst of 64 episodes had
    about one in ten reset by the server (measured: 161 of 2000), each an environment failure in the run."""
    from concurrent.futures import ThreadPoolExecutor

    def episode(target: int) -> float:
        environment = GuessEnvironment(game_url)
        environment.reset(target=target)
        for number in range(4):
            environment.guess(number)
        return environment.get_reward()

    with ThreadPoolExecutor(64) as pool:
        rewards = list(pool.map(episode, [i % 4 for i in range(640)]))
    assert rewards == [1.0 if i % 4 == 3 else WRONG_GUESS_REWARD for i in range(640)]


def test_the_game_server_says_once_that_its_first_episode_opened(capsys):
    """The one line the node tier's run waits for before it deletes the game's pod: episodes are under way."""
    server = make_server(0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert capsys.readouterr().out == ""
        for target in range(3):
            GuessEnvironment(url).reset(target=target)
    finally:
        server.shutdown()
    assert capsys.readouterr().out.splitlines() == [FIRST_EPISODE_LINE]


def test_a_server_that_is_down_fails_the_episode_and_its_reward_is_none():
    environment = guarded("http://127.0.0.1:9")  # nothing listens there
    assert environment.reset(target=3) is None
    episode = episode_of(environment)
    assert episode.failure.startswith("reset raised") and episode.environment == "make_environment"
    with pytest.raises(EnvironmentFailure):
        environment.guess(number=3)  # TRL counts it as a tool failure and tells the policy
    assert environment.get_reward() is None


def test_a_bad_argument_is_the_policys_tool_failure_not_the_environments(game_url):
    environment = guarded(game_url)
    environment.reset(target=3)
    with pytest.raises(ToolCallRejected, match="HTTP 400"):  # the server's answer, which the policy is shown
        environment.guess(number="three")
    assert episode_of(environment).failure is None


# ---------------------------------------------------------------------------------------------------- the loop
def score_with_loop(rewards, rows_per_episode, failed, turns=2, env_type=GuessEnvironment):
    """EpisodeRolloutLoop's `_score_group` (TRL's, then ours) on one group whose environment rewards are `rewards`."""
    n = len(rewards)
    loop = EpisodeRolloutLoop.__new__(EpisodeRolloutLoop)
    loop.reward_funcs, loop.reward_func_names, loop._provides_rollout_reward = [], ["Env"], False
    loop._env_reward_types = [env_type]
    completions = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "x"},
                    {"role": "assistant", "content": "done"}][: 2 * turns - 1] for _ in range(n)]
    loop._episodes = {}
    for completion, is_failed in zip(completions, failed, strict=True):
        record = SimpleNamespace(environment="guess", failure="reset raised OSError: down" if is_failed else None)
        loop._episodes[id(completion)] = record
    group = SimpleNamespace(
        completions=completions, prompts=[[{"role": "user", "content": "p"}]] * n, completions_ids=[[1]] * n,
        reward_kwargs={}, tool_call_counts=[1] * n, tool_failure_counts=[int(f) for f in failed],
        model_version=0, group_id=5, env_rewards=[(env_type, r) for r in rewards], rollout_rewards=[None] * n,
        completions_sequences=[[TrainingSequence([1, 2], [0, 1], [0.0, 0.0], "id")] * rows
                               for rows in rows_per_episode],
    )
    PartialState(cpu=True)
    return asyncio.run(loop._score_group(group))


def test_a_failed_episode_is_unscorable_and_the_rest_renormalise_over_the_episodes_not_the_rows():
    # Episode 0 forked into two rows; episode 1's environment failed (its reward 1.0 came from a stale answer).
    samples = score_with_loop([0.0, 1.0, 1.0, 0.0], [2, 1, 1, 1], [False, True, False, False])
    assert len(samples) == 5
    assert math.isnan(samples[2].metrics["reward"]) and samples[2].advantage == 0.0
    # Marked as the environment's failure (the learner regenerates a group it leaves untrained), and only it.
    assert [ENVIRONMENT_FAILED_KEY in s.metrics for s in samples] == [False, False, True, False, False]
    remaining = np.array([0.0, 1.0, 0.0])
    expected = (remaining - remaining.mean()) / (remaining.std() + 1e-8)
    assert [s.advantage for s in (samples[0], samples[1], samples[3], samples[4])] == pytest.approx(
        [expected[0], expected[0], expected[1], expected[2]])
    assert [s.metrics[GROUP_ROWS_KEY] for s in samples] == [5.0] * 5
    stamp = samples[0].metrics[EPISODES_KEY]
    assert stamp == {"episodes": 4, "rows": 5, "turns": 8, "tool_calls": 4, "tool_failures": 1, "forked": 1,
                     "environment_failures": {"guess": 1}}
    assert all(EPISODES_KEY not in s.metrics for s in samples[1:])


def test_the_episode_queue_counts_each_group_once_and_takes_the_stamp_out():
    import queue

    samples = score_with_loop([0.0, 1.0], [1, 1], [False, False])
    inner = queue.Queue()
    for s in samples:
        inner.put(s)
    counts = EpisodeCounts()
    episodes = EpisodeQueue(inner, counts)
    got = [episodes.get(timeout=1), episodes.get_nowait()]
    assert all(EPISODES_KEY not in s.metrics for s in got)
    report = counts.report()
    assert (report.episodes, report.rows, report.turns, report.tool_calls, report.forked) == (2, 2, 4, 2, 0)
    assert report.turns_per_episode == 2.0 and report.fork_fraction == 0.0


# ---------------------------------------------------------------------------------------------------- the transport
@pytest.fixture
def misbehaving():
    """Start a game server gone wrong: every path but /reset answers as `mode` says."""
    servers = []

    def start(mode: str) -> BrokenEnvironmentServer:
        servers.append(BrokenEnvironmentServer({"/guess": mode}).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("mode, cause", [
    ("garbage", "the answer is not JSON: '<html>busy</html>'"),
    ("5xx", "HTTP 503: overloaded"),
    ("refused", "ConnectError"),
])
def test_an_environment_that_answers_garbage_a_5xx_or_not_at_all_fails_the_episode_as_its_own(misbehaving, mode,
                                                                                                    cause):
    """Judged by the transport: an httpx ConnectError is no OSError, and it failed the environment all the same."""
    server = misbehaving("ok" if mode == "refused" else mode)
    environment = guarded(server.url)
    environment.reset(target=3)
    assert episode_of(environment).failure is None
    if mode == "refused":
        server.stop()
    with pytest.raises(EnvironmentFailure):
        environment.guess(number=3)
    failure = episode_of(environment).failure
    assert failure.startswith(f"guess raised EnvironmentFailure: POST {server.url}/guess: ") and cause in failure


def tool_call(name: str, **arguments) -> dict:
    return {"function": {"name": name, "arguments": arguments}}


def rollout_loop(tokenizer, factory: str, bounds: CallBounds, inflight: int = 4) -> EpisodeRolloutLoop:
    """The worker child's loop as TRL builds it (its tool thread pool, its pool of environment instances), with no
    vLLM server: these tests run its tool calls, not its generation."""
    import queue

    from datasets import Dataset

    return EpisodeRolloutLoop(
        model_name="tiny", dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "guess"}], "target": 3}]),
        reward_funcs=[], processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
        rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
        heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(),
        exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(),
        environment_factory=load_environment_factory(factory, bounds), num_generations=2,
        max_inflight_tasks=inflight)


async def play(loop: EpisodeRolloutLoop, calls: list[dict], **row) -> tuple[object, list[dict]]:
    """One episode's environment as TRL's loop plays it: drawn from its pool, reset in its tool threads, the tool
    calls run by TRL's own `_execute_tool_calls`, handed back to the pool."""
    import functools

    pool = loop._environment_pool[None]
    environment = pool.pop() if pool else loop.environment_factories[None]()
    await asyncio.get_running_loop().run_in_executor(loop._tool_pool, functools.partial(environment.reset, **row))
    tool_dict = {name: getattr(environment, name) for name in ("guess", "wait") if hasattr(environment, name)}
    messages, _, _ = await loop._execute_tool_calls(calls, tool_dict)
    pool.append(environment)
    return environment, messages


def test_a_4xx_goes_back_to_the_policy_as_the_tools_answer_and_the_episode_trains(tool_tokenizer, game_url,
                                                                                      monkeypatch):
    from grpo_trainer.testing import guess_env

    monkeypatch.setenv(guess_env.SERVICE_URL_ENV, game_url)
    loop = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment", BOUNDS)
    environment, (message,) = asyncio.run(play(loop, [tool_call("guess", number="three")], target=3))
    assert "HTTP 400" in message["content"] and "ValueError" in message["content"]  # the server's word for it
    assert episode_of(environment).failure is None and loop._counters["tools/guess/failure_total"] == 1


def test_the_loop_builds_the_response_template_once_and_parses_as_transformers_does(tool_tokenizer, monkeypatch):
    from transformers.utils.chat_parsing import response_templates
    from trl.chat_template_utils import parse_response

    loop = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment", BOUNDS)
    prompt = tool_tokenizer.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True,
                                                tokenize=False)
    completion = tool_tokenizer.encode('<tool_call>\n{"name": "guess", "arguments": {"number": 3}}\n</tool_call>',
                                       add_special_tokens=False)
    prefix = tool_tokenizer.encode(prompt, add_special_tokens=False)
    built = []
    build = response_templates._build_field
    monkeypatch.setattr(response_templates, "_build_field", lambda *a: built.append(a) or build(*a))
    parsed = [parse_response(loop.tokenizer, completion, prefix=prefix) for _ in range(3)]
    assert built == []  # not rebuilt at each parse
    assert parsed[0]["tool_calls"][0]["function"] == {"name": "guess", "arguments": {"number": 3}}
    assert parsed[0] == parsed[2]


def test_the_loop_sends_the_learner_no_metric_of_a_tool_name_the_policy_made_up(tool_tokenizer):
    """TRL names a per-tool metric after whatever name the policy wrote; MLflow refuses a step's whole batch, loss
    included, over a name like `tools//call_total`, so such a key never leaves the worker child."""
    loop = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment", BOUNDS)
    loop._push_metrics({"tools/guess/call_total": 1.0, "tools//call_total": 1.0, "tools/guess(/latency_s": 0.2,
                        "tools/unknown_name_total": 2.0})
    loop._metrics_queue.flush()
    assert loop._metrics_queue.inner.get_nowait() == {"tools/guess/call_total": 1.0, "tools/unknown_name_total": 2.0}


def test_the_loop_renders_a_prompt_without_tools_once_as_the_tokenizer_does(tool_tokenizer):
    loop = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment", BOUNDS)
    again = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment", BOUNDS)
    cache = again.tokenizer.apply_chat_template
    assert cache.render.__self__ is tool_tokenizer  # one cache on the tokenizer, not a cache of a cache
    hits_before = cache.hits
    prompt = [{"role": "user", "content": f"guess ({uuid.uuid4()})"}]  # a prompt no other test rendered
    # TRL's first turn of each completion of a group (async_rollout_worker.py:917 (trl 1.16.0)), here twice.
    rendered = [loop.tokenizer.apply_chat_template(prompt, return_dict=False, add_generation_prompt=True, tools=None,
                                                   chat_template=loop.chat_template, **loop.chat_template_kwargs)
                for _ in range(2)]
    assert rendered[0] == rendered[1] == type(tool_tokenizer).apply_chat_template(
        tool_tokenizer, prompt, return_dict=False, add_generation_prompt=True)
    assert cache.hits - hits_before == 1


# ---------------------------------------------------------------------------------------------------- deadlines
RELEASE_HANGING = threading.Event()


class HangingEnvironment:
    """An environment whose tool never returns (until the test releases it): no transport, no timeout of its own."""

    def reset(self, **_row: object) -> None:
        return None

    def wait(self) -> str:
        """Wait for the answer."""
        RELEASE_HANGING.wait()
        return "late"

    def get_reward(self) -> float:
        return 0.0


def make_hanging_environment() -> HangingEnvironment:
    return HangingEnvironment()


def test_a_hung_server_costs_its_episodes_at_the_deadline_and_no_thread_outlives_it(tool_tokenizer, misbehaving,
                                                                                    monkeypatch):
    """100 calls to a server that never answers: each ends at callTimeoutSeconds, failing its episode as the
    environment's and naming the call; TRL's tool threads are free, the guard's own threads end with the calls, and no
    instance whose call was abandoned goes back to TRL's pool."""
    from grpo_trainer.testing import guess_env

    server = misbehaving("hang")
    monkeypatch.setenv(guess_env.SERVICE_URL_ENV, server.url)
    loop = rollout_loop(tool_tokenizer, "grpo_trainer.testing.guess_env:make_environment",
                        CallBounds(call_timeout_s=1.0, episode_timeout_s=60.0), inflight=50)

    async def hundred():
        return await asyncio.gather(*(play(loop, [tool_call("guess", number=3)], target=3) for _ in range(100)))

    played = asyncio.run(hundred())
    for environment, (message,) in played:
        failure = episode_of(environment).failure
        # The guess hangs; on a loaded machine a hundred resets at once can reach the bound first, and are bounded
        # the same way.
        call = failure.partition(" ")[0]
        assert call in ("guess", "reset"), failure
        assert failure.startswith(f"{call} did not return within 1 s (training.callTimeoutSeconds)"), failure
        assert episode_of(environment).environment == "make_environment"
        if call == "guess":
            assert "did not return within 1 s" in message["content"]  # TRL showed the policy the tool's error
    assert any(episode_of(environment).failure.startswith("guess") for environment, _ in played)
    # An instance goes back to TRL's pool only when its call ended (its request saw the deadline first).
    pool = loop._environment_pool[None]
    assert {id(e) for e in pool} == {id(e) for e, _ in played if not is_abandoned(e)}
    assert loop._counters["tools/guess/failure_total"] == 100
    assert len(loop._tool_pool._threads) <= 50
    # Each abandoned request's own thread ends: its request was bounded by the same deadline.
    deadline = time.monotonic() + 10
    while any(t.name.startswith("grpo-env-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [t.name for t in threading.enumerate() if t.name.startswith("grpo-env-")] == []
    loop._tool_pool.shutdown(wait=True)  # as TRL's loop does at its end: nothing holds it


def test_a_tool_that_never_returns_ends_at_the_episodes_deadline_and_frees_trls_thread(tool_tokenizer):
    loop = rollout_loop(tool_tokenizer, "tests.trainer.agentic.test_tools:make_hanging_environment",
                        CallBounds(call_timeout_s=30.0, episode_timeout_s=1.0), inflight=1)
    try:
        environment, (message,) = asyncio.run(play(loop, [tool_call("wait")]))
        assert episode_of(environment).failure == ("wait did not return by the episode's deadline, 1 s after its reset "
                                                   "(training.episodeTimeoutSeconds); abandoned")
        assert loop._environment_pool[None] == []
        # TRL's only tool thread is free: the next episode plays on a new instance, and its late call is refused at
        # once, the episode's deadline having passed.
        fresh, _ = asyncio.run(play(loop, []))
        assert fresh is not environment
        with pytest.raises(EnvironmentFailure, match="called after the episode's 1 s deadline"):
            time.sleep(1.0)
            fresh.wait()
    finally:
        RELEASE_HANGING.set()


# ---------------------------------------------------------------------------------------------------- rewards
class RewardEnvironment:
    """An environment whose reward is the row's `reward` column, whatever it is."""

    def reset(self, reward: object = None, **_row: object) -> None:
        self.reward = reward

    def get_reward(self) -> object:
        return self.reward


def make_reward_environment() -> RewardEnvironment:
    return RewardEnvironment()


@pytest.mark.parametrize("reward", [None, math.nan, math.inf, -math.inf, "1.0"])
def test_an_environment_reward_that_is_no_finite_number_makes_the_episode_unscorable(reward):
    """Beside another reward, TRL's nansum would drop the NaN and the episode score as its group's others did."""
    environment = guarded("http://127.0.0.1:9", factory="tests.trainer.agentic.test_tools:make_reward_environment")
    environment.reset(reward=reward)
    assert environment.get_reward() is None
    assert episode_of(environment).failure == f"get_reward returned {reward!r}, not a finite number"
    # In its group: unscorable and counted as its environment's failure, not scored as the others were. An
    # environment without tools hands the loop no record of its episode: the reward TRL kept says it failed.
    samples = score_with_loop([environment.get_reward(), 1.0, 0.0], [1, 1, 1], [False, False, False],
                              env_type=type(environment))
    assert math.isnan(samples[0].metrics["reward"]) and samples[0].advantage == 0.0
    assert samples[0].metrics[EPISODES_KEY]["environment_failures"] == {"make_reward_environment": 1}
    assert [s.advantage for s in samples[1:]] == pytest.approx([1.0, -1.0])
