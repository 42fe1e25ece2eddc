"""hack/images/build.sh's own steps, with the image tools replaced by scripts that record how they were called: fast,
and they run wherever bash does (the images themselves are tests/images/test_images.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.node.images import BUILD_SCRIPT, TOOLS

# A stand-in for each tool: `buildah inspect` finds no image (so the base is built), mmdebstrap writes the
# descriptors it was started with and fails, as a real one fails, so the script stops there.
RECORDER = f"""#!{sys.executable}
import os, sys
if os.path.basename(sys.argv[0]) == "mmdebstrap":
    def inherited(fd):  # open, and not this script (which the interpreter holds open while it runs)
        try:
            return os.path.realpath(f"/proc/self/fd/{{fd}}") != os.path.realpath(sys.argv[0])
        except OSError:
            return False
    fds = [fd for fd in range(64) if os.path.exists(f"/proc/self/fd/{{fd}}") and inherited(fd)]
    with open(os.environ["RECORDED"], "w") as out:
        out.write(" ".join(map(str, fds)))
sys.exit(1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="hack/images/build.sh refuses to run without root")
def test_the_rootfs_is_made_with_no_descriptor_but_the_standard_three(tmp_path: Path):
    # mmdebstrap hands apt a pipe on the lowest free descriptor and dpkg's /bin/sh writes to it; dash cannot
    # redirect to a descriptor above 9, so one inherited lock descriptor too many failed the cold build.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).write_text(RECORDER)
        (bin_dir / tool).chmod(0o755)
    recorded = tmp_path / "fds"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORDED": str(recorded),
           "GRPO_IMAGES_CACHE": str(tmp_path / "cache"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    done = subprocess.run([str(BUILD_SCRIPT), "operator"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "a Debian 12 rootfs" in done.stderr, done.stderr
    assert sorted(int(fd) for fd in recorded.read_text().split()) == [0, 1, 2]
