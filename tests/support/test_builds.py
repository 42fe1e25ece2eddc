"""The long builds' progress (hack/lib/progress.sh), and how a pytest run overlaps them with the tests that need none
of their outputs (tests/support/builds.py, build_fixtures.py): fake build scripts stand in for the Go builds, and a
pytest run of its own (alone, and on two xdist workers) shows what reaches the terminal."""

from __future__ import annotations

import fcntl
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.build_fixtures import Unit, next_unit
from tests.support.builds import BUILD_NICENESS, PROGRESS_PREFIX, Board, BuildFailed, Builds
from tests.support.controlplane.control_plane import BUILD_NAME as CONTROL_PLANE_BUILD
from tests.support.controlplane.control_plane import go_build
from tests.support.controlplane.kueue_manager import BUILD_NAME as KUEUE_BUILD
from tests.support.paths import REPO

PROGRESS = REPO / "hack" / "lib" / "progress.sh"
BUILD_TIMES = REPO / "hack" / "lib" / "build-times"
LOCK_HELD_S = 3


def fake_build(path: Path, name: str, body: str) -> Path:
    """A build script like hack/*/build.sh: progress through hack/lib/progress.sh, `body` as the build, and the
    folder it built into as its last line of output."""
    out = path.parent / f"{path.stem}-bin"
    path.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        set -euo pipefail
        source {PROGRESS}
        build_lock {path.parent}/.build.lock {name}
        build_run {name} "a fake {name}" bash -c {body!r} >&2
        mkdir -p {out}
        echo {out}
        """))
    path.chmod(0o755)
    return out


def run_builds(tmp_path: Path, *builds, lines: list[str]) -> Builds:
    (tmp_path / "board").mkdir()
    queue = Builds(tmp_path / "logs", Board(tmp_path / "board"), list(builds))
    queue.poll(lines.append)
    return queue


def wait(builds: Builds, name: str, lines: list[str]) -> str:
    return builds.board.wait(name, lambda: builds.poll(lines.append)).value()


def recorded_minutes(name: str) -> str:
    row = next(line.split() for line in BUILD_TIMES.read_text().splitlines() if line.split()[:1] == [name])
    seconds = int(row[1])
    return f"{seconds // 60}m{seconds % 60:02d}s"


def test_a_slow_build_says_what_it_builds_how_long_so_far_and_how_long_it_took_here(tmp_path, monkeypatch):
    monkeypatch.setenv("BUILD_PROGRESS_INTERVAL_S", "1")
    out = fake_build(tmp_path / "build.sh", CONTROL_PLANE_BUILD, "sleep 3.5")
    lines: list[str] = []
    builds = run_builds(tmp_path, go_build(CONTROL_PLANE_BUILD, [str(tmp_path / "build.sh")], "it is"), lines=lines)
    assert wait(builds, CONTROL_PLANE_BUILD, lines) == str(out)
    took_here = f"a cold build took {recorded_minutes(CONTROL_PLANE_BUILD)} on the 2-core development machine"
    assert lines[0] == f"build: controlplane: building a fake controlplane ({took_here})"
    so_far = [line for line in lines if re.fullmatch(rf"build: controlplane: building a fake controlplane, \ds so far "
                                                      rf"\({re.escape(took_here)}\)", line)]
    assert len(so_far) >= 2, lines
    assert re.fullmatch(r"build: controlplane: built a fake controlplane in \ds", lines[-1]), lines
    assert all(line.startswith(PROGRESS_PREFIX) for line in lines)


def test_a_build_waiting_for_the_lock_says_so_and_its_time_leaves_the_wait_out(tmp_path):
    fake_build(tmp_path / "build.sh", KUEUE_BUILD, "true")
    with open(tmp_path / ".build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build holds the lock
        lines: list[str] = []
        builds = run_builds(tmp_path, go_build(KUEUE_BUILD, [str(tmp_path / "build.sh")], "it is"), lines=lines)
        while not any("waiting for another build" in line for line in lines):
            builds.poll(lines.append)
            time.sleep(0.1)
        time.sleep(LOCK_HELD_S)  # long enough that a time counting the wait would show it
        assert not builds.queue[0].done
    released = time.monotonic()
    wait(builds, KUEUE_BUILD, lines)
    since_release = time.monotonic() - released
    took = re.fullmatch(rf"build: {KUEUE_BUILD}: built a fake {KUEUE_BUILD} in (\d+)s", lines[-1])
    assert took, lines
    # The build began after the release and ended before it was seen; whole seconds of the clock round up by one.
    assert int(took[1]) <= math.ceil(since_release), (lines[-1], since_release)


def test_a_build_runs_ahead_of_the_tests_on_the_cores(tmp_path):
    niceness, session = tmp_path / "niceness", tmp_path / "session"
    autogroups = Path("/proc/self/autogroup").exists()
    fake_build(tmp_path / "build.sh", KUEUE_BUILD,
               f"sleep 0.5; nice > {niceness}; cat /proc/self/autogroup > {session} 2>/dev/null || true")
    lines: list[str] = []
    wait(run_builds(tmp_path, go_build(KUEUE_BUILD, [str(tmp_path / "build.sh")], "it is"), lines=lines),
         KUEUE_BUILD, lines)
    ours = os.nice(0)
    # Only root may raise a priority; elsewhere the build runs at the tests' own.
    expected = max(ours + BUILD_NICENESS, -20) if os.geteuid() == 0 else ours
    assert int(niceness.read_text()) == expected
    if autogroups and os.geteuid() == 0:  # the kernel shares the cores between sessions first
        assert session.read_text().split()[-2:] == ["nice", str(BUILD_NICENESS)], session.read_text()


def test_a_failed_build_raises_with_its_log_tail(tmp_path):
    fake_build(tmp_path / "build.sh", KUEUE_BUILD, "echo 'undefined: v1.SomeType' >&2; exit 2")
    lines: list[str] = []
    builds = run_builds(tmp_path, go_build(KUEUE_BUILD, [str(tmp_path / "build.sh")], "it is"), lines=lines)
    with pytest.raises(BuildFailed, match="exited with 2") as failed:
        wait(builds, KUEUE_BUILD, lines)
    assert "undefined: v1.SomeType" in str(failed.value)
    assert lines[-1].startswith(f"build: {KUEUE_BUILD}: building a fake {KUEUE_BUILD} failed after")


# A pytest run of its own: the plugin with the fake builds in place of the Go builds. Its tests are written in the
# order a test module might hold them: those that need binaries first. `control_plane` stands in for the real session
# fixture of that name, whose tests form one xdist group: it records the worker that set it up.
INNER_CONFTEST = """
import os
from pathlib import Path

import pytest

import tests.support.controlplane.control_plane, tests.support.controlplane.kueue_manager
tests.support.controlplane.control_plane.BUILD_SCRIPT = Path({control_plane_script!r})
tests.support.controlplane.kueue_manager.BUILD_SCRIPT = Path({kueue_script!r})
pytest_plugins = ["tests.support.build_fixtures"]


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries):
    with open({set_up!r}, "a") as record:
        record.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
    return control_plane_binaries
"""
INNER_TESTS = """
def test_needs_kueue(kueue_binaries, control_plane_binaries):
    print("ran kueue", kueue_binaries)

def test_needs_the_control_plane(control_plane_binaries):
    print("ran control plane", control_plane_binaries)

import pytest

@pytest.mark.parametrize("n", range(6))
def test_uses_the_control_plane(control_plane, n):
    pass

@pytest.mark.parametrize("n", range(4))
def test_needs_nothing(n):
    pass
"""
NEED_NOTHING = [f"test_needs_nothing[{n}]" for n in range(4)]
NEED_BUILDS = ["test_needs_the_control_plane", *(f"test_uses_the_control_plane[{n}]" for n in range(6)),
               "test_needs_kueue"]


def run_inner_pytest(tmp_path: Path, control_plane_body: str, kueue_body: str = "true",
                     *xdist: str) -> subprocess.CompletedProcess:
    fake_build(tmp_path / "controlplane.sh", CONTROL_PLANE_BUILD, control_plane_body)
    fake_build(tmp_path / "kueue.sh", KUEUE_BUILD, kueue_body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST.format(
        control_plane_script=str(tmp_path / "controlplane.sh"), kueue_script=str(tmp_path / "kueue.sh"),
        set_up=str(tmp_path / "control-plane-set-up")))
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {key: value for key, value in os.environ.items()
           if key not in ("KUBEBUILDER_ASSETS", "PYTEST_ADDOPTS") and not key.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=str(REPO), BUILD_PROGRESS_INTERVAL_S="1", TMPDIR=str(tmp_path))  # its build logs too
    # timeout=2 (pytest-timeout): the build takes longer, and waiting for it is not charged to the test.
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "timeout=2", *xdist,
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def outcomes(out: str, outcome: str) -> list[str]:
    """The inner tests with `outcome`, in the order reported (pytest alone, or under xdist), each once (the summary
    repeats errors)."""
    found = re.findall(rf"test_inner.py::([\w\[\]]+) {outcome}|{outcome} test_inner.py::([\w\[\]]+)", out)
    return list(dict.fromkeys(alone or distributed for alone, distributed in found))


def test_pytest_runs_the_tests_that_need_no_binaries_first_and_shows_the_builds_progress(tmp_path):
    done = run_inner_pytest(tmp_path, "sleep 3.5")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert outcomes(out, "PASSED") == NEED_NOTHING + NEED_BUILDS
    # Past pytest's output capture, while the test that needs the control plane waits for it.
    assert re.search(r"build: controlplane: building a fake controlplane, \ds so far", out), out
    assert out.index("build: controlplane: built") < out.index("build: kueue: building")  # one after the other
    assert "builds: controlplane, kueue in the background, one at a time per lane" in out
    assert "the 4 tests that need none of them run first" in out


def test_on_two_xdist_workers_the_builds_run_once_and_a_group_shares_its_session_fixture(tmp_path):
    done = run_inner_pytest(tmp_path, "sleep 3.5", "true", "-n", "2")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert sorted(outcomes(out, "PASSED")) == sorted(NEED_NOTHING + NEED_BUILDS)
    # The controller runs the builds and prints their progress while a worker waits for them.
    assert out.count("builds: controlplane, kueue in the background") == 1, out
    assert re.search(r"build: controlplane: building a fake controlplane, \ds so far", out), out
    assert out.count("build: controlplane: built") == 1 and out.count("build: kueue: built") == 1, out
    # One worker set the session fixture up once for the six tests of its group.
    assert len((tmp_path / "control-plane-set-up").read_text().split()) == 1
    # Neither worker started waiting for the build while a test that needs none was left: each ran some of them.
    workers = {test: worker for worker, test in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED test_inner.py::([\w\[\]]+)",
                                                         out)}
    assert {workers[test] for test in NEED_NOTHING} == {"gw0", "gw1"}, out


def units(*scopes: str) -> list[Unit]:
    """Units named `scope` or `scope|build,build` (the builds it needs)."""
    return [Unit(scope.partition("|")[0], frozenset(filter(None, scope.partition("|")[2].split(","))))
            for scope in scopes]


QUEUE = units("vllm-server", "node|node,trainer-image", "control-plane|controlplane", "a.py::t1",
              "b.py::t2|operator-image")


def test_a_free_worker_gets_the_first_group_whose_builds_are_done():
    assert next_unit(QUEUE, {"controlplane", "node", "trainer-image", "operator-image"}, idle=True).scope == \
        "vllm-server"
    assert next_unit(QUEUE[1:], {"controlplane", "node", "trainer-image"}, idle=False).scope == "node"
    assert next_unit(QUEUE[1:], {"controlplane"}, idle=False).scope == "control-plane"


def test_a_test_whose_builds_are_done_comes_before_a_group_waiting_for_its_builds():
    assert next_unit(QUEUE[1:], set(), idle=True).scope == "a.py::t1"
    assert next_unit([QUEUE[1], QUEUE[4]], {"operator-image"}, idle=False).scope == "b.py::t2"


def test_a_slow_test_whose_builds_are_done_comes_before_the_quick_ones_so_the_run_ends_on_quick_ones():
    queue = [*units("a.py::quick", "b.py::quick2"), Unit("c.py::slow", frozenset({"tool-model"}), slow=True),
             Unit("d.py::slow", frozenset(), slow=True)]
    assert next_unit(queue, set(), idle=False).scope == "d.py::slow"
    assert next_unit(queue, {"tool-model"}, idle=False).scope == "c.py::slow"
    assert next_unit(queue[:2], set(), idle=False).scope == "a.py::quick"
    assert next_unit([*queue, *units("node|node")], {"node"}, idle=False).scope == "node"  # groups still first


def test_a_worker_waits_for_a_build_only_when_it_has_nothing_else_to_run():
    waiting = units("node|node", "b.py::t2|operator-image")
    assert next_unit(waiting, set(), idle=False) is None  # it asks again when it finishes a test
    assert next_unit(waiting, set(), idle=True).scope == "node"
    assert next_unit([], set(), idle=True) is None


def test_a_failed_build_fails_the_tests_that_need_it_with_its_log_tail_and_skips_nothing(tmp_path):
    done = run_inner_pytest(tmp_path, "echo 'compile: undefined: apiserver.Thing' >&2; exit 1")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert outcomes(out, "PASSED") == NEED_NOTHING
    assert outcomes(out, "ERROR") == NEED_BUILDS
    assert "BuildFailed" in out and "compile: undefined: apiserver.Thing" in out
    assert "SKIPPED" not in out and "skipped" not in out
