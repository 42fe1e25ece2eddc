"""LoRA (grpo_trainer.learner.lora): the adapter's peft config, when the adapter alone is synced, and the targets a
model's own head refuses."""

from __future__ import annotations

import pytest

from grpo_trainer.contract.config import LoraConfig, RunConfig
from grpo_trainer.learner.errors import ConfigError
from grpo_trainer.learner.lora import adapter_sync, check_lora_targets, head_module_names, peft_config


def config(**fields) -> RunConfig:
    base = {"model": "m", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}]}
    return RunConfig.model_validate({**base, **fields})


def test_training_lora_becomes_peft_lora_config_for_a_causal_lm():
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    lora = peft_config(LoraConfig(r=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "self_attn.v_proj"]))
    assert isinstance(lora, PeftLoraConfig) and lora.task_type == TaskType.CAUSAL_LM
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8.0, 0.1)
    assert set(lora.target_modules) == {"q_proj", "self_attn.v_proj"}
    assert lora.bias == "none" and not lora.modules_to_save  # nothing outside the adapter trains
    assert peft_config(None) is None  # no training.lora: full fine-tuning


@pytest.mark.parametrize("training, mode, synced", [
    ({"lora": {"r": 4}}, "filesystem", True),
    ({"lora": {"r": 4, "sync": "merged"}}, "filesystem", False),
    ({}, "filesystem", False),
    ({"lora": {"r": 4}}, "nccl", False),  # TRL decides itself, from the server's --enable-lora
])
def test_the_learner_syncs_the_adapter_alone_only_for_a_filesystem_lora_run_that_asks(training, mode, synced):
    sync = {"mode": mode, "directory": "/w"} if mode == "filesystem" else {"mode": mode}
    assert adapter_sync(config(training=training, rollout={"urls": ["http://r:8000"], "weightSync": sync})) is synced


def test_unset_lora_targets_adapt_every_linear_layer_but_the_head(tiny_model_dir):
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), peft_config(LoraConfig()))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not isinstance(model.get_output_embeddings(), BaseTunerLayer)


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)  # ties lm_head to wte


def test_a_lora_target_naming_a_models_own_head_is_a_config_error_naming_the_field():
    """The spec refuses lm_head and embed_tokens by name; a model that calls its tied embedding otherwise (GPT-2's
    wte) is refused by the learner before the model loads, as a config error rather than a crash."""
    assert head_module_names(gpt2_config()) == ["transformer.wte", "lm_head"]
    with pytest.raises(ConfigError, match=r"^training\.lora\.targetModules: \['wte'\] select the model's output"):
        check_lora_targets(LoraConfig(target_modules=["c_attn", "wte"]), gpt2_config())
    check_lora_targets(LoraConfig(target_modules=["c_attn", "c_proj"]), gpt2_config())
    check_lora_targets(LoraConfig(), gpt2_config())  # peft's all-linear leaves the head out itself
    check_lora_targets(None, gpt2_config())
