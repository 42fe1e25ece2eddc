"""Fixtures shared across areas. Area-specific fixtures live beside their tests (operator_fixtures.py, ...)."""

from __future__ import annotations

import os

import pytest

# One vLLM server for the whole session. Registered here, not imported by each test module: an imported
# session fixture is a separate fixture per module, and each module started its own server (3 servers, measured).
# The control plane (kube-apiserver + etcd) is one per session for the same reason.
pytest_plugins = [
    "tests.support.vllm_server",
    "tests.support.operator_fixtures",
    "tests.support.control_plane_fixtures",
]

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny example's model and tokenizer, built offline once per session (grpo_trainer.testing.tiny_assets)."""
    from grpo_trainer.testing.tiny_assets import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> str:
    """The tiny reward model (NaN for prompts holding UNSCORABLE_MARKER), built offline once per session."""
    from grpo_trainer.testing.tiny_assets import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm") / "model"))


@pytest.fixture(scope="session")
def nan_reward_model_dir(tmp_path_factory) -> str:
    """A tiny reward model that returns NaN for everything."""
    from grpo_trainer.testing.tiny_assets import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("nan-rm") / "model", nan_everywhere=True))
