"""`training.extraArgs` may not override what the operator derives from the spec: rejected by the contract (the
learner's config and `grporun validate`) and by the CRD's CEL rule, which list the same keys."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from grpo_operator.cli.validate import check
from grpo_operator.manifest import load_crd
from grpo_trainer.contract import (
    EXIT_INVALID_CONFIG,
    MANAGED_TRAINER_ARGS,
    TrainingConfig,
)
from grpo_trainer.learner_main import trainer_arguments
from tests.support.paths import REPO

TINY = REPO / "examples" / "tiny.yaml"


def extra_args_rule() -> dict:
    training = load_crd().schema["properties"]["spec"]["properties"]["training"]["properties"]
    (rule,) = training["extraArgs"]["x-kubernetes-validations"]
    return rule


def test_the_crd_rule_lists_exactly_the_contracts_managed_keys_and_their_fields():
    rule = extra_args_rule()
    assert re.findall(r"'(\w+)'", rule["rule"]) == list(MANAGED_TRAINER_ARGS)
    for key, field in MANAGED_TRAINER_ARGS.items():
        assert key in rule["message"] and field.split(" (")[0] in rule["message"]


def test_every_argument_the_learner_derives_from_the_spec_is_managed():
    # What trainer_arguments sets from the spec, minus the learner's own fixed choices a user may tune.
    from grpo_trainer.contract import RunConfig

    config = RunConfig.model_validate({"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}],
                                       "learner": {"device": "cpu"}})
    tunable = {"vllm_server_timeout", "logging_steps", "report_to", "dtype", "bf16"}
    assert set(trainer_arguments(config)) - tunable == set(MANAGED_TRAINER_ARGS)


@pytest.mark.parametrize("key", list(MANAGED_TRAINER_ARGS))
def test_the_contract_rejects_each_managed_key_naming_the_spec_field(key):
    with pytest.raises(ValidationError) as error:
        TrainingConfig.model_validate({"extraArgs": {key: 1, "beta": 0.1}})
    assert f"{key} is set from the spec: use {MANAGED_TRAINER_ARGS[key]}" in str(error.value)


def test_unmanaged_keys_pass():
    assert TrainingConfig.model_validate({"extraArgs": {"beta": 0.1, "loss_type": "dapo"}}).extra_args["beta"] == 0.1


def test_grporun_validate_rejects_a_managed_key_with_the_field_to_use(tmp_path):
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"].setdefault("training", {})["extraArgs"] = {"num_train_epochs": 99}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    (problem,) = check(str(path))
    assert problem.startswith(f"{path}: spec.training.extraArgs: may not set what the spec sets")
    assert "num_train_epochs -> training.epochs" in problem


def test_the_learner_exits_78_on_a_managed_key(tmp_path):
    config = tmp_path / "run.json"
    config.write_text('{"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}], '
                      '"training": {"extraArgs": {"num_train_epochs": 99}}}')
    done = subprocess.run([sys.executable, "-m", "grpo_trainer", "learner", "--config", str(config)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == EXIT_INVALID_CONFIG
    assert "num_train_epochs is set from the spec: use training.epochs" in done.stderr
