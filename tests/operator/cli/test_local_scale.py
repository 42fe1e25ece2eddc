"""`grporun local scale NAME N`: a running local run's rollout servers, scaled.

The command's own checks and the supervisor's side (start the added server through the state machine, rewrite the
run config the learner watches, stop a removed server once the learner's report no longer lists it) run against
scripted servers (tests/support/servers/completions_server.py); the long test (`make test-long`) scales a real run
with real vLLM servers 1 -> 2 -> 1 while it trains to its exact bound.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from grpo_operator import builders
from grpo_operator import status as st
from grpo_operator.cli import main as grporun
from grpo_operator.exit_codes import ExitCode
from grpo_operator.local.plan import ProcessPlan
from grpo_operator.local.processes import LocalProcess, http_get, http_ok
from grpo_operator.local.scaling import REPLICAS_FILE, SUPERVISOR_FILE, ScaleBounds, SupervisorRecord
from grpo_operator.local.supervise import LocalPort, LocalRun, prepare, tick
from grpo_trainer.contract.codes import PROGRESS_PATH, DropReason, ReplicaState
from grpo_trainer.contract.report import ProgressReport, RolloutReplicaReport, parse_progress
from tests.operator.cli.test_local_run import GRPORUN, tiny_manifest
from tests.support.paths import COMPLETIONS_SERVER, REPO

SERVER = str(COMPLETIONS_SERVER)
TINY = REPO / "examples" / "tiny.yaml"


def scale(runs: Path, *words: str, capsys) -> tuple[int, list[str], list[str]]:
    try:
        code = grporun(["local", "scale", *words, "--runs-dir", str(runs)])
    except SystemExit as exited:  # argparse's own usage errors
        code = exited.code
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def test_scale_refuses_an_unknown_run_a_run_not_running_and_counts_out_of_bounds(tmp_path, capsys):
    runs = tmp_path / "runs"
    code, _, err = scale(runs, "tiny", "2", capsys=capsys)
    assert code == ExitCode.USAGE and len(err) == 1 and err[0].startswith("grporun local scale: NAME: no run 'tiny'")
    run_dir = runs / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    code, _, err = scale(runs, "tiny", "2", capsys=capsys)
    assert code == ExitCode.FAILED and err == [f"grporun local scale: run 'tiny' is not running: no grporun local "
                                               f"supervises {run_dir}/"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    bounds = ScaleBounds(1, 2, "one server per CPU core of this machine (2)")
    SupervisorRecord(dead.pid, 1, bounds).write(run_dir)  # left by a supervisor that was killed
    assert scale(runs, "tiny", "2", capsys=capsys)[0] == ExitCode.FAILED
    SupervisorRecord(os.getpid(), 1, bounds).write(run_dir)
    code, _, err = scale(runs, "tiny", "3", capsys=capsys)
    assert code == ExitCode.USAGE and err == [
        "grporun local scale: N: 3 is above 2, the most for this run: one server per CPU core of this machine (2)"]
    for bad, says in (("0", "must be at least 1, not 0"), ("two", "must be a whole number, not 'two'")):
        code, _, err = scale(runs, "tiny", bad, capsys=capsys)
        assert code == ExitCode.USAGE and err[-1] == f"grporun local scale: error: argument N: {says}" + (
            ": a run needs a rollout server" if bad == "0" else "")
    assert not (run_dir / REPLICAS_FILE).exists()  # nothing was asked
    code, out, err = scale(runs, "tiny", "2", capsys=capsys)
    assert code == ExitCode.OK and not err and out[0].startswith("run tiny: 1 -> 2 rollout servers asked")
    assert (run_dir / REPLICAS_FILE).read_text() == "2\n"


def test_scale_below_the_given_servers_is_refused():
    bounds = ScaleBounds(2, 4, "one server per CPU core", "2 server(s) came with --rollout-url and are not this "
                         "run's to stop")
    assert bounds.problem(1) == "1 is below 2: 2 server(s) came with --rollout-url and are not this run's to stop"
    assert bounds.problem(3) is None


@pytest.fixture
def local_run(tmp_path, tiny_model_dir):
    """A prepared local run on one scripted server (given as --rollout-url); added servers are scripted too, and the
    learner is a process that sleeps."""
    first = subprocess.Popen([sys.executable, SERVER, "s0"], stdout=subprocess.PIPE, text=True)
    first_url = first.stdout.readline().strip()
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["model"] = tiny_model_dir
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False,
                                       fresh=False, rollout_url=[first_url], rollout_python=sys.executable,
                                       rollout_restart_limit=None))

    def scripted_server(ordinal: int, port: int) -> ProcessPlan:
        return ProcessPlan(builders.rollout_pod_name(local.name, ordinal), "rollout",
                           [sys.executable, SERVER, f"s{ordinal}", str(port)], {}, f"http://127.0.0.1:{port}")

    local.plan_server = scripted_server
    learner = local.learner()
    learner.plan = ProcessPlan(learner.plan.name, "learner", [sys.executable, "-c", "import time; time.sleep(300)"],
                               {}, learner.plan.url)
    yield local, first_url
    local.stop_all()
    first.kill()
    first.wait()


def run_config_urls(local: LocalRun) -> list[str]:
    return json.loads((local.run_dir / "run.json").read_text())["rollout"]["urls"]


class Ticks:
    """The supervisor's ticks (the scale request read, the engine's pass through the local port) with the learner's
    report and the clock scripted: `report` is what the learner's /progress answers next, `now` the time the pass
    sees."""

    def __init__(self, local: LocalRun):
        self.local, self.log = local, []
        self.report: ProgressReport | None = None
        self.now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
        self.port = LocalPort(local, self.log.append, read_progress=lambda url: self.report, now=lambda: self.now)

    def __call__(self) -> st.Decision:
        outcome = asyncio.run(tick(self.local, self.port))
        assert outcome is not None
        return outcome.decision

    def events(self, reason: str) -> list[str]:
        return [line for line in self.log if f" {reason}: " in line]


def report_of(*servers: tuple[str, ReplicaState]) -> ProgressReport:
    return ProgressReport(rollout=[RolloutReplicaReport(replica=i, url=url, state=state)
                                   for i, (url, state) in enumerate(servers)])


def scaled_to_two(local: LocalRun, tick: Ticks) -> LocalProcess:
    """The run up (the learner started), then scaled to two servers: the added one started and in run.json."""
    tick()
    (local.run_dir / REPLICAS_FILE).write_text("2\n")
    tick()
    added = local.processes["tiny-rollout-1"]
    assert added.popen is not None  # started by CreateChildren
    return added


def test_a_scaled_local_run_starts_the_added_server_rewrites_the_config_and_stops_a_removed_one_once_drained(
        local_run):
    local, first_url = local_run
    tick = Ticks(local)
    assert (local.run_dir / SUPERVISOR_FILE).is_file()
    added = scaled_to_two(local, tick)
    assert local.spec.rollout.replicas == 2
    assert run_config_urls(local) == [first_url, added.plan.url]
    assert SupervisorRecord.read(local.run_dir).replicas == 2
    assert tick.events("Scaled") == [
        "Normal Scaled: rollout scaled from 1 to 2 servers: creating 1 rollout pod(s)"]
    deadline = time.monotonic() + 30
    while not http_ok(f"{added.plan.url}/health"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (local.run_dir / REPLICAS_FILE).write_text("1\n")
    # The learner still reports it (it has not read the file yet, then while it drains): it keeps running.
    for state in (ReplicaState.SERVING, ReplicaState.DRAINING):
        tick.report = report_of((first_url, ReplicaState.SERVING), (added.plan.url, state))
        tick()
        assert run_config_urls(local) == [first_url] and local.spec.rollout.replicas == 1
        assert added.poll() is None and "tiny-rollout-1" in local.processes
    tick.report = None  # no report this pass: no verdict
    tick()
    assert added.poll() is None
    tick.report = report_of((first_url, ReplicaState.SERVING))
    decision = tick()
    assert st.DeletePods(("tiny-rollout-1",), reason="drained") in decision.actions
    assert added.poll() is not None and "tiny-rollout-1" not in local.processes
    assert tick.events("Drained") == [
        "Normal Drained: tiny-rollout-1 left the rollout set and the learner has drained it"]
    assert [p.name for p in local.observations() if p.role == "rollout"] == ["tiny-rollout-0"]


def test_a_removed_server_still_draining_at_its_deadline_is_stopped_with_a_warning(local_run):
    local, first_url = local_run
    tick = Ticks(local)
    added = scaled_to_two(local, tick)
    (local.run_dir / REPLICAS_FILE).write_text("1\n")
    tick.report = report_of((first_url, ReplicaState.SERVING), (added.plan.url, ReplicaState.DRAINING))
    tick()
    deadline_s = builders.drain_deadline_seconds(local.spec)
    tick.now += datetime.timedelta(seconds=deadline_s - 1)
    tick()
    assert added.poll() is None
    tick.now += datetime.timedelta(seconds=2)
    tick()
    assert added.poll() is not None and "tiny-rollout-1" not in local.processes
    assert tick.events("DrainDeadlineExceeded")[0].startswith(
        f"Warning DrainDeadlineExceeded: tiny-rollout-1 left the rollout set {deadline_s} s ago")


def test_a_server_asked_back_while_draining_serves_again_in_its_own_process(local_run):
    local, first_url = local_run
    tick = Ticks(local)
    added = scaled_to_two(local, tick)
    pid = added.popen.pid
    tick.report = report_of((first_url, ReplicaState.SERVING), (added.plan.url, ReplicaState.DRAINING))
    (local.run_dir / REPLICAS_FILE).write_text("1\n")
    tick()
    assert run_config_urls(local) == [first_url]
    (local.run_dir / REPLICAS_FILE).write_text("2 \n")
    tick()
    assert local.processes["tiny-rollout-1"].popen.pid == pid and added.poll() is None
    assert run_config_urls(local) == [first_url, added.plan.url]


def test_an_unusable_request_is_refused_once_and_changes_nothing(local_run):
    local, first_url = local_run
    tick = Ticks(local)
    for text in ("tw", "two\n", "two\n", "9\n", "0\n"):
        (local.run_dir / REPLICAS_FILE).write_text(text)
        tick()
    refused = [line for line in tick.log if "ScaleRefused" in line]
    assert len(refused) == 4  # a file left as it is is not refused again
    assert "'two' is not a whole number" in refused[1] and str(local.run_dir / REPLICAS_FILE) in refused[1]
    assert "9 is above" in refused[2] and "0 is below 1" in refused[3]
    assert run_config_urls(local) == [first_url] and local.spec.rollout.replicas == 1


def test_a_request_left_by_an_earlier_run_does_not_apply_and_the_end_removes_the_files(local_run, tmp_path):
    local, _ = local_run
    local.stop_all()
    assert not (local.run_dir / SUPERVISOR_FILE).exists() and not (local.run_dir / REPLICAS_FILE).exists()
    (local.run_dir / REPLICAS_FILE).write_text("2\n")
    local.scaling.begin()  # what a --resume of the folder does first
    assert not (local.run_dir / REPLICAS_FILE).exists()


# ----------------------------------------------------------------------------------------------------------------------
# Real vLLM servers
# ----------------------------------------------------------------------------------------------------------------------
RUN_TIMEOUT_S = 1800
#: 16 prompts x 60 = 960 groups: training (about 4 groups/s on the 2-core machine, BENCHMARKS.md section 5) outlasts
#: a second CPU server's start (2.5-4.5 min there).
SCALED_RUN_EPOCHS = 60


def _wait_for(condition, what: str, process: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: " + process.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def _report(progress_url: str) -> ProgressReport | None:
    body = http_get(f"{progress_url}{PROGRESS_PATH}")
    return parse_progress(body) if body else None


def _scale_to(runs: Path, replicas: int) -> None:
    scaled = subprocess.run([*GRPORUN, "scale", "tiny", str(replicas), "--runs-dir", str(runs)], capture_output=True,
                            text=True, timeout=120)
    assert scaled.returncode == 0, scaled.stderr


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.vllm
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_real_run_scaled_1_2_1_trains_every_group_once_and_no_sync_waits_on_the_removed_server(
        vllm_server, tmp_path):
    # The session's server is the run's first (given with --rollout-url); `grporun local scale` starts the second
    # as a real vLLM server through the rollout entrypoint as soon as the run is up, so it loads while the learner
    # starts, then drains and stops it while the learner trains. Enough epochs that training outlasts the load.
    manifest = tiny_manifest(tmp_path, vllm_server.model, epochs=SCALED_RUN_EPOCHS)
    # The tiny model learns its task within ~500 groups; from then on most groups score alike, and dropping them
    # (no_signal) stalled a run this long before its bound. Trained instead, each still counts once.
    spec = yaml.safe_load(manifest.read_text())
    spec["spec"]["filter"]["dropNoSignal"] = False
    manifest.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    run_dir = runs / "tiny"
    process = subprocess.Popen([*GRPORUN, str(manifest), "--runs-dir", str(runs), "--rollout-url", vllm_server.url,
                                "--poll-interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=tmp_path)
    learner_log = run_dir / "logs" / "tiny-learner-0.log"
    try:
        _wait_for(lambda: SupervisorRecord.read(run_dir) is not None, "the run to start", process)
        config = json.loads((run_dir / "run.json").read_text())
        progress_url = f"http://127.0.0.1:{config['learner']['httpPort']}"
        _scale_to(runs, 2)

        def urls() -> list[str]:
            return json.loads((run_dir / "run.json").read_text())["rollout"]["urls"]

        _wait_for(lambda: len(urls()) == 2, "grporun local to add the second server to run.json", process, 60)
        second_url = urls()[1]

        def second_served() -> int:
            report = _report(progress_url)
            return next((s.samples for s in (report.rollout if report else []) if s.url == second_url), 0)

        # The second server's start: 2.5-4.5 min on the 2-core machine, far more while it is loaded.
        _wait_for(lambda: second_served() >= 16, "the second server to produce samples", process, 1500)
        before_removal = _report(progress_url)
        served = second_served()
        _scale_to(runs, 1)
        out, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0 and "phase: Succeeded" in out, out[-4000:]
    assert before_removal.groups_consumed < before_removal.groups_total  # scaled down while it trained
    assert "Scaled: rollout scaled from 1 to 2" in out and "Scaled: rollout scaled from 2 to 1" in out
    assert "Drained: tiny-rollout-1" in out and "DrainDeadlineExceeded" not in out
    report = parse_progress((run_dir / "termination-log").read_text())
    assert report.groups_consumed == report.groups_total  # the exact epoch bound
    assert report.groups_trained + report.dropped_total == report.groups_total  # each group trained (or filtered) once
    assert report.dropped[DropReason.LOST.value] == 0
    assert [server.url for server in report.rollout] == [vllm_server.url]  # the removed one left the report
    log = learner_log.read_text(errors="replace")
    left = log.rindex("\n", 0, log.index(f"rollout server {second_url} left the run's set")) + 1
    after = log[left:].splitlines()
    left_at = _logged_at(after[0])
    # A sync's line is written when it ends; one that began before the server left may have loaded it first.
    syncs_after = [line for line in after if "weight sync v" in line and "server(s)" in line
                   and _logged_at(line) - _sync_seconds(line) > left_at]
    # Every sync that began after it left went to the one server left, and none tried the removed one.
    assert syncs_after and all("to 1 server(s)" in line for line in syncs_after), syncs_after
    assert not [line for line in after if "weight sync:" in line and second_url in line]
    print(f"1->2->1: the second server produced {served} samples before its removal "
          f"(at {before_removal.groups_consumed}/{before_removal.groups_total} groups); {len(syncs_after)} syncs "
          f"after it left, all to 1 server; dropped {report.dropped}, regenerated {report.regenerated}")


#: A log record's time; tqdm's bar (written without a newline) may come before it on the same line.
LOGGED_AT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")


def _logged_at(line: str) -> float:
    """The seconds since the epoch of a learner log line (`2026-12-02 09:32:27,310 INFO ...`): its last record's."""
    return datetime.datetime.strptime(LOGGED_AT.findall(line)[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_log_lines_time_is_read_past_a_progress_bar_before_it():
    bar = "  1%|          | 116/15360 [02:11<4:03:06,  1.05it/s]"
    assert _logged_at(f"{bar}2026-12-02 09:32:27,310 INFO x: left") == _logged_at("2026-12-02 09:32:27,310 INFO x")
    later, earlier = _logged_at("2026-12-02 09:32:27,310 INFO x"), _logged_at("2026-12-02 09:32:26,300 INFO x")
    assert later - earlier == pytest.approx(1.01)


def _sync_seconds(line: str) -> float:
    """How long the sync of a `weight sync vN: ... in 0.55s` line took."""
    return float(line.rsplit(" in ", 1)[1].rstrip("s"))
