"""bench/device_wheels.py: what the bare device check carries to a lent GPU machine, its size against the device
tool's limit, and the checks it makes there (requirements, a wheel of ours built from another tree)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from bench import device_wheels as dw

MIB = 1024**2


def _wheel(directory: Path, name: str, version: str, size: int = 0, requires: tuple[str, ...] = (),
           files: dict[str, bytes] | None = None) -> Path:
    """A wheel file with a METADATA of `requires` and `files`, padded to at least `size` bytes."""
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        metadata = "".join(f"Requires-Dist: {line}\n" for line in requires)
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{metadata}")
        for member, data in (files or {}).items():
            archive.writestr(member, data)
        archive.writestr("padding", b"\0" * size)
    return path


def test_the_plan_pins_every_carried_package_for_the_lent_machines_python():
    versions = {name: f"1.{index}" for index, name in enumerate(dw.CARRIED)}
    requirements = dw.pinned(versions.__getitem__)
    assert requirements == [f"{name}=={versions[name]}" for name in dw.CARRIED]
    assert {"trl", "transformers", "datasets", "pydantic", "pydantic-core"} <= set(dw.CARRIED)
    argv = dw.download_argv(requirements, Path("/w"))
    assert argv[argv.index("--python-version") + 1] == "3.12" and argv[argv.index("--dest") + 1] == "/w"
    assert {"--no-deps", "--only-binary=:all:"} <= set(argv) and argv[-len(requirements):] == requirements
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--platform"] == list(dw.TARGET.platforms)


def test_the_learners_pins_are_what_is_carried():
    """trl and transformers travel at the learner extra's pins (this environment is installed from them)."""
    pins = dict(line.split("==") for line in dw.pinned() if line.split("==")[0] in ("trl", "transformers"))
    pyproject = (dw.ROOT / "pyproject.toml").read_text()
    assert all(f'"{name}=={version}"' in pyproject for name, version in pins.items()), pins


def test_sizes_add_up_against_the_limit(tmp_path):
    _wheel(tmp_path, "trl", "1.16.0", size=3 * MIB)
    _wheel(tmp_path, "grpo-operator", "0.1.0", size=1 * MIB)
    carried = dw.CarriedSet(tuple(dw.wheels_in(tmp_path)), tree_bytes=4 * MIB)
    assert [wheel.name for wheel in carried.wheels] == ["grpo-operator", "trl"]
    assert 4 * MIB < carried.wheel_bytes < 4.1 * MIB and carried.total_bytes == carried.wheel_bytes + 4 * MIB
    assert "trl" not in carried.missing and "grpo-operator" not in carried.missing and "transformers" in carried.missing
    total = carried.lines()[-1]
    assert total.startswith("  wheels 4.0") and total.endswith("of the device tool's 64 MiB")
    assert dw.carried_set(tmp_path / "none").wheels == ()


def test_what_travels_is_the_tracked_and_the_untracked_files_git_does_not_ignore(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 1000)
    git("add", ".gitignore", "tracked")
    (tmp_path / "untracked").write_bytes(b"x" * 100)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"x" * 10_000)
    assert dw.travelling_bytes(tmp_path) == 1000 + 100 + len("ignored/\n")


def test_a_tree_without_its_repository_is_not_measured(tmp_path):
    """The GPU machine gets a copy of the tree without .git: the set is still read there."""
    assert dw.travelling_bytes(tmp_path) is None
    _wheel(tmp_path, "trl", "1.16.0", size=MIB)
    carried = dw.carried_set(tmp_path, root=tmp_path)
    assert carried.tree_bytes is None and carried.total_bytes == carried.wheel_bytes
    assert carried.lines()[-1].endswith("(the working tree's size not known: no git repository here)")


def test_requirements_are_read_against_the_set_then_the_machine(tmp_path):
    _wheel(tmp_path, "trl", "1.16.0", requires=("datasets>=4.7.0", "pandas>=2.1.1", "psutil",
                                                 'deepspeed>=0.18; extra == "deepspeed"'))
    _wheel(tmp_path, "datasets", "5.2.0", requires=("pyarrow>=24.0.0", "fsspec<=2026.9.0"))
    _wheel(tmp_path, "grpo-operator", "0.1.0", requires=("kopf==1.45.2",))  # the operator's: not the learner's
    machine = {"pandas": "2.3.0", "pyarrow": "21.0.0", "fsspec": "2026.9.0"}
    problems = dw.requirement_problems(dw.wheels_in(tmp_path), machine.get)
    assert problems.missing == ["trl 1.16.0 needs psutil: none here"]
    assert problems.mismatched == ["datasets 5.2.0 needs pyarrow>=24.0.0: 21.0.0 here"]


def test_our_wheel_from_another_tree_is_told_apart(tmp_path):
    package = tmp_path / "grpo_trainer"
    (package / "learner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "learner" / "attention.py").write_text("rule = 2\n")
    (package / "new.py").write_text("")
    built = dw.wheel_of(_wheel(tmp_path, "grpo-operator", "0.1.0", files={
        "grpo_trainer/__init__.py": b"", "grpo_trainer/learner/attention.py": b"rule = 1\n"}))
    assert dw.stale_modules(built, {"grpo_trainer": package}) == ["grpo_trainer/learner/attention.py",
                                                                  "grpo_trainer/new.py"]


def test_the_install_asks_for_nothing_but_the_carried_wheels(tmp_path):
    wheels = [dw.wheel_of(_wheel(tmp_path, "trl", "1.16.0"))]
    argv = dw.install_argv(wheels, tmp_path / "site", python="/opt/python3")
    assert argv[:4] == ["/opt/python3", "-m", "pip", "install"]
    assert {"--no-index", "--no-deps"} <= set(argv) and argv[argv.index("--target") + 1] == str(tmp_path / "site")
    assert argv[-1] == str(wheels[0].path)


def test_the_built_set_fits_the_device_tool():
    carried = dw.carried_set()
    if not carried.wheels:
        pytest.skip(f"the carried set is not built in {dw.DIRECTORY}: `make device-wheels` downloads it (tests reach "
                    "no package index); its size computation is tested above")
    assert carried.missing == []
    assert carried.total_bytes < dw.LIMIT_BYTES, carried.lines()
    print("\n".join(carried.lines()))
