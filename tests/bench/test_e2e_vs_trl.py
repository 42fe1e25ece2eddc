"""bench/e2e_vs_trl.py: each run's figures from its own step records and report, ours/TRL ratios, their rendering."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest

from bench import e2e_vs_trl
from bench.e2e_vs_trl import (
    SHARED,
    Layout,
    Pair,
    Placement,
    RowKind,
    RowPlan,
    RowResult,
    RunFigures,
    add_arguments,
    bound_to,
    layouts,
    options,
    pair_ratios,
    render,
    run_figures,
    run_row,
    traced_run,
)
from bench.rollout_scaling import StepRecord, TracedRun
from grpo_trainer.contract.report import ProgressReport


def record(t: float, step: int, wait_s: float, samples: float, groups: float, cpu_s: float | None) -> StepRecord:
    return StepRecord(t, step, wait_s, samples, groups, cpu_s)


def test_a_runs_figures_count_the_steps_after_the_first():
    # Step 1 (start-up in its wait) trained 3 groups; steps 2 and 3 trained 5 groups of 8 in 10 s, waiting 2 s.
    records = [record(100.0, 1, 40.0, 24, 3, 50.0), record(104.0, 2, 0.5, 16, 2, 54.0),
               record(110.0, 3, 1.5, 24, 3, 60.0)]
    trl = run_figures("trl", records)
    assert (trl.wall_s, trl.steps, trl.groups, trl.samples, trl.wait_s, trl.cpu_s) == (10.0, 2, 5, 40, 2.0, 10.0)
    assert (trl.groups_per_s, trl.samples_per_s, trl.wait_share, trl.cpu_s_per_group) == (0.5, 4.0, 0.2, 2.0)
    assert trl.dropped_groups == 0


def test_ours_consumes_the_groups_its_steps_began_and_those_its_report_dropped():
    records = [record(0.0, 1, 9.0, 24, 3, 1.0), record(5.0, 2, 0.0, 24, 3, 11.0)]
    final = ProgressReport(groups_total=16, groups_consumed=16, groups_trained=6,
                           dropped={"no_signal": 9, "stale": 1})
    ours = run_figures("ours", records, final, num_generations=8)
    assert ours.groups == 13  # the second step's 3, and 10 dropped
    assert (ours.dropped_groups, ours.no_signal_groups, ours.dropped_samples) == (10, 9, 80)
    assert ours.samples_per_s == pytest.approx(24 / 5)
    assert ours.samples_with_dropped_per_s == pytest.approx((24 + 80) / 5)
    assert ours.cpu_s_per_group == pytest.approx(10 / 13)


def test_the_steps_after_the_last_group_begun_are_outside_the_time_groups_per_s_is_taken_over():
    # Ours' epoch ends with a step that trains the last groups' remaining samples and begins none: TRL stops before
    # it, with those samples in its queue. The same groups in the same time are the same groups per s.
    trl_records = [record(0.0, 1, 1.0, 24, 3, 1.0), record(4.0, 2, 0.0, 24, 3, 5.0), record(8.0, 3, 0.0, 24, 3, 9.0)]
    ours_records = [*trl_records, record(10.0, 4, 0.0, 20, 0, 11.0)]
    trl, ours = run_figures("trl", trl_records), run_figures("ours", ours_records, ProgressReport())
    assert (trl.span_s, trl.tail_steps) == (8.0, 0)
    assert (ours.span_s, ours.tail_steps, ours.wall_s, ours.steps) == (8.0, 1, 10.0, 3)
    assert ours.groups == trl.groups == 6
    assert pair_ratios(ours, trl)["groups_per_s"] == pytest.approx(1.0)
    # Samples and CPU cover the whole run: the tail's samples were trained, in its time, on its CPU.
    assert ours.samples_per_s == pytest.approx(68 / 10) and ours.cpu_s_per_group == pytest.approx(10 / 6)
    # A run whose only group-beginning step is the first keeps its second step in the span.
    assert run_figures("trl", [record(0.0, 1, 1.0, 24, 3, 1.0), record(2.0, 2, 0.0, 8, 0, 2.0)]).span_s == 2.0


def test_a_runs_step_time_is_split_into_trls_own_parts_and_the_rest():
    # Steps 2 and 3 (10 s): 6 s forward and backward, 1 s optimizer, 1 s weight sync, 0.5 s waiting: 1.5 s the rest.
    records = [StepRecord(100.0, 1, 40.0, 24, 3, 50.0, 0.5, 0.1, 0.2),
               StepRecord(104.0, 2, 0.5, 16, 2, 54.0, 2.5, 0.5, 0.5),
               StepRecord(110.0, 3, 0.0, 24, 3, 60.0, 3.5, 0.5, 0.5)]
    run = run_figures("trl", records)
    assert (run.fwd_bwd_s, run.optimizer_s, run.weight_sync_s) == (6.0, 1.0, 1.0)
    assert [run.ms_per_step(part) for _, part in e2e_vs_trl.STEP_PARTS] == [3000, 500, 500, 250, 750]
    assert run.cpu_ms_per_sample == pytest.approx(1000 * 10 / 40)
    # A step that did not log a part leaves that part, and the rest, without a figure.
    unlogged = run_figures("trl", [*records[:2], StepRecord(110.0, 3, 0.0, 24, 3, 60.0, None, 0.5, 0.5)])
    assert math.isnan(unlogged.ms_per_step("fwd_bwd_s")) and math.isnan(unlogged.ms_per_step("other_s"))
    assert unlogged.ms_per_step("optimizer_s") == 500


def test_a_runs_cpu_by_part_is_each_parts_and_childs_growth_and_the_rest_of_the_process():
    def timed(t, step, cpu_s, training_step, sync, child):
        return StepRecord(t, step, 0.0, 24, 3, cpu_s, parts={"training_step": training_step, "log": 0.1,
                                                             "_sync_weight_merged": sync, "not a part": 9.0},
                          threads={"MainThread": 9.0, "child 41": child, "grpo-rollout-supervisor": 0.5})

    # 6 groups after the first step: 3.0 CPU s, 1.2 of them training, 0.3 syncing, 0.9 in the child, 0.6 the rest.
    ours = run_figures("ours", [timed(0.0, 1, 10.0, 2.0, 0.5, 4.0), timed(2.0, 2, 11.5, 2.6, 0.65, 4.5),
                                timed(4.0, 3, 13.0, 3.2, 0.8, 4.9)])
    assert ours.cpu_by_part == pytest.approx({"training_step": 1.2, "get_batch_samples": 0.0, "log": 0.0,
                                              "_sync_weight_merged": 0.3, "children": 0.9, "rest": 0.6})
    assert ours.cpu_ms_per_group("training_step") == pytest.approx(200.0)
    assert math.isnan(run_figures("trl", [record(0.0, 1, 0, 24, 3, 1.0), record(1.0, 2, 0, 24, 3, 2.0)])
                      .cpu_ms_per_group("training_step"))  # recorded without --thread-cpu


def test_the_section_shows_where_each_sides_cpu_went_when_the_runs_recorded_it():
    parts = {"training_step": 10.0, "get_batch_samples": 1.0, "log": 0.5, "_sync_weight_merged": 2.0,
             "children": 4.0, "rest": 2.5}
    ours = dataclasses.replace(figures("ours", 20.0, 20, 300, 40.0), cpu_by_part=parts)
    trl = dataclasses.replace(figures("trl", 20.0, 20, 300, 20.0), cpu_by_part={**parts, "rest": 0.5})
    text = render([RowResult("learner-bound", RowKind(), [Pair(ours, trl, True)], 1.5, 2.5, 300.0)], epochs=6,
                  groups_total=96, generations=8, max_completion_length=16, cores=2)
    cpu = text.split("Where each side's CPU went")[1].split("Per pair")[0]
    # 20 groups: 500 ms per group of training step, 125 of the rest in ours and 25 in TRL's.
    assert "| learner-bound | ours | 2.000 | 500.00 | 50.00 | 25.00 | 100.00 | 200.00 | 125.00 |" in cpu
    assert "| learner-bound | TRL | 1.000 | 500.00 | 50.00 | 25.00 | 100.00 | 200.00 | 25.00 |" in cpu


def test_the_servers_pace_is_the_median_of_the_completion_tokens_per_s_the_steps_after_the_first_logged():
    def logged(t, step, tokens_per_s):
        return dataclasses.replace(record(t, step, 0.0, 24, 3, None), generated_tok_s=tokens_per_s)

    ours = run_figures("ours", [logged(0.0, 1, 9000.0), logged(1.0, 2, 400.0), logged(2.0, 3, None),
                                logged(3.0, 4, 600.0), logged(4.0, 5, 500.0)])
    assert ours.generated_tok_s == 500.0  # the first step's (start-up) and a step that logged none left out
    trl = run_figures("trl", [logged(0.0, 1, None), logged(1.0, 2, 1000.0), logged(2.0, 3, 1000.0)])
    assert pair_ratios(ours, trl)["generated_tok_s"] == 0.5
    assert math.isnan(run_figures("trl", [record(0.0, 1, 0, 24, 3, None), record(1.0, 2, 0, 24, 3, None)])
                      .generated_tok_s)
    text = render([RowResult("generation-bound", RowKind(2), [Pair(ours, trl, True)], 1.5, 2.5, 300.0)], epochs=6,
                  groups_total=96, generations=8, max_completion_length=16, cores=2)
    ratio_table = text.split("Ratios ours / TRL")[1].split("Each side's")[0]
    assert ratio_table.splitlines()[2].endswith("| completion tokens generated per s |")
    assert ratio_table.splitlines()[4].endswith("| 0.50 |")
    sides = text.split("Each side's")[1].split("Where each side's")[0]
    assert "| 0 (0) | 500 |" in sides and "| — (trains all) | 1000 |" in sides


def test_a_run_without_cpu_records_has_no_cpu_figure_and_one_step_has_no_figures():
    records = [record(0.0, 1, 1.0, 8, 1, None), record(2.0, 2, 0.0, 8, 1, None)]
    assert math.isnan(run_figures("trl", records).cpu_s_per_group)
    with pytest.raises(ValueError, match="1 steps recorded"):
        run_figures("trl", records[:1])


def figures(kind: str, wall_s: float, groups: float, samples: float, cpu_s: float, dropped: int = 0,
            no_signal: int = 0) -> RunFigures:
    return RunFigures(kind, wall_s, 10, groups, samples, wall_s / 10, cpu_s, dropped, no_signal, dropped * 8)


def test_ratios_are_ours_over_trl_and_trl_trains_what_ours_would_drop():
    ours = figures("ours", 10.0, 20, 100, 10.0, dropped=5)
    trl = figures("trl", 20.0, 20, 300, 40.0)
    ratios = pair_ratios(ours, trl)
    assert ratios["groups_per_s"] == pytest.approx(2.0)  # twice as fast through the same groups
    assert ratios["samples_per_s"] == pytest.approx(10 / 15)  # it trained fewer samples, ...
    assert ratios["samples_with_dropped_per_s"] == pytest.approx(14 / 15)  # ... 40 of them dropped
    assert ratios["cpu_s_per_group"] == pytest.approx(0.5 / 2.0)


def test_useful_samples_leave_out_those_trained_without_signal_counted_as_the_trainer_took_them():
    # TRL took 60 no-signal samples into its batches over steps 2 and 3 (its count was 40 after step 1).
    trl_records = [StepRecord(0.0, 1, 1.0, 24, 3, 1.0, no_signal=40), StepRecord(5.0, 2, 0.0, 48, 6, 6.0, no_signal=72),
                   StepRecord(10.0, 3, 0.0, 48, 6, 11.0, no_signal=100)]
    trl = run_figures("trl", trl_records)
    assert trl.no_signal_samples == 60 and trl.useful_samples_per_s == pytest.approx((96 - 60) / 10)
    # Ours dropped those groups before its batch: it trained none of them, in less time.
    ours = run_figures("ours", [StepRecord(0.0, 1, 1.0, 24, 3, 1.0), StepRecord(6.0, 2, 0.0, 48, 6, 6.0)],
                       ProgressReport(dropped={"no_signal": 6}), num_generations=8)
    assert ours.no_signal_samples == 0 and ours.groups == 12
    assert pair_ratios(ours, trl)["useful_samples_per_s"] == pytest.approx(8.0 / 3.6)
    assert StepRecord.from_json('{"t": 1, "step": 2, "wait_s": 0, "samples": 8, "no_signal": 16}').no_signal == 16


def test_the_no_signal_rows_task_has_no_signal_on_every_other_prompt_and_the_rest_is_the_examples(
        tmp_path, monkeypatch, tiny_model_dir):
    from bench import rollout_scaling
    from bench.no_signal import REWARD_FUNCTION, SIGNAL_COLUMN, reward, write_prompts
    from grpo_trainer.learner.rewards import letter_a_fraction, load_rewards

    # examples/tiny.yaml as `make demo` lays it out, its model the tests' cached tiny one.
    examples = tmp_path / "examples"
    (examples / "tiny-assets").mkdir(parents=True)
    (examples / "tiny-assets" / "model").symlink_to(tiny_model_dir)
    for name in ("tiny.yaml", "tiny-prompts.jsonl"):
        (examples / name).write_text((rollout_scaling.MANIFEST.parent / name).read_text())
    monkeypatch.setattr(rollout_scaling, "MANIFEST", examples / "tiny.yaml")

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"prompt": "say {word}"}}\n' for word in ("apple", "banana", "cat", "dog")))
    assert write_prompts(source, tmp_path / "out.jsonl") == 0.5
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row[SIGNAL_COLUMN] for row in rows] == [False, True, False, True] and rows[1]["prompt"] == "say banana"
    completions = ["aaa", "abc", "xyz"]
    assert reward(completions, signal=[False] * 3) == [0.0, 0.0, 0.0]  # every completion alike: no signal
    assert reward(completions, signal=[True] * 3) == letter_a_fraction(completions)
    config = e2e_vs_trl.row_config(tmp_path / "row", RowKind(no_signal=True), epochs=1)
    assert config.dataset.path == str(tmp_path / "row" / "no-signal-prompts.jsonl")
    assert [r.function for r in config.rewards] == [REWARD_FUNCTION]
    assert load_rewards(config.rewards)[0](completions=completions, signal=[False] * 3) == [0.0, 0.0, 0.0]


def test_a_ratio_without_a_figure_is_nan_not_an_error():
    ours = RunFigures("ours", 10.0, 3, 6, 48, 1.0, None)
    ratios = pair_ratios(ours, RunFigures("trl", 0.0, 0, 0, 0, 0.0, None))
    assert all(math.isnan(value) for value in ratios.values())


def test_the_section_shows_each_rows_median_and_spread_of_the_ratios_and_its_load():
    # TRL: 1 group and 15 samples per s, 2 CPU s per group. Ours: the same groups and CPU in 10, 20 and 40 s,
    # training half TRL's samples and dropping 4, 6 and 8 groups of 8.
    trl = figures("trl", 20.0, 20, 300, 40.0)
    pairs = [Pair(figures("ours", wall, 20, 150, 40.0, dropped, dropped - 1), trl, index % 2 == 0)
             for index, (wall, dropped) in enumerate([(10.0, 4), (20.0, 6), (40.0, 8)])]
    rows = [RowResult("learner-bound", RowKind(), pairs, 1.5, 2.5, 300.0),
            RowResult("generation-bound", RowKind(2), pairs[:1], 3.0, 4.0, 250.0)]
    text = render(rows, epochs=6, groups_total=96, generations=8, max_completion_length=16, cores=2)
    ratio_table = text.split("Ratios ours / TRL")[1].split("Each side's")[0]
    # groups per s 2, 1, 0.5; samples 1, 0.5, 0.25; with drops (150 + 32|48|64) / wall / 15: 1.21, 0.66, 0.36
    # CPU per sample trained: ours 40 CPU s for 150 samples, TRL for 300: twice TRL's.
    assert ("| learner-bound | uncapped | 3 | 1.5 → 2.5 | 1.00 (0.50–2.00) | 0.50 (0.25–1.00) | 0.50 (0.25–1.00) "
            "| 0.66 (0.36–1.21) | 1.00 | 2.00 |") in ratio_table
    assert ("| generation-bound | `--max-num-seqs 2` | 1 | 3.0 → 4.0 | 2.00 | 1.00 | 1.00 | 1.21 | 1.00 | 2.00 |"
            in ratio_table)
    sides = text.split("Each side's")[1].split("Where each side's")[0]
    assert ("| learner-bound | ours | 3 | 20.0 (10.0–40.0) | 1.00 (0.50–2.00) | 7.5 (3.8–15.0) | 7.5 (3.8–15.0) "
            "| 0 |") in sides
    assert "| 2.000 | 266.67 | 6 (4–8) (5 (3–7)) |" in sides  # CPU per group and sample; drops, no-signal among them
    assert ("| learner-bound | TRL | 3 | 20.0 | 1.00 | 15.0 | 15.0 | 0 | 10 % | 2.000 | 133.33 | — (trains all) |"
            in sides)
    per_pair = text.split("Per pair")[1]
    assert ("| learner-bound | 2 | TRL, ours | 20.0 / 20.0 | 1.00 | 0.50 | 0.50 | 0.66 | 1.00 | 2.00 | n/a | 6 (5) |"
            in per_pair)  # no completion tokens logged: no ratio
    steps = text.split("Where each side's")[1].split("Per pair")[0]
    # These figures log no step parts: only the wait (a tenth of the wall time) is known, per step of 10.
    assert "| learner-bound | TRL | 10 | 0 | 300 | n/a | n/a | n/a | 200 | n/a |" in steps
    assert "6 epochs (96 groups)" in text and "on 2 cores" in text
    assert "CPU went" not in text  # recorded without --thread-cpu: no CPU by part
    assert "learner-bound 300 s, generation-bound 250 s" in text


@pytest.mark.parametrize(("argv", "wrong"), [
    (["--rows", "learner-bound,fast"], "--rows: unknown row 'fast'"),
    (["--rows", ","], "--rows: name at least one row"),
    (["--pairs", "0"], "--pairs: must be at least 1"),
    (["--epochs", "0"], "--epochs: must be at least 1"),
])
def test_a_wrong_option_is_named(argv, wrong):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=wrong):
        options(parser.parse_args(argv))


def test_the_options_default_to_every_row():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options(parser.parse_args([])) == {"pairs": None, "epochs": 6, "rows": ("learner-bound",
                                                                                    "generation-bound", "no-signal"),
                                              "profile": None, "keep": None, "layout": SHARED,
                                              "thread_cpu": False}


def test_own_cores_puts_the_server_on_the_first_core_and_the_learners_on_the_rest(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setattr(e2e_vs_trl.os, "sched_getaffinity", lambda _pid: {3, 1, 2})
    layout = options(parser.parse_args(["--layout", "own-cores"]))["layout"]
    assert (layout.name, layout.server_cores, layout.learner_cores) == ("own cores", {1}, {2, 3})
    monkeypatch.setattr(e2e_vs_trl.os, "sched_getaffinity", lambda _pid: {0})
    with pytest.raises(ValueError, match="--layout own-cores: needs a core beside the server's; this process has 1"):
        options(parser.parse_args(["--layout", "own-cores"]))


def test_bound_to_binds_this_process_meanwhile_and_restores_it():
    before = os.sched_getaffinity(0)
    first = frozenset({min(before)})
    with bound_to(first):
        assert os.sched_getaffinity(0) == first
    assert os.sched_getaffinity(0) == before
    with bound_to(None):
        assert os.sched_getaffinity(0) == before


def test_a_rows_server_starts_bound_to_its_layouts_cores_and_each_learner_runs_on_the_others(tmp_path, monkeypatch):
    events = []

    @contextlib.contextmanager
    def recording_bound_to(cores):
        events.append(("bound", cores))
        yield
        events.append(("unbound", cores))

    def start_server(stack, config, directory):
        events.append(("server",))
        return SimpleNamespace(server=SimpleNamespace(url="http://127.0.0.1:1"))

    def run(directory, kind, config, profile, keep, placement):
        events.append(("run", kind, placement.cores))
        return [record(100.0, 1, 1.0, 24, 3, 1.0), record(110.0, 2, 1.0, 24, 3, 2.0)], None

    config = SimpleNamespace(rollout=SimpleNamespace(urls=[]), training=SimpleNamespace(num_generations=8))
    monkeypatch.setattr(e2e_vs_trl, "base_config", lambda directory, epochs, max_num_seqs: config)
    monkeypatch.setattr(e2e_vs_trl, "bound_to", recording_bound_to)
    monkeypatch.setattr(e2e_vs_trl, "start_row_server", start_server)
    monkeypatch.setattr(e2e_vs_trl, "traced_run", run)
    monkeypatch.setattr("tests.support.servers.vllm_server.restore_model_weights", lambda server, directory: None)
    own = Layout("own cores", frozenset({0}), frozenset({1}))
    row, _, _ = run_row(tmp_path, "generation-bound", RowKind(2), RowPlan(pairs=2, epochs=1, layout=own))
    assert events == [("bound", {0}), ("server",), ("unbound", {0}),
                      ("run", "ours", {1}), ("run", "trl", {1}), ("run", "trl", {1}), ("run", "ours", {1})]
    assert config.rollout.urls == ["http://127.0.0.1:1"] and len(row.pairs) == 2
    text = render([row], epochs=1, groups_total=None, generations=8, max_completion_length=16, cores=2, layout=own)
    assert "every process of the server on core 0, the learner on core 1 (own cores)" in text
    shared = render([row], epochs=1, groups_total=None, generations=8, max_completion_length=16, cores=2)
    assert "the server's OpenMP worker bound to core 0, the learner wherever the scheduler puts it" in shared


def test_profiling_without_py_spy_is_refused_with_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(e2e_vs_trl, "py_spy", lambda: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--profile: py-spy is not installed"):
        options(parser.parse_args(["--profile", str(tmp_path)]))


def test_own_cores_needs_a_core_beside_the_servers():
    assert [layout.name for layout in layouts([0])] == ["shared cores"]
    shared, own = layouts([3, 1, 2])
    assert (shared.server_cores, shared.learner_cores) == (None, None)
    assert (own.server_cores, own.learner_cores) == ({1}, {2, 3})


def test_a_learner_bound_to_cores_is_started_under_taskset_with_its_threads_cpu_recorded(tmp_path, monkeypatch):
    started = []

    class NoLearner:
        returncode = 3

        def __init__(self, command, **_):
            started.append(command)
            self.pid = -1

        def wait(self, timeout=None):
            return self.returncode

        def poll(self):
            return self.returncode

    def lay_out(directory, kind, config):  # the run's folder and command, without a model or a run config
        directory.mkdir(parents=True)
        command = ["python", "-m", "bench.traced_learner", "--kind", kind, "--records", str(directory / "steps.jsonl")]
        return TracedRun(config, directory / "run.json", directory / "steps.jsonl", command, {})

    monkeypatch.setattr(e2e_vs_trl.subprocess, "Popen", NoLearner)
    monkeypatch.setattr(e2e_vs_trl, "lay_out_traced_run", lay_out)
    config = None
    with pytest.raises(RuntimeError, match="exit 3, 0 steps recorded"):
        traced_run(tmp_path / "run", "ours", config, placement=Placement(frozenset({2, 1}), thread_cpu=True))
    command = started[0]
    assert command[:3] == ["taskset", "--cpu-list", "1,2"]
    assert command[command.index("--kind") + 1] == "ours" and command[-1] == "--thread-cpu"
    with pytest.raises(RuntimeError):
        traced_run(tmp_path / "unbound", "trl", config)
    assert "taskset" not in started[1] and "--thread-cpu" not in started[1]


def test_a_section_that_starts_servers_needs_the_rollout_venv_and_builds_the_tiny_model_once(tmp_path, monkeypatch):
    from bench import rollout_scaling
    from bench.report import SectionUnavailable
    from grpo_trainer.testing import tiny_assets

    monkeypatch.setattr(rollout_scaling, "ROOT", tmp_path)
    with pytest.raises(SectionUnavailable, match=r"\.venv-rollout .* `make setup-rollout` builds it"):
        rollout_scaling.require_rollout_assets()
    (tmp_path / ".venv-rollout" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-rollout" / "bin" / "python").touch()
    built = []

    def build(directory):
        built.append(directory)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_assets, "build_tiny_model", build)
    rollout_scaling.require_rollout_assets()
    rollout_scaling.require_rollout_assets()
    assert built == [tmp_path / "examples" / "tiny-assets" / "model"]
