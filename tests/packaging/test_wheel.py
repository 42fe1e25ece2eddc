"""The wheel and the sdist the images install: every package and module of the tree is in them, and the console
script starts from a venv that has the wheel and not the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO

PACKAGE_ROOTS = {"grpo_operator": REPO / "operator" / "grpo_operator",
                 "grpo_trainer": REPO / "trainer_image" / "grpo_trainer"}


def tree_modules() -> set[str]:
    """Every module file of both packages, as a path inside the wheel (grpo_operator/local/plan.py)."""
    return {f"{name}/{path.relative_to(root).as_posix()}"
            for name, root in PACKAGE_ROOTS.items()
            for path in root.rglob("*.py") if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """Wheel and sdist built from a copy of the project's sources (the build writes build/ and egg-info beside them)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(REPO / "pyproject.toml", source)
    for root in ("operator", "trainer_image"):
        shutil.copytree(REPO / root, source / root, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the test venv has setuptools and build, and tests reach no package index.
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(out),
                           str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_wheel_holds_every_module(dist):
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(tree_modules() - names)
    assert not missing, f"the wheel lacks {missing}"


def test_the_sdist_holds_every_module(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = {f"{PACKAGE_ROOTS[module.split('/')[0]].relative_to(REPO).parent.as_posix()}/{module}"
                for module in tree_modules()}
    missing = sorted(expected - names)
    assert not missing, f"the sdist lacks {missing}"


def test_the_console_script_starts_from_a_clean_venv_with_the_wheel(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True, capture_output=True)
    # The dependencies come from the test venv's site-packages through a plain path line: a .pth named by another
    # .pth is not processed, so the checkout's editable install stays out and the project can only come from the wheel.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}

    helped = subprocess.run([str(venv / "bin" / "grporun"), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "operator" in helped.stdout

    # Every operator module imports (the operator image has nothing else), and from the wheel, not the checkout.
    operator_modules = sorted(module[:-3].replace("/", ".").removesuffix(".__init__")
                              for module in tree_modules()
                              if module.startswith("grpo_operator/") and not module.endswith("__main__.py"))
    imported = subprocess.run(
        [str(python), "-c", "import importlib, sys\n"
                            "for name in sys.argv[1:]: print(importlib.import_module(name).__file__)",
         *operator_modules], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr[-3000:]
    files = imported.stdout.split()
    assert len(files) == len(operator_modules)
    assert all(file.startswith(str(venv)) for file in files), files
