"""grpo_trainer.learner.sharding: the check that an fsdp2 learner's prepared model is sharded. That CPU ranks do
shard, and that a run accelerate keeps DDP exits 78, is what tests/trainer/learner/test_fsdp2.py runs."""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.learner.errors import ConfigError
from grpo_trainer.learner.sharding import ShardingCheck


def test_a_model_with_plain_parameters_is_refused_in_one_line_naming_the_strategy():
    with pytest.raises(ConfigError) as refused:
        ShardingCheck().on_train_begin(None, None, None, model=torch.nn.Linear(2, 2))
    message = str(refused.value)
    assert message.startswith("learner.strategy fsdp2: 2 of the model's 2 parameters are not sharded")
    assert "\n" not in message
