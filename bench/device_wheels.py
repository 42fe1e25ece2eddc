"""The carried set of the bare device check (`python -m bench.device_check --bare`): the wheels a lent GPU machine
needs besides the torch it has.

`python -m bench.device_wheels [--directory .device/wheels]` (`make device-wheels`) builds it: this project's own
wheel, built from the tree without a package index, and `pip download` of each package in CARRIED at the version
this tree's learner environment holds (the versions its tests run), for the lent machine's Python and platform
(TARGET). Wheels of any other name or version are removed from the folder, so it holds one of each. It prints each
wheel's size and what travels with the working tree, against the device tool's LIMIT_BYTES, and exits 1 past it.

The lent machine (CUDA image: Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, safetensors,
huggingface_hub 1.x, no registry) lacks what CARRIED names; transformers is carried at the learner's pin because
that is the version the learner has been tested with. On the machine, `requirement_problems` reads every carried
wheel's requirements against the set and what the machine has, and `install_argv` installs the set into a folder
of its own (--no-deps: nothing is resolved there).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRECTORY = ROOT / ".device" / "wheels"
OURS = "grpo-operator"
MIB = 1024**2
#: What the device tool carries at most: the working tree (tracked and untracked-not-ignored files) and the carried
#: paths together.
LIMIT_BYTES = 64 * MIB
#: The learner's packages that the lent machine lacks (TRL, datasets, pydantic and what they need that is not
#: there), or holds older than the learner needs (transformers 5.17; typing-extensions, which pydantic-core needs
#: at 4.16 or newer, is not known there).
CARRIED = ("trl", "transformers", "datasets", "dill", "multiprocess", "pydantic", "pydantic-core",
           "annotated-types", "typing-inspection", "typing-extensions")
#: Where the packages in this project's sources live, to tell a wheel of ours built from another tree.
PACKAGE_ROOTS = {"grpo_operator": ROOT / "operator" / "grpo_operator",
                 "grpo_trainer": ROOT / "trainer_image" / "grpo_trainer"}


@dataclass(frozen=True)
class Target:
    """The lent machine's interpreter and platform, as pip's download options name them."""

    python_version: str = "3.12"
    implementation: str = "cp"
    platforms: tuple[str, ...] = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                  "manylinux2014_x86_64")


TARGET = Target()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized: lower case, '-' between words
    version: str

    @property
    def bytes(self) -> int:
        return self.path.stat().st_size


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_of(path: Path) -> Wheel:
    """A wheel file's distribution name and version, from its file name (PEP 427)."""
    name, version = path.name.split("-")[:2]
    return Wheel(path, normalized(name), version)


def pinned(version_of: Callable[[str], str] = importlib.metadata.version) -> list[str]:
    """`name==version` for each of CARRIED, at the version `version_of` says (this environment's, by default)."""
    return [f"{name}=={version_of(name)}" for name in CARRIED]


def download_argv(requirements: Sequence[str], directory: Path, target: Target = TARGET) -> list[str]:
    """pip's download of `requirements`, wheels only, for `target`, without their dependencies."""
    platforms = [option for platform in target.platforms for option in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--python-version", target.python_version, "--implementation",
            target.implementation, *platforms, "--dest", str(directory), *requirements]


def install_argv(wheels: Sequence[Wheel], site: Path, python: str = sys.executable) -> list[str]:
    """pip's install of `wheels` into the folder `site`, with no index and nothing resolved."""
    return [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *(str(w.path) for w in wheels)]


def wheels_in(directory: Path) -> list[Wheel]:
    return sorted((wheel_of(path) for path in directory.glob("*.whl")), key=lambda wheel: wheel.name)


def travelling_bytes(root: Path = ROOT) -> int | None:
    """Bytes of the working tree the device tool sends: tracked files and untracked ones git does not ignore; None
    where git cannot tell (a copy of the tree without its repository, as on the GPU machine)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(path.stat().st_size for name in listed if name and (path := root / name).is_file())


@dataclass(frozen=True)
class CarriedSet:
    wheels: tuple[Wheel, ...]
    tree_bytes: int | None  # None: not known (no git repository)

    @property
    def wheel_bytes(self) -> int:
        return sum(wheel.bytes for wheel in self.wheels)

    @property
    def total_bytes(self) -> int:
        return self.wheel_bytes + (self.tree_bytes or 0)

    @property
    def missing(self) -> list[str]:
        """The names of CARRIED and OURS with no wheel in the set."""
        present = {wheel.name for wheel in self.wheels}
        return [name for name in (*CARRIED, OURS) if normalized(name) not in present]

    def lines(self) -> list[str]:
        rows = [f"  {wheel.path.name}: {wheel.bytes / MIB:.2f} MiB" for wheel in self.wheels]
        if self.tree_bytes is None:
            return [*rows, f"  wheels {self.wheel_bytes / MIB:.2f} MiB (the working tree's size not known: no git "
                           "repository here)"]
        return [*rows,
                f"  wheels {self.wheel_bytes / MIB:.2f} MiB + working tree {self.tree_bytes / MIB:.2f} MiB = "
                f"{self.total_bytes / MIB:.2f} MiB of the device tool's {LIMIT_BYTES / MIB:.0f} MiB"]


def carried_set(directory: Path = DIRECTORY, root: Path = ROOT) -> CarriedSet:
    return CarriedSet(tuple(wheels_in(directory)) if directory.is_dir() else (), travelling_bytes(root))


# ------------------------------------------------------------------------------------------------ on the machine
def requirements_of(wheel: Wheel) -> list[str]:
    """The wheel's Requires-Dist lines (from its METADATA)."""
    with zipfile.ZipFile(wheel.path) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(metadata).decode())
    return message.get_all("Requires-Dist") or []


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class RequirementProblems:
    missing: list[str]  # a requirement nothing satisfies: the import fails
    mismatched: list[str]  # present at a version outside the requirement: may work, said in the report


def requirement_problems(wheels: Sequence[Wheel],
                         version_of: Callable[[str], str | None] = installed_version) -> RequirementProblems:
    """Each carried wheel's requirements (without extras) against the set itself, then against what `version_of`
    says is installed."""
    from packaging.requirements import Requirement

    carried = {wheel.name: wheel.version for wheel in wheels}
    missing, mismatched = [], []
    for wheel in wheels:
        if wheel.name == normalized(OURS):
            continue  # its requirements are the operator's; what the learner imports is tried once installed
        for line in requirements_of(wheel):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = normalized(requirement.name)
            version = carried.get(name) or version_of(requirement.name)
            need = f"{wheel.name} {wheel.version} needs {requirement}"
            if version is None:
                missing.append(f"{need}: none here")
            elif requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                mismatched.append(f"{need}: {version} here")
    return RequirementProblems(missing, mismatched)


def stale_modules(wheel: Wheel, package_roots: dict[str, Path] = PACKAGE_ROOTS) -> list[str]:
    """The modules of this tree's packages that `wheel` (ours) lacks or holds with other contents."""
    with zipfile.ZipFile(wheel.path) as archive:
        held = {name: archive.read(name) for name in archive.namelist() if name.endswith(".py")}
    stale = []
    for package, root in package_roots.items():
        for path in sorted(root.rglob("*.py")):
            name = f"{package}/{path.relative_to(root).as_posix()}"
            if "__pycache__" not in path.parts and held.get(name) != path.read_bytes():
                stale.append(name)
    return stale


# ----------------------------------------------------------------------------------------------------- building
def build_ours(directory: Path, root: Path = ROOT) -> None:
    """This project's wheel, built from a copy of its sources (the build writes build/ and egg-info beside them)
    with no package index: setuptools and build are in the test environment."""
    with tempfile.TemporaryDirectory(prefix="device-wheel-") as scratch:
        source = Path(scratch)
        shutil.copy(root / "pyproject.toml", source)
        for folder in ("operator", "trainer_image"):
            shutil.copytree(root / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(directory),
                        str(source)], check=True, capture_output=True)


def build(directory: Path = DIRECTORY, requirements: Sequence[str] | None = None) -> CarriedSet:
    """Download the carried packages, build ours, and keep one wheel of each and nothing else in `directory`."""
    requirements = pinned() if requirements is None else requirements
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in wheels_in(directory):
        if wheel.name == normalized(OURS):
            wheel.path.unlink()  # always rebuilt: the tree changes under the same version
    subprocess.run(download_argv(requirements, directory), check=True)
    build_ours(directory)
    wanted = {(normalized(line.split("==")[0]), line.split("==")[1]) for line in requirements}
    for wheel in wheels_in(directory):
        if wheel.name != normalized(OURS) and (wheel.name, wheel.version) not in wanted:
            wheel.path.unlink()
    return carried_set(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_wheels", description=__doc__.splitlines()[0])
    parser.add_argument("--directory", type=Path, default=DIRECTORY)
    args = parser.parse_args(argv)
    try:
        built = build(args.directory)
    except subprocess.CalledProcessError as error:
        print(f"device wheels: {' '.join(map(str, error.cmd[:6]))} ... exited {error.returncode}", file=sys.stderr)
        if error.stderr:
            print(error.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
        return 1
    print(f"carried set in {args.directory}:")
    print("\n".join(built.lines()))
    if built.total_bytes > LIMIT_BYTES:
        print(f"device wheels: {built.total_bytes / MIB:.2f} MiB is past the device tool's "
              f"{LIMIT_BYTES / MIB:.0f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
