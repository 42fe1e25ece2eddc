"""hack/images/build.sh's own steps, with the image tools replaced by scripts that record how they were called: fast,
and they run wherever bash does (the images themselves are tests/images/test_images.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.node.images import BUILD_SCRIPT, HOLDER_ENV, TOOLS

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


def _build_script(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GRPO_IMAGES_CACHE": str(tmp_path / "cache"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    return subprocess.run([str(BUILD_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_a_dry_run_push_prints_the_release_names_of_each_image(tmp_path):
    """`--push DESTINATION VERSION --dry-run` prints the push each image would get, from the build's store to the
    name a release gives it; nothing is built (the cache folder stays empty) and nothing runs but the hashing."""
    done = _build_script("--push", "docker://ghcr.io/acme", "0.2.0-rc.1", "--dry-run",
                         "operator", "trainer-cpu", "trainer-cuda", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    pushes = [line.split() for line in done.stdout.splitlines()]
    assert [push[0] for push in pushes] == ["buildah"] * 3
    assert all(push[push.index("push") - 1] == "overlay" for push in pushes)  # on the build's own store
    repositories = [push[-2].rsplit(":", 1)[0] for push in pushes]
    assert repositories == ["localhost/grpo-operator", "localhost/grpo-trainer", "localhost/grpo-trainer"]
    assert len({push[-2] for push in pushes}) == 3  # each variant its own content key
    assert [push[-1] for push in pushes] == ["docker://ghcr.io/acme/grpo-operator:0.2.0-rc.1",
                                             "docker://ghcr.io/acme/grpo-trainer:0.2.0-rc.1-cpu",
                                             "docker://ghcr.io/acme/grpo-trainer:0.2.0-rc.1-cuda"]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("args", "message"), [
    (("--push", "docker://ghcr.io/acme", "v0.2.0", "operator"), "'v0.2.0' is not a release version"),
    (("--push", "docker://ghcr.io/acme", "0.2", "operator"), "'0.2' is not a release version"),
    (("--push", "docker://ghcr.io/acme", "0.2.0+build.1", "operator"), "is not a release version"),
    (("--dry-run", "operator"), "--dry-run goes with --push"),
    (("--push", "docker://ghcr.io/acme", "0.2.0", "trainer-rocm"), "IMAGE: operator | trainer-cpu | trainer-cuda"),
])
def test_a_push_with_a_bad_version_or_image_is_refused_in_one_line(tmp_path, args, message):
    done = _build_script(*args, tmp_path=tmp_path)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not done.stdout


# A store the stand-in tools keep as one file per image reference: mmdebstrap writes its rootfs, `podman import` and
# `buildah bud -t REF` add REF, `buildah push REF docker-archive:PATH:REF` writes PATH, `buildah rmi REF` removes it.
STORE_TOOLS = f"""#!{sys.executable}
import os, sys
from pathlib import Path
store = Path(os.environ["FAKE_STORE"])
store.mkdir(exist_ok=True)
args = sys.argv[1:]
while args and args[0].startswith("--"):  # the global flags: each takes a value
    args = args[2:]
def image(ref):
    return store / ref.replace("/", "_")
tool, command = os.path.basename(sys.argv[0]), args[0] if args else ""
if tool == "mmdebstrap":
    Path(next(arg for arg in args if arg.endswith(".tar"))).write_text("rootfs")
elif command == "import":
    image(args[-1]).write_text("image")
elif command == "bud":
    image(args[args.index("-t") + 1]).write_text("image")
elif command == "inspect":
    sys.exit(0 if image(args[-1]).exists() else 1)
elif command == "push":
    Path(args[-1].split(":")[1]).write_text("archive")
elif command == "rmi":
    sys.exit(0 if image(args[-1]).exists() and image(args[-1]).unlink() is None else 1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="hack/images/build.sh refuses to run without root")
def test_pruning_keeps_an_older_image_while_the_run_that_built_it_runs(tmp_path: Path):
    # Runs of other branches build other keys; pruning to the newest two removed the trainer image of a run still
    # using it (its node and image tests then found no archive). A run's lease keeps it until the run ends.
    bin_dir, cache, store = tmp_path / "bin", tmp_path / "cache", tmp_path / "store"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).write_text(STORE_TOOLS)
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_STORE": str(store),
           "GRPO_IMAGES_CACHE": str(cache), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop(HOLDER_ENV, None)

    def build(recipe: str, holder: int | None = None) -> tuple[str, Path]:
        # TORCH_CPU_INDEX is a build arg of the trainer image: each value another key, as another branch's sources
        done = subprocess.run([str(BUILD_SCRIPT), "trainer-cpu"], capture_output=True, text=True, timeout=120,
                              env={**env, "TORCH_CPU_INDEX": recipe,
                                   **({HOLDER_ENV: str(holder)} if holder else {})})
        assert done.returncode == 0, done.stderr
        reference, archive = done.stdout.split()
        return reference, Path(archive)

    def present(reference: str, archive: Path) -> bool:
        return archive.exists() and (store / reference.replace("/", "_")).exists()

    run = subprocess.Popen(["sleep", "600"])  # a test run that uses its image until it ends
    try:
        ours = build("https://a.example/", holder=run.pid)
        others = [build(f"https://{branch}.example/") for branch in "bcd"]
        assert present(*ours)
        assert not present(*others[0])  # older than the newest two, and no run holds it
        assert all(present(*image) for image in others[1:])
    finally:
        run.kill()
        run.wait()
    build("https://e.example/")
    assert not present(*ours)  # its run ended: pruned as any older image
