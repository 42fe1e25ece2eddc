"""The project's images, built from its own Dockerfiles by hack/images/build.sh (buildah; no Docker, no registry).

`build(name)` is the build of one image (run by build_fixtures.py in the background, cached by content in the cache
folder, so later runs only look the archive up); its result is the image's reference and its docker-archive, which
`ctr -n k8s.io images import` and `podman load` read (`BuiltImage.parse`). `podman(...)` runs podman on the build's
own layer store, so a test can run a built image without loading it anywhere.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.builds import Build, Unavailable
from tests.support.paths import REPO

BUILD_SCRIPT = REPO / "hack" / "images" / "build.sh"
TOOLS = ("mmdebstrap", "buildah", "podman", "runc")
# Root here may lack CAP_SYS_RESOURCE: podman's default rlimits (nofile 1048576) cannot be set, explicit ones can.
ULIMITS = ("--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384")


#: The builds (as build_fixtures.py and their progress lines name them) and the argument build.sh takes for each.
OPERATOR_BUILD, TRAINER_BUILD, TRAINER_CUDA_BUILD = "operator-image", "trainer-image", "trainer-cuda-image"
SCRIPT_IMAGE = {OPERATOR_BUILD: "operator", TRAINER_BUILD: "trainer-cpu", TRAINER_CUDA_BUILD: "trainer-cuda"}
#: The CUDA variant is built only when this is set to 1: its first build takes tens of minutes and ~25 GB of disk,
#: more than a test run's budget (`make image-cuda` builds and checks it).
CUDA_IMAGE_ENV = "GRPO_TEST_CUDA_IMAGE"
#: build.sh's lease: the process that uses the images it prints until it ends.
HOLDER_ENV = "GRPO_IMAGES_HOLDER"


@dataclass(frozen=True)
class BuiltImage:
    reference: str  # localhost/<name>:<content key>, the name a pod's `image:` uses (imagePullPolicy: Never)
    archive: Path | None  # a docker-archive holding that reference; None for an image kept in the store only

    @classmethod
    def parse(cls, line: str) -> BuiltImage:
        """From build.sh's "<reference> <archive>" line ("<reference>" alone: in the build's store only)."""
        reference, _, archive = line.partition(" ")
        return cls(reference, Path(archive) if archive else None)


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


def build(name: str) -> Build:
    """The build of image `name` (not started: build_fixtures.py runs it in the images' lane); Unavailable where
    images cannot be built here, and for the CUDA variant unless CUDA_IMAGE_ENV asks for it."""
    why = missing_prerequisite()
    if why:
        raise Unavailable(why)
    if name == TRAINER_CUDA_BUILD and os.environ.get(CUDA_IMAGE_ENV) != "1":
        raise Unavailable(f"the CUDA trainer image is built only when asked ({CUDA_IMAGE_ENV}=1): a first build takes "
                          "tens of minutes and ~25 GB of disk (make image-cuda builds and checks it)")
    # This process (the run's controller, which plans the builds) holds the image until it ends: another run's
    # build of another recipe prunes older images, but not one a running test run uses.
    return Build(name, [str(BUILD_SCRIPT), SCRIPT_IMAGE[name]], {**os.environ, HOLDER_ENV: str(os.getpid())},
                 lane="images")


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
