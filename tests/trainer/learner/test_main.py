"""The learner entrypoint (grpo_trainer.learner.main): trainer arguments from the run config, and the config mistakes
it ends the learner on, naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, LearnerPhase
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.report import parse_progress
from grpo_trainer.learner.errors import ConfigError
from grpo_trainer.learner.main import trainer_arguments
from tests.support.paths import REPO
from tests.trainer.learner.test_lora import gpt2_config


def config(**fields) -> RunConfig:
    base = {"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}]}
    return RunConfig.model_validate({**base, **fields})


def test_cpu_runs_train_in_float32_on_the_cpu_against_the_first_rollout_server():
    arguments = trainer_arguments(config(
        learner={"device": "cpu"}, rollout={"urls": ["http://a:1", "http://b:2"], "device": "cpu"},
        training={"epochs": 3, "numGenerations": 4, "tokenBudget": 512},
        checkpoint={"directory": "/ckpt", "saveSteps": 7},
    ))
    assert arguments["use_cpu"] is True and arguments["dtype"] == "float32" and arguments["bf16"] is False
    assert arguments["vllm_server_base_url"] == "http://a:1"
    assert arguments["num_train_epochs"] == 3 and arguments["num_generations"] == 4
    assert arguments["token_budget"] == 512
    assert arguments["output_dir"] == "/ckpt" and arguments["save_steps"] == 7  # resume looks where saves go
    assert arguments["report_to"] == []


def test_gpu_runs_keep_trls_precision_defaults_and_extra_args_reach_trl():
    arguments = trainer_arguments(config(training={"extraArgs": {"queue_maxsize": 64, "max_inflight_tasks": 4}}))
    assert "use_cpu" not in arguments and "dtype" not in arguments
    assert arguments["queue_maxsize"] == 64 and arguments["max_inflight_tasks"] == 4


def test_the_rollout_queue_holds_max_staleness_steps_unless_the_user_sets_it():
    # TRL's 1024-sample default let a fast server queue samples that went stale before training.
    arguments = trainer_arguments(config(training={"maxStaleness": 2, "perDeviceTrainBatchSize": 4,
                                                   "gradientAccumulationSteps": 3},
                                         learner={"nodes": 2, "processesPerNode": 2}))
    assert arguments["queue_maxsize"] == 2 * 4 * 3 * 4
    assert trainer_arguments(config(training={"maxStaleness": 0}))["queue_maxsize"] > 0  # 0 would be unbounded


def test_the_trainer_accepts_every_argument_we_build(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    built = AsyncGRPOConfig(**trainer_arguments(config(
        learner={"device": "cpu"}, output_dir=str(tmp_path), training={"extraArgs": {"queue_maxsize": 8}})))
    assert built.use_cpu and built.queue_maxsize == 8


def test_tiny_assets_are_deterministic_and_fit_the_cpu_server(tmp_path):
    import hashlib
    import json

    from grpo_trainer.testing.tiny_assets import build_tiny_model

    first, second = build_tiny_model(tmp_path / "a"), build_tiny_model(tmp_path / "b")
    digest = lambda d: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}  # noqa: E731
    assert digest(first) == digest(second)
    config = json.loads((first / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM's CPU attention rejects head_dim 16
    from trl.chat_template_utils import qwen3_chat_template

    assert (first / "chat_template.jinja").read_text() == qwen3_chat_template  # TRL's response parser knows it


def test_reward_model_mistakes_name_the_field(tmp_path, tiny_model_dir, tiny_reward_model_dir):
    from grpo_trainer.learner.main import load_reward_models

    def run_config(*rewards: dict) -> RunConfig:
        return RunConfig.model_validate({"model": "m", "dataset": {"name": "d"}, "rewards": list(rewards),
                                         "learner": {"device": "cpu"}})

    with pytest.raises(ConfigError, match=r"^rewards\[1\]\.model '/no/such/rm': "):
        load_reward_models(run_config({"name": "constant"}, {"model": "/no/such/rm"}))
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.model .*has 2 labels; a reward model has one"):
        load_reward_models(run_config({"model": tiny_model_dir}))  # a causal LM: transformers gives it a 2-label head
    (loaded,) = load_reward_models(run_config({"name": "constant"}, {"model": tiny_reward_model_dir, "weight": 0.5}))
    assert loaded.weight == 0.5 and loaded.model.device.type == "cpu"


@pytest.mark.parametrize("kernel", ["varlen", "fa3"])
def test_a_gpu_attention_kernel_on_a_cpu_learner_ends_it_as_invalid_config(tmp_path, kernel):
    # Before the model loads (this one does not exist): a retry would choose the same kernel on the same device.
    from grpo_trainer.learner.main import main

    config = RunConfig.model_validate({
        "model": str(tmp_path / "no-model"), "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu", "attention": kernel}, "output_dir": str(tmp_path / "out"),
        "terminationMessagePath": str(tmp_path / "termination-log"),
    })
    assert main(config) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message == (f"learner.attention: {kernel} cannot run here: it needs a CUDA GPU and the learner "
                              "runs on cpu")


def test_a_flash_kernel_with_mixed_precision_turned_off_ends_the_learner_as_invalid_config(tmp_path, monkeypatch):
    # On an A100 (the rule picks varlen), `extraArgs: {bf16: false}` leaves float32 attention, which flash kernels
    # cannot compute: said before the model loads (this one does not exist), not at the first forward.
    import grpo_trainer.learner.trainer  # noqa: F401  (imported unpatched: it binds probe_device by name, for the process)
    from grpo_trainer.learner import attention
    from grpo_trainer.learner.main import main

    monkeypatch.setattr(attention, "probe_device", lambda device_type: attention.DeviceFacts("cuda", (8, 0)))
    dataset = tmp_path / "p.jsonl"
    dataset.write_text('{"prompt": "hi"}\n')
    config = RunConfig.model_validate({
        "model": str(tmp_path / "no-model"), "dataset": {"path": str(dataset)}, "rewards": [{"name": "constant"}],
        "rollout": {"weightSync": {"mode": "filesystem", "directory": str(tmp_path / "w")}},
        "training": {"extraArgs": {"bf16": False}}, "output_dir": str(tmp_path / "out"),
        "terminationMessagePath": str(tmp_path / "termination-log"),
    })
    assert main(config) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message.startswith("learner.attention: varlen computes in float16 or bfloat16, and "
                                     "training.extraArgs turn mixed precision off with float32 weights")


def _run_learner_entrypoint(tmp_path, **fields) -> subprocess.CompletedProcess:
    import json

    config = tmp_path / "run.json"
    base = {"model": "m", "dataset": {"path": str(REPO / "examples" / "tiny-prompts.jsonl")},
            "rewards": [{"name": "constant"}], "learner": {"device": "cpu"},
            "terminationMessagePath": str(tmp_path / "termination-log")}
    config.write_text(json.dumps({**base, **fields}))
    return subprocess.run([sys.executable, "-m", "grpo_trainer", "learner", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)


def test_an_empty_dataset_file_is_refused_as_invalid_config_naming_the_field(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = _run_learner_entrypoint(tmp_path, dataset={"path": str(empty)})
    assert done.returncode == EXIT_INVALID_CONFIG, done.stderr[-3000:]
    assert f"dataset.path {str(empty)!r}: the file has no rows" in done.stderr
    assert "Traceback" not in done.stderr


def test_no_rollout_url_is_refused_as_invalid_config_naming_the_field(tmp_path):
    done = _run_learner_entrypoint(tmp_path, rollout={"urls": []})
    assert done.returncode == EXIT_INVALID_CONFIG, done.stderr[-3000:]
    assert "rollout.urls is empty: a run needs at least one rollout server" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_learner_exits_78_naming_the_field_when_a_lora_target_is_the_models_own_head(tmp_path, tiny_model_dir):
    """Before the model loads and before any rollout server is waited for: a retry would find the same spec."""
    import shutil

    from transformers import GPT2LMHeadModel

    from grpo_trainer.learner.main import main

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(gpt2_config()).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{tiny_model_dir}/{name}", model_dir / name)
    config = _config_without_a_server(tmp_path, model_dir, "tiny-prompts.jsonl",
                                      {"lora": {"targetModules": ["c_attn", "wte"]}})
    assert main(config) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED
    assert report.message.startswith("training.lora.targetModules: ['wte'] select the model's output embedding")


def test_the_learner_exits_78_naming_the_model_when_its_chat_template_cannot_run_tool_calls(tmp_path, tiny_model_dir):
    """TRL's worker would die at start in its child (and the learner be restarted for a spec that stays wrong)."""
    import shutil

    from grpo_trainer.learner.main import main

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(  # a template of its own: no response schema TRL knows
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = _config_without_a_server(tmp_path, model_dir, "tiny-guess.jsonl",
                                      {"environmentFactory": "grpo_trainer.testing.guess_env:make_environment"})
    assert main(config) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.phase == LearnerPhase.FAILED
    assert report.message.startswith(f"model {str(model_dir)!r}: TRL cannot run tool calls with its chat template: "
                                      "Unrecognized chat template"), report.message


def _config_without_a_server(tmp_path, model_dir, prompts: str, training: dict) -> RunConfig:
    """A CPU run whose rollout server never answers: a check that comes first ends it; without the check, the run
    fails otherwise, soon (TRL waits 5 s for the server)."""
    return RunConfig.model_validate({
        "model": str(model_dir), "dataset": {"path": str(REPO / "examples" / prompts)},
        "rewards": [{"name": "constant"}], "training": {**training, "extraArgs": {"vllm_server_timeout": 5}},
        "learner": {"device": "cpu"},
        "rollout": {"device": "cpu", "urls": ["http://127.0.0.1:9"],
                    "weightSync": {"mode": "filesystem", "directory": str(tmp_path / "weights")}},
        "checkpoint": {"directory": str(tmp_path / "checkpoints")},
        "outputDir": str(tmp_path / "out"), "terminationMessagePath": str(tmp_path / "termination-log"),
    })
