"""LoRA (`training.lora`): the adapter TRL trains in place of the full policy. peft's config for it, whether a weight
sync sends the adapter alone, the targets a model's own head refuses, and the adapter saved beside the merged model at
the end of a run. How a sync moves an adapter is the weight sync's (`GRPOLearner`'s adapter sync, through
grpo_trainer.rollout.weight_sync); the servers' flags for it are the rollout entrypoint's (grpo_trainer.server.main)."""

from __future__ import annotations

import os

from ..contract.config import LoraConfig, RunConfig
from .errors import ConfigError

#: peft's own word for "every linear layer but the output layer": what an unset `training.lora.targetModules` adapts.
ALL_LINEAR = "all-linear"
#: Under the final model's folder: the LoRA adapter itself (peft's save_pretrained), beside the merged model.
FINAL_ADAPTER_FOLDER = "adapter"


def peft_config(lora: LoraConfig | None):
    """peft's LoraConfig for `training.lora` (None: full fine-tuning). TRL wraps the policy with it."""
    if lora is None:
        return None
    import peft

    return peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules) if lora.target_modules else ALL_LINEAR,
        task_type=peft.TaskType.CAUSAL_LM,
    )


def adapter_sync(config: RunConfig) -> bool:
    """Whether the learner syncs the adapter alone to each rollout server through its filesystem transfer. Over
    NCCL TRL decides itself, from the server's `--enable-lora`, which the rollout pods get only for `sync: adapter`."""
    lora = config.training.lora
    return lora is not None and lora.sync == "adapter" and config.rollout.weight_sync.mode == "filesystem"


def lora_target_matches(module_name: str, target: str) -> bool:
    """Whether a peft `target_modules` entry selects a module: its full name, or the end of its dotted path."""
    return module_name == target or module_name.endswith(f".{target}")


def head_module_names(model_config) -> list[str]:
    """The names of the model's output embedding, and of its input embedding when the two are tied: what a LoRA
    adapter may not target. Found on a weightless (meta-device) copy of the model; [] if it cannot be built."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, KeyError, TypeError):  # not a causal LM transformers builds from its config: TRL checks
        return []
    heads = [model.get_output_embeddings()]
    if getattr(model_config.get_text_config(), "tie_word_embeddings", False):
        heads.append(model.get_input_embeddings())
    return [name for name, module in model.named_modules() if any(module is head for head in heads if head is not None)]


def check_lora_targets(lora: LoraConfig | None, model_config) -> None:
    """Refuse a LoRA target that selects the head, under whatever name this model gives it (the spec refuses the
    usual names before the run starts). TRL refuses an adapted head as well, but as a crash the run would retry."""
    if lora is None or not lora.target_modules:
        return
    heads = head_module_names(model_config)
    refused = [target for target in lora.target_modules if any(lora_target_matches(head, target) for head in heads)]
    if refused:
        raise ConfigError(f"training.lora.targetModules: {refused} select the model's output embedding "
                          f"({', '.join(heads)}), which the learner scores with its base weight: leave it out")


def save_adapter_and_merged(learner, model, directory: str) -> None:
    """A LoRA run's final model: the adapter (peft's save) in `directory/adapter` and, in `directory`, the base weights
    with the adapter merged in (every rank saves; rank 0 merges and writes)."""
    learner.save_model(os.path.join(directory, FINAL_ADAPTER_FOLDER))
    if learner.accelerator.is_main_process:
        # The run is over: merging in place (peft's merge_and_unload) costs no second copy of the weights.
        model.merge_and_unload().save_pretrained(directory)
        learner.processing_class.save_pretrained(directory)
    learner.accelerator.wait_for_everyone()
