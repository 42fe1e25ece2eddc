"""The tiny example's learner on CPU: a real vLLM server, TRL's real AsyncRolloutWorker, the learner entrypoint.

The learner runs as the learner pod runs it (`python -m grpo_trainer learner --config run.json`), against the
session's vLLM server, and is judged by what the operator reads: its exit code and its termination message. The run
that reaches the bound is `grporun local`'s (tests/operator/cli/test_local_run.py), which runs the same command.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_operator.local.plan import localize_spec
from grpo_operator.manifest import read_grporun
from grpo_operator.resolve import RunPlacement, resolve_run_config
from grpo_trainer.contract.codes import EXIT_STALLED, EXIT_SUCCEEDED, LearnerPhase, StallCause
from grpo_trainer.contract.config import LoraConfig, RewardConfig, RunConfig
from grpo_trainer.contract.report import ProgressReport, parse_progress
from tests.support.paths import REPO
from tests.support.servers.vllm_server import restore_model_weights

TINY = REPO / "examples" / "tiny.yaml"
PROMPTS = REPO / "examples" / "tiny-prompts.jsonl"
LEARNER_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def tiny_run_config(tmp_path: Path, server, manifest: Path = TINY, **changes) -> tuple[Path, RunConfig]:
    """examples/tiny.yaml (or `manifest`) resolved as `grporun local` resolves it, served by the session's vLLM
    server; `changes` set spec fields by dotted path (`training__epochs`) after the paths are localized."""
    spec = read_grporun(manifest).spec.model_copy(update={"model": server.model}, deep=True)
    spec.rewards = [reward for reward in spec.rewards if not reward.is_model]  # set by the caller when wanted
    spec = localize_spec(spec, manifest.parent)
    for dotted, value in changes.items():
        target = spec
        *parents, leaf = dotted.split("__")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    config = resolve_run_config("tiny", "default", spec, RunPlacement(
        rollout_urls=[server.url], output_dir=str(tmp_path / "output"),
        checkpoint_dir=str(tmp_path / "checkpoints"), weight_sync_dir=str(tmp_path / "weights"),
        termination_message_path=str(tmp_path / "termination-log"),
    ))
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"http_port": 0})})
    path = tmp_path / "run.json"
    path.write_text(config.model_dump_json(by_alias=True))
    return path, config


def run_learner(config_path: Path, log_path: Path) -> tuple[int, float]:
    started = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.run([sys.executable, "-m", "grpo_trainer", "learner", "--config", str(config_path)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=LEARNER_TIMEOUT_S, cwd=REPO).returncode
    return code, time.monotonic() - started


def termination_report(config: RunConfig) -> ProgressReport:
    return parse_progress(Path(config.termination_message_path).read_text())


def test_constant_reward_stalls_within_one_pass_with_exit_42(vllm_server, tmp_path):
    config_path, config = tiny_run_config(
        tmp_path, vllm_server, rewards=[RewardConfig(name="constant")], training__epochs=3.0,
    )
    code, seconds = run_learner(config_path, tmp_path / "learner.log")
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_STALLED, log[-4000:]
    report = termination_report(config)
    prompts = len(PROMPTS.read_text().splitlines())
    assert report.phase == LearnerPhase.STALLED
    assert report.stalled is True and report.stall_cause == StallCause.STREAK  # the verdict the operator shows
    assert report.groups_trained == 0 and report.global_step == 0
    assert report.dropped["no_signal"] >= prompts  # a full pass, every group without signal
    assert report.groups_consumed < report.groups_total  # stopped in the first pass, not at the epoch bound
    assert "stalled" in report.message.lower()
    assert "grpo learner: Stalled" in log
    print(f"constant reward stalled after {seconds:.0f}s: {report.message}")


def test_an_environment_whose_rewards_are_nan_or_never_come_stalls_naming_it(vllm_server, tmp_path, monkeypatch):
    """TRL's real worker, the learner entrypoint and an environment server whose reward is NaN or never comes: each
    episode fails as the environment's (a NaN beside the constant reward was read as no signal; a hung call held
    the worker), and the pass of unscorable groups stalls naming the environment."""
    from tests.support.servers.broken_environment import URL_ENV, BrokenEnvironmentServer

    # A pass of four prompts: the stall's verdict needs a pass of groups each failed three times (generated again
    # twice), and the tiny example's sixteen took 2 min of hung calls on an idle machine.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:4]))
    server = BrokenEnvironmentServer({"/reward": "nan_or_hang"}).start()
    monkeypatch.setenv(URL_ENV, server.url)  # the learner and its worker child inherit it
    try:
        config_path, config = tiny_run_config(
            tmp_path, vllm_server, rewards=[RewardConfig(name="constant")], training__epochs=3.0,
            training__environment_factory="tests.support.servers.broken_environment:make_environment",
            training__call_timeout_seconds=1, dataset__path=str(prompts),
        )
        code, _ = run_learner(config_path, tmp_path / "learner.log")
    finally:
        server.stop()
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_STALLED, log[-4000:]
    report = termination_report(config)
    assert report.phase == LearnerPhase.STALLED and report.groups_trained == 0
    assert report.dropped.get("no_signal", 0) == 0 and report.dropped["unscorable"] >= 4  # the whole pass
    episodes = report.episodes
    assert episodes.environment_failures == {"make_environment": episodes.episodes} and episodes.episodes > 0
    assert "failed in environment make_environment" in report.message, report.message
    assert "get_reward returned nan, not a finite number" in log
    assert "get_reward did not return within 1 s (training.callTimeoutSeconds)" in log
    assert "did not exit within" not in log  # the worker child left on its own, its samples generated ahead read


def test_a_lora_run_reaches_the_bound_and_the_server_serves_the_adapter_of_each_sync(vllm_server, tmp_path):
    """training.lora: TRL trains a peft adapter, each filesystem sync loads the adapter alone on the server under a
    versioned name (what the rollout worker requests), checkpoints hold the adapter, and the final model is the
    merged model with the adapter beside it."""
    import requests
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_trainer.rollout.weight_sync import adapter_name
    from tests.trainer.rollout.test_weight_sync import greedy_logprob_hf, greedy_logprob_vllm

    restore_model_weights(vllm_server, tmp_path / "model-weights")  # the base the adapter is trained on
    config_path, config = tiny_run_config(
        tmp_path, vllm_server, training__epochs=2.0,
        training__lora=LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]),
        checkpoint__save_steps=2,
    )
    code, seconds = run_learner(config_path, tmp_path / "learner.log")
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_SUCCEEDED, log[-4000:]
    report = termination_report(config)
    prompts = len(PROMPTS.read_text().splitlines())
    assert report.phase == LearnerPhase.SUCCEEDED and report.epochs_done == 2
    assert report.groups_consumed == report.groups_total == 2 * prompts
    assert report.groups_trained + report.dropped_total == 2 * prompts and report.groups_trained > 0

    final = Path(config.output_dir) / "final"
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert not [name for name in merged.state_dict() if "lora" in name]  # a plain model: vLLM serves it as is
    base = AutoModelForCausalLM.from_pretrained(vllm_server.model, dtype=torch.float32)
    from_adapter = PeftModel.from_pretrained(base, final / "adapter").merge_and_unload()
    assert greedy_logprob_hf(from_adapter) == pytest.approx(greedy_logprob_hf(merged), abs=1e-5)
    untrained = AutoModelForCausalLM.from_pretrained(vllm_server.model, dtype=torch.float32)
    assert greedy_logprob_hf(merged) != pytest.approx(greedy_logprob_hf(untrained), abs=1e-4)  # the adapter trained
    # Every sync moved the adapter alone; the last one (after the last step) left the server serving the trained
    # policy under the name of that version, which is what the run's samples were generated with.
    assert "weight sync: the adapter alone" in log
    syncs = [line for line in log.splitlines() if "weight sync v" in line]
    assert len(syncs) == report.weight_syncs and all("adapter of" in line for line in syncs), syncs
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json()["weight_version"] == \
        report.rollout[0].weight_version == f"v{report.weight_syncs}"
    served = [model["id"] for model in requests.get(f"{vllm_server.url}/v1/models", timeout=10).json()["data"]]
    assert adapter_name(report.weight_syncs) in served
    assert greedy_logprob_vllm(vllm_server.url, adapter_name(report.weight_syncs)) == pytest.approx(
        greedy_logprob_hf(merged), abs=1e-4)
    # the versions a request may no longer name were unloaded
    window = config.training.max_staleness + 1
    assert [name for name in served if name.startswith("policy-")] == \
        [adapter_name(v) for v in range(max(report.weight_syncs - window + 1, 1), report.weight_syncs + 1)]
    # The worker child's rollout metrics (merged there a few times a second) are in the learner's step logs, with
    # the reductions TRL's log gives them: a mean no longer than the longest, within the completion bound.
    steps = [ast.literal_eval(line[line.index("{'loss'"):]) for line in log.splitlines() if "{'loss'" in line]
    lengths = [(float(step["completions/mean_length"]), float(step["completions/max_length"])) for step in steps
               if "completions/mean_length" in step]
    assert steps and len(lengths) >= len(steps) / 2, (len(lengths), len(steps))
    assert all(0 < mean <= longest <= config.training.max_completion_length for mean, longest in lengths), lengths
    checkpoints = sorted(Path(config.checkpoint.directory).glob("checkpoint-*"))
    assert checkpoints
    for checkpoint in checkpoints:
        files = {path.name for path in checkpoint.iterdir()}
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
    print(f"LoRA run reached the bound in {seconds:.0f}s: {report.message}")
