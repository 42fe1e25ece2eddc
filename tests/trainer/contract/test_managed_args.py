"""`training.extraArgs` may not override what the operator derives from the spec: rejected by the contract (the
learner's config, `grporun validate` and the operator's spec model). The CRD can only describe them: CEL cannot see
the keys of a map of untyped values (the real API server refuses such a rule, tests/controlplane)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from grpo_operator.cli.validate import check
from grpo_operator.manifest import load_crd
from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG
from grpo_trainer.contract.config import MANAGED_TRAINER_ARGS, TrainingConfig
from grpo_trainer.learner.main import trainer_arguments
from tests.support.paths import REPO

TINY = REPO / "examples" / "tiny.yaml"


def test_the_crd_describes_exactly_the_contracts_managed_keys():
    extra_args = load_crd().schema["properties"]["spec"]["properties"]["training"]["properties"]["extraArgs"]
    listed = re.search(r"\(([a-z_, ]+)\)", extra_args["description"].replace("\n", " "))[1]
    assert [key.strip() for key in listed.split(",")] == list(MANAGED_TRAINER_ARGS)
    assert "x-kubernetes-validations" not in extra_args


def test_every_argument_the_learner_derives_from_the_spec_is_managed():
    # What trainer_arguments sets from the spec, minus the learner's own fixed choices a user may tune.
    from grpo_trainer.contract.config import RunConfig

    config = RunConfig.model_validate({"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}],
                                       "learner": {"device": "cpu"}})
    tunable = {"vllm_server_timeout", "logging_steps", "report_to", "dtype", "bf16", "queue_maxsize"}
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
    (problem,) = check(str(path)).errors
    assert problem.startswith(f"{path}: spec.training.extraArgs: ")
    assert "num_train_epochs is set from the spec: use training.epochs" in problem


def test_the_learner_exits_78_on_a_managed_key(tmp_path):
    config = tmp_path / "run.json"
    config.write_text('{"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}], '
                      '"training": {"extraArgs": {"num_train_epochs": 99}}}')
    done = subprocess.run([sys.executable, "-m", "grpo_trainer", "learner", "--config", str(config)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == EXIT_INVALID_CONFIG
    assert "num_train_epochs is set from the spec: use training.epochs" in done.stderr
