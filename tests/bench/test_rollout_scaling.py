"""bench/rollout_scaling.py: the wait share, samples per second and 1→2→1 phases come from the step and poll records."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.rollout_scaling import (
    Poll,
    RunResult,
    ServerSeen,
    StepRecord,
    phase_windows,
    render,
    rotation,
    scale_phases,
    window_figures,
)
from bench.traced_learner import (
    GENERATED_KEY,
    GROUPS_KEY,
    PARTS,
    SAMPLES_KEY,
    STEP_KEY,
    WAIT_KEY,
    cpu_by_thread,
    step_recorder,
    time_parts,
)

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def steps(*rows: tuple[float, float, float]) -> list[StepRecord]:
    return [StepRecord(t, index + 1, wait_s, samples) for index, (t, wait_s, samples) in enumerate(rows)]


def test_the_first_step_is_never_counted():
    # Step 1 waited 30 s (start-up, the first sync); steps 2 and 3 each took 2 s, of which 1 s and 0.5 s waiting.
    figures = window_figures(steps((100.0, 30.0, 24), (102.0, 1.0, 24), (104.0, 0.5, 16)))
    assert (figures.steps, figures.seconds, figures.wait_s, figures.samples) == (2, 4.0, 1.5, 40)
    assert figures.wait_share == pytest.approx(0.375)
    assert figures.samples_per_s == pytest.approx(10.0)


def test_a_window_counts_only_steps_wholly_inside_it():
    records = steps((0.0, 9, 8), (1.0, 0.1, 8), (3.0, 1.5, 8), (4.0, 0.2, 8), (8.0, 3.0, 8))
    # [1, 4]: the intervals 1->3 and 3->4; 0->1 starts before the window, 4->8 ends after it.
    inside = window_figures(records, start=1.0, end=4.0)
    assert (inside.steps, inside.seconds, inside.wait_s, inside.samples) == (2, 3.0, 1.7, 16)


def test_records_out_of_order_are_sorted_by_time():
    ordered = steps((0.0, 5, 8), (1.0, 0.5, 8), (3.0, 1.0, 8))
    assert window_figures(list(reversed(ordered))) == window_figures(ordered)


def test_too_few_steps_give_no_rate_rather_than_a_division_error():
    figures = window_figures(steps((5.0, 1.0, 8)))
    assert figures.steps == 0 and math.isnan(figures.wait_share) and math.isnan(figures.samples_per_s)


def test_a_step_record_reads_back_what_the_traced_learner_writes(tmp_path):
    path = tmp_path / "steps.jsonl"
    recorder = step_recorder(str(path), None)
    logs = {WAIT_KEY: 0.25, SAMPLES_KEY: 24.0, GROUPS_KEY: 3.0, STEP_KEY: 1.0, GENERATED_KEY: 512.0,
            "perf/fwd_bwd_s": 0.5, "loss": 1.0}
    recorder.on_log(None, SimpleNamespace(global_step=3), SimpleNamespace(should_training_stop=False), logs=logs)
    recorder.on_log(None, SimpleNamespace(global_step=4), SimpleNamespace(should_training_stop=False),
                    logs={"loss": 1.0})  # not a step's log: no record
    (line,) = path.read_text().splitlines()
    written = StepRecord.from_json(line)
    assert (written.step, written.wait_s, written.samples, written.groups, written.fwd_bwd_s,
            written.generated_tok_s) == (3, 0.25, 24.0, 3.0, 0.5, 512.0)
    assert written.cpu_s is not None and written.cpu_s >= 0

    line = json.dumps({"t": 12.5, "step": 3, "wait_s": 0.25, "samples": 24.0, "groups": 3.0, "step_s": 1.0})
    assert StepRecord.from_json(line) == StepRecord(12.5, 3, 0.25, 24.0, 3.0)
    perf = {"perf/fwd_bwd_s": 0.5, "perf/optimizer_s": float("nan"), "perf/weight_sync_s": "0.1", "perf/x": 1}
    timed = StepRecord.from_json(json.dumps({"t": 1, "step": 2, "wait_s": 0, "samples": 8, "perf": perf,
                                             "generated_tok_s": "fast"}))
    assert (timed.fwd_bwd_s, timed.optimizer_s, timed.weight_sync_s) == (0.5, None, None)  # no number: no figure
    assert timed.generated_tok_s is None


def test_thread_cpu_names_each_python_thread_and_each_child_process():
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="bench-spinner")
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started.wait(10)
        seconds = cpu_by_thread()
    finally:
        stop.set()
        thread.join()
        child.kill()
        child.wait()
    assert {"MainThread", "bench-spinner", f"child {child.pid}"} <= seconds.keys()
    assert all(value >= 0 for value in seconds.values())


def test_each_part_counts_the_cpu_of_the_thread_that_runs_it_and_passes_calls_through():
    class Trainer:
        def training_step(self, rounds):
            return sum(range(rounds))

        def get_batch_samples(self):
            return "batch"

        def log(self, logs):
            time.sleep(0.05)  # waiting is no CPU

        def _sync_weight_merged(self):
            sum(range(2_000_000))

    trainer = Trainer()
    seconds = time_parts(trainer)
    assert trainer.training_step(4) == 6 and trainer.get_batch_samples() == "batch"
    trainer.log({})
    on_main = seconds["_sync_weight_merged"]
    worker = threading.Thread(target=trainer._sync_weight_merged)  # as ours runs the sync: on a thread of its own
    worker.start()
    worker.join()
    assert set(seconds) == set(PARTS)
    assert seconds["_sync_weight_merged"] > on_main == 0.0
    assert seconds["log"] < 0.02


def poll(t: float, **servers: tuple[str, bool, int]) -> Poll:
    urls = {"a": A, "b": B}
    return Poll(t, 0, {urls[name]: ServerSeen(*seen) for name, seen in servers.items()})


def test_scale_phases_follow_the_learners_report_of_the_second_server():
    polls = [
        poll(10, a=("serving", True, 40)),
        poll(20, a=("serving", True, 80), b=("joining", False, 0)),  # asked for at 18, not admitted yet
        poll(25, a=("serving", True, 90), b=("serving", True, 5)),
        poll(40, a=("serving", True, 150), b=("serving", True, 60)),
        poll(45, a=("serving", True, 170), b=("draining", False, 64)),  # asked to leave at 42
        poll(50, a=("serving", True, 190)),
    ]
    phases = scale_phases(polls, B, added=18, removed=42)
    assert (phases.serving, phases.gone, phases.samples_while_there) == (25, 50, 64)
    assert phase_windows(phases, first=5, last=70) == [
        ("1 server, before", 5, 18), ("2 servers", 25, 42), ("1 server, after", 50, 70)]


def test_a_second_server_never_admitted_leaves_out_the_phases_it_would_start():
    polls = [poll(20, a=("serving", True, 80), b=("joining", False, 0)), poll(45, a=("serving", True, 170))]
    phases = scale_phases(polls, B, added=18, removed=42)
    assert phases.serving is None and phases.samples_while_there == 0
    assert [label for label, _, _ in phase_windows(phases, first=5, last=70)] == [
        "1 server, before", "1 server, after"]


def test_each_repetition_rotates_the_rows_and_keeps_trls_run_after_ours_on_one_server():
    orders = [rotation(rep) for rep in range(3)]
    assert orders == [["1", "trl", "2", "121"], ["2", "121", "1", "trl"], ["121", "1", "trl", "2"]]


def _report(consumed: int, samples: dict[str, int]):
    rollout = [SimpleNamespace(url=url, samples=count) for url, count in samples.items()]
    return SimpleNamespace(groups_consumed=consumed, groups_total=96, groups_trained=consumed, dropped_total=0,
                           rollout=rollout)


def test_the_section_shows_each_rows_median_and_spread_over_its_runs_and_each_phase_over_the_scaled_runs():
    # Ours on one server: 10 steps of 2 s (then 4 s), waiting 1 s each, 20 samples a step; two runs.
    def run(step_s: float, samples: dict[str, int], **fields) -> RunResult:
        records = steps(*[(index * step_s, 1.0, 20) for index in range(11)])
        return RunResult("r", records, final=_report(96, samples), server_cpu_s={A: step_s * 10, B: step_s},
                         training_wall_s=step_s * 10 * 2, **fields)

    polls = [poll(3, a=("serving", True, 10)), poll(6, a=("serving", True, 30), b=("serving", True, 2)),
             poll(13, a=("serving", True, 80), b=("serving", True, 40)), poll(16, a=("serving", True, 90))]
    scaled = [run(2.0, {A: 500}, polls=polls, added=5.0, removed=12.0),
              run(2.0, {A: 480}, polls=polls[:1], added=None, removed=None)]  # ended before the bench scaled it
    results = {"1": [run(2.0, {A: 834}), run(4.0, {A: 834})], "2": [run(2.0, {A: 502, B: 468})],
               "121": scaled, "trl": [run(2.0, {}), run(2.0, {})]}
    config = SimpleNamespace(training=SimpleNamespace(num_generations=8, max_completion_length=16, token_budget=512,
                                                      extra_args={"max_inflight_tasks": 16}))
    text = render(config, results, A, B, 60.0, (1.0, 2.0))
    assert ("| ours, 1 server | 2 | 10 | 30.0 (20.0–40.0) | 38 % (25–50) | 7.5 (5.0–10.0) | 96/96 / 96 / 0 | 834 "
            "|") in text
    assert "| ours, 2 servers | 1 | 10 | 20.0 | 50 % | 10.0 | 96/96 / 96 / 0 | 502 / 468 |" in text
    assert ("| ours, 1→2→1 (whole run) | 2 | 10 | 20.0 | 50 % | 10.0 | 96/96 / 96 / 0 | 500 / left; 480 / left "
            "|") in text
    assert "| TRL AsyncGRPOTrainer, 1 server | 2 | 10 | 20.0 | 50 % | 10.0 | — / 0 / — (its own count) | — |" in text
    assert "| 0.50 / 0.05 |" in text  # the servers' CPU, cores: A half, B a twentieth of each run
    assert "over the 1 run scaled twice (1 ended before the second change)" in text
    assert "serving: 1.0 s; removed → gone from the learner's report: 4.0 s; completions it served while it was " \
           "there: 40." in text
    assert "| 2 servers | 1 | 3 | 6.0 | 50 % | 10.0 |" in text  # steps from 6 to 12 s
    assert "(96 groups)" in text and "3 runs of each row" in text


def test_both_servers_are_spawned_on_the_calling_thread_and_stopped_with_the_section(tmp_path, monkeypatch):
    # A server dies with the thread that spawned it (PR_SET_PDEATHSIG follows the thread): spawned from a pool
    # thread, both servers were stopped as the pool shut down, before the first run.
    from bench import rollout_scaling
    from tests.support.servers import vllm_server

    spawned, stopped = [], []

    class Server:
        def __init__(self, command, **kwargs):
            spawned.append((threading.current_thread(), kwargs["env"]["VLLM_CPU_OMP_THREADS_BIND"]))
            self.pid = 1000 + len(spawned)

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(vllm_server, "require_rollout_python", lambda: Path(sys.executable))
    monkeypatch.setattr(vllm_server.subprocess, "Popen", Server)
    monkeypatch.setattr(vllm_server.requests, "get", lambda url, timeout: SimpleNamespace(status_code=200))
    monkeypatch.setattr(vllm_server.os, "killpg", lambda pid, sig: stopped.append((pid, sig)))
    config = SimpleNamespace(model="m", model_dump_json=lambda by_alias: "{}")
    with rollout_scaling.two_servers(config, tmp_path) as servers:
        assert [thread for thread, _ in spawned] == [threading.main_thread()] * 2
        assert [core for _, core in spawned][0] == "0" and len({s.server.url for s in servers}) == 2
        assert not stopped
    assert sorted({pid for pid, _ in stopped}) == [1001, 1002]
