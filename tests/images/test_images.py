"""The images built from the project's own Dockerfiles (hack/images), run as a cluster runs them: the image's own
entrypoint and user, no network. Each test fails on an image that a kubelet would fail to start or that would fail
on its first task: a missing module, a root or non-numeric user, a CRD the operator cannot find, a rollout or learner
environment whose imports break, a second torch in the trainer image."""

from __future__ import annotations

import re

import pytest

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG
from tests.support.node import images
from tests.support.paths import REPO

pytestmark = pytest.mark.images

NON_ROOT_USER = "10001:10001"  # the chart's runAsUser/runAsGroup: runAsNonRoot can only verify a numeric user


def output(done) -> str:
    return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


# --- the operator image ---


def test_operator_image_runs_as_the_numeric_non_root_user(operator_image):
    assert images.image_config(operator_image)["User"] == NON_ROOT_USER
    done = images.run_container(operator_image, "-c", "id -u; id -g", entrypoint="sh")
    assert done.returncode == 0, output(done)
    assert done.stdout.split() == ["10001", "10001"]


def test_operator_entrypoint_is_grporun_with_every_command(operator_image):
    config = images.image_config(operator_image)
    assert config["Entrypoint"] == ["grporun"]
    assert config["Cmd"] == ["operator", "--all-namespaces"]
    done = images.run_container(operator_image, "--help")
    assert done.returncode == 0, output(done)
    for command in ("operator", "local", "validate"):
        assert command in done.stdout
    # The operator command's own parser: its module and its dependencies (kopf, kubernetes) import.
    done = images.run_container(operator_image, "operator", "--help")
    assert done.returncode == 0, output(done)
    assert "--all-namespaces" in done.stdout


def test_operator_image_has_the_crd_the_operator_reads(operator_image):
    env = dict(item.split("=", 1) for item in images.image_config(operator_image)["Env"])
    crd_path = env["GRPO_CRD_PATH"]
    done = images.run_container(operator_image, crd_path, entrypoint="cat")
    assert done.returncode == 0, output(done)
    assert done.stdout == (REPO / "crds" / "grporun.yaml").read_text()


def test_operator_image_validates_a_manifest_against_its_crd(operator_image):
    """`grporun validate` checks the CRD's schema and rules, read from GRPO_CRD_PATH: an image without the file or
    with the variable pointing elsewhere fails here."""
    volume = f"{REPO / 'examples'}:/examples:ro"
    done = images.run_container(operator_image, "validate", "/examples/tiny.yaml", volumes=(volume,))
    assert done.returncode == 0, output(done)
    assert "OK /examples/tiny.yaml" in done.stdout


# --- the trainer image (CPU variant) ---


def test_trainer_image_runs_as_the_numeric_non_root_user(trainer_image):
    assert images.image_config(trainer_image)["User"] == NON_ROOT_USER
    done = images.run_container(trainer_image, "-c", "id -u; id -g; test -w $HOME", entrypoint="sh")
    assert done.returncode == 0, output(done)
    assert done.stdout.split() == ["10001", "10001"]


def test_trainer_entrypoint_is_the_grpo_trainer_module(trainer_image):
    assert images.image_config(trainer_image)["Entrypoint"] == ["python", "-m", "grpo_trainer"]
    done = images.run_container(trainer_image, "--help")
    assert done.returncode == 0, output(done)
    for role in ("rollout", "learner", "probe"):
        assert role in done.stdout


def test_trainer_roles_refuse_a_missing_config_with_their_exit_code(trainer_image):
    """Each role starts and reads its config the way a pod's does (a missing file: the invalid-config exit code,
    one line naming the file)."""
    for role in ("learner", "rollout"):
        done = images.run_container(trainer_image, role, "--config", "/nonexistent/run.json")
        assert done.returncode == EXIT_INVALID_CONFIG, output(done)
        assert "cannot read config /nonexistent/run.json" in done.stderr


def test_trainer_rollout_and_learner_entrypoints_import(trainer_image):
    """What each role imports past its config: vLLM and the rollout server in /opt/rollout, TRL and the learner in
    /opt/learner (the image's PATH python)."""
    rollout = images.run_container(
        trainer_image, "-c", "import vllm, grpo_trainer.server.main; print(vllm.__version__)",
        entrypoint="/opt/rollout/bin/python")
    assert rollout.returncode == 0, output(rollout)
    learner = images.run_container(
        trainer_image, "-c", "import trl, transformers, grpo_trainer.learner.main; print(trl.__version__)",
        entrypoint="python")
    assert learner.returncode == 0, output(learner)


def test_trainer_image_has_one_torch_both_environments_share(trainer_image):
    """torch (with CUDA libraries, GBs) is installed once, in the base interpreter; a venv that installed its own
    copy would double the image and could hold a torch vLLM was not built for."""
    script = "import torch; print(torch.__version__, torch.__file__)"
    seen = {}
    for python in ("/opt/learner/bin/python", "/opt/rollout/bin/python"):
        done = images.run_container(trainer_image, "-c", script, entrypoint=python)
        assert done.returncode == 0, output(done)
        seen[python] = done.stdout.split()
    versions_and_paths = set(map(tuple, seen.values()))
    assert len(versions_and_paths) == 1, seen
    ((version, path),) = versions_and_paths
    assert not path.startswith("/opt/"), f"torch comes from a venv, not the base interpreter: {path}"
    assert version.split("+")[0] == _torch_version()
    copies = images.run_container(
        trainer_image, "-c", "find / -xdev -path '*-packages/torch/__init__.py' 2>/dev/null", entrypoint="sh")
    assert copies.stdout.split() == [path], copies.stdout


def _torch_version() -> str:
    """The torch the Dockerfile installs (its ARG default: the builds pass no TORCH_VERSION)."""
    return re.search(r"^ARG TORCH_VERSION=(\S+)$", (REPO / "trainer_image" / "Dockerfile").read_text(), re.M)[1]


def test_trainer_image_compiles_with_inductor_against_its_interpreter_headers(trainer_image):
    """vLLM's CPU backend compiles its model with torch's inductor in C++-wrapper mode, whose generated code includes
    the interpreter's Python.h: an image without its interpreter's headers fails at the rollout server's warm-up."""
    script = ("import torch, torch._inductor.config as c; c.cpp_wrapper = True; "
              "print(torch.compile(lambda x: x.sin() + 1)(torch.ones(4)).sum().item())")
    done = images.run_container(trainer_image, "-c", script, entrypoint="/opt/rollout/bin/python")
    assert done.returncode == 0, output(done)


# --- the trainer image (CUDA variant; built only when asked: images.CUDA_IMAGE_ENV) ---

CHECK_CUDA = REPO / "hack" / "images" / "check-cuda.sh"


def test_the_cuda_image_passes_its_check(trainer_cuda_image):
    """hack/images/check-cuda.sh, as `make image-cuda` runs it, on the image built for this run: the entrypoint, vLLM
    and kernels in the learner, TRL's NCCL client up to its first CUDA call, the attention rule's GPU branches."""
    import subprocess

    done = subprocess.run([str(CHECK_CUDA)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, output(done)
    lines = done.stdout.splitlines()
    assert lines[0] == f"check-cuda: {trainer_cuda_image.reference}"
    assert lines[-1] == "check-cuda: all checks passed"
    assert [line.split(":")[1].strip() for line in lines[1:-1]] == ["ok"] * 5, lines
    nccl = next(line for line in lines if "NCCL" in line)
    assert "ImportError" not in nccl and "ModuleNotFoundError" not in nccl
