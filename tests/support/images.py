"""The project's images, built from its own Dockerfiles by hack/images/build.sh (buildah; no Docker, no registry).

`operator_image()` and `trainer_image()` build on first use (cached by content in the cache folder, so later calls
and later runs only look the archive up) and return the image's reference and its docker-archive, which
`ctr -n k8s.io images import` and `podman load` read. `podman(...)` runs podman on the build's own layer store, so
a test can run a built image without loading it anywhere.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO

BUILD_SCRIPT = REPO / "hack" / "images" / "build.sh"
TOOLS = ("mmdebstrap", "buildah", "podman", "runc")
# Root here may lack CAP_SYS_RESOURCE: podman's default rlimits (nofile 1048576) cannot be set, explicit ones can.
ULIMITS = ("--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384")


class Unavailable(Exception):
    """Images cannot be built on this machine; the message says why (tests skip with it)."""


@dataclass(frozen=True)
class BuiltImage:
    reference: str  # localhost/<name>:<content key>, the name a pod's `image:` uses (imagePullPolicy: Never)
    archive: Path  # a docker-archive holding that reference


def missing_prerequisite() -> str | None:
    """Why images cannot be built here, or None."""
    if os.geteuid() != 0:
        return "building images needs root (mmdebstrap, buildah's overlay store)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (make setup-apt installs them)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem"
    return None


@functools.cache
def _build(name: str) -> BuiltImage:
    why = missing_prerequisite()
    if why:
        raise Unavailable(why)
    done = subprocess.run([str(BUILD_SCRIPT), name], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the {name} image failed:\n{done.stderr[-4000:]}")
    reference, archive = done.stdout.strip().splitlines()[-1].split(" ", 1)
    return BuiltImage(reference, Path(archive))


def operator_image() -> BuiltImage:
    """The operator image (`Dockerfile`): `grporun`, the CRD at GRPO_CRD_PATH."""
    return _build("operator")


def trainer_image() -> BuiltImage:
    """The trainer image's CPU variant (`trainer_image/Dockerfile`, VARIANT=cpu): the learner and rollout roles."""
    return _build("trainer-cpu")


@functools.cache
def _podman_flags() -> tuple[str, ...]:
    done = subprocess.run([str(BUILD_SCRIPT), "--podman-flags"], capture_output=True, text=True, check=True)
    return tuple(done.stdout.split())


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`podman <args>` on the build's layer store (output captured, not checked)."""
    return subprocess.run(["podman", *_podman_flags(), *args], capture_output=True, text=True, timeout=timeout)


def run_container(image: BuiltImage, *args: str, entrypoint: str | None = None,
                  volumes: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Runs the image once as a cluster would: its own user and entrypoint, no network, explicit rlimits."""
    flags = ["--rm", "--network", "none", *ULIMITS]
    if entrypoint is not None:
        flags += ["--entrypoint", entrypoint]
    for volume in volumes:
        flags += ["-v", volume]
    return podman("run", *flags, image.reference, *args)


def image_config(image: BuiltImage) -> dict:
    """The image's OCI config (User, Entrypoint, Cmd, Env, WorkingDir)."""
    done = podman("image", "inspect", "--format", "{{json .Config}}", image.reference)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout)
