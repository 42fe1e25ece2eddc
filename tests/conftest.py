"""Fixtures shared across areas. Area-specific fixtures live beside their tests (operator_fixtures.py, ...)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import tiny_models

# One vLLM server for the whole session. Registered here, not imported by each test module: an imported
# session fixture is a separate fixture per module, and each module started its own server (3 servers, measured).
# The control plane (kube-apiserver + etcd) is one per session for the same reason.
pytest_plugins = [
    "tests.support.servers.vllm_server",
    "tests.support.emulator.operator_fixtures",
    "tests.support.controlplane.control_plane_fixtures",
    "tests.support.node.node_fixtures",
    "tests.support.node.operator_release",
    "tests.support.servers.s3_server",
    "tests.support.servers.hub_server",
    "tests.support.build_fixtures",  # last: it imports the modules above, which pytest registers (and rewrites) first
]

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# huggingface_hub fetches its agent-harness registry from the hub it was imported with, for its user agent, unless
# telemetry is off: tests reach only the stand-in hub (tests/support/servers/hub_server.py) they point HF_ENDPOINT at.
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The tiny example's model and tokenizer, built offline once per recipe (tests/support/tiny_models.py)."""
    return str(tiny_models.cached(tiny_models.POLICY))


@pytest.fixture(scope="session")
def tiny_reward_model_dir() -> str:
    """The tiny reward model (NaN for prompts holding UNSCORABLE_MARKER), built offline once per recipe."""
    return str(tiny_models.cached(tiny_models.REWARD))


@pytest.fixture(scope="session")
def nan_reward_model_dir() -> str:
    """A tiny reward model that returns NaN for everything."""
    return str(tiny_models.cached(tiny_models.NAN_REWARD))


@pytest.fixture
def update_never_answered():
    """A stand-in rollout server that generates (the learner admits it) but never answers its weight update
    (`/collective_rpc` reload_weights): a weight sync against it hangs."""
    from tests.support.paths import COMPLETIONS_SERVER
    from tests.support.ports import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER),
                               "hung-update", str(port), "--hang", "/collective_rpc"],
                              stdout=subprocess.PIPE, text=True)
    server.stdout.readline()
    yield f"http://127.0.0.1:{port}"
    server.kill()
    server.wait()
