"""bench/balancer_hop.py and the parts of bench.traced_learner and bench.e2e_vs_trl it adds: layouts, rotation, the
balancer thread's CPU from the step records, a learner bound to cores, TRL's worker sent past the balancer."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from bench import balancer_hop, e2e_vs_trl
from bench.balancer_hop import HopRun, LayoutResult, balancer_cpu, render, rotation
from bench.e2e_vs_trl import Layout, Placement, RunFigures, layouts, traced_run
from bench.rollout_scaling import StepRecord, TracedRun
from bench.traced_learner import DirectRolloutPool
from grpo_trainer.rollout.server_set import ServerSet


def test_own_cores_needs_a_core_beside_the_servers():
    assert [layout.name for layout in layouts([0])] == ["shared cores"]
    shared, own = layouts([3, 1, 2])
    assert (shared.server_cores, shared.learner_cores) == (None, None)
    assert (own.server_cores, own.learner_cores) == ({1}, {2, 3})


def test_each_variant_takes_every_place_in_the_order_in_turn():
    orders = [rotation(rep) for rep in range(3)]
    assert orders[0] == ["ours", "ours-direct", "trl"]
    for place in range(3):
        assert sorted(order[place] for order in orders) == ["ours", "ours-direct", "trl"]
    assert rotation(3) == orders[0]


def step(t: float, threads: dict | None) -> str:
    return json.dumps({"t": t, "step": 1, "wait_s": 0.0, "samples": 8, "threads": threads})


def test_the_balancer_threads_cpu_is_counted_from_the_first_step_to_the_last():
    records = [StepRecord.from_json(step(1.0, {"MainThread": 1.0, "grpo-rollout-balancer": 0.25})),
               StepRecord.from_json(step(5.0, {"MainThread": 3.0, "grpo-rollout-balancer": 0.75,
                                               "native": float("nan"), "bad": "x"}))]
    assert balancer_cpu(list(reversed(records))) == pytest.approx(0.5)
    assert records[1].threads == {"MainThread": 3.0, "grpo-rollout-balancer": 0.75}  # no number, no figure
    # TRL has no balancer thread; a run without --thread-cpu records no threads at all.
    assert balancer_cpu([StepRecord.from_json(step(1.0, {"MainThread": 1.0}))]) is None
    assert balancer_cpu([StepRecord.from_json(step(1.0, None))]) is None


def figures(kind: str, wall_s: float, groups: float) -> RunFigures:
    return RunFigures(kind, wall_s, 10, groups, groups * 8, 0.1 * wall_s, 0.05 * groups, fwd_bwd_s=0.5)


def test_the_section_gives_each_variant_against_trls_median_and_the_balancers_cost_per_request():
    runs = {
        "ours": [HopRun(figures("ours", 10.0, 80), 0.4, 640.0), HopRun(figures("ours", 10.0, 100), 0.6, 800.0)],
        "ours-direct": [HopRun(figures("ours-direct", 10.0, 90), 0.01, 720.0)],
        "trl": [HopRun(figures("trl", 10.0, 100), None, 800.0)],
    }
    result = LayoutResult(Layout("own cores", frozenset({0}), frozenset({1})), runs, 1.0, 2.5)
    text = render([result], epochs=6, groups_total=96)
    rows = {cells[1]: cells for line in text.splitlines() if line.startswith("| own cores")
            for cells in [line.strip("| ").split(" | ")]}
    assert set(rows) == {"ours", "ours, TRL's worker straight at the server", "TRL"}
    ours, direct, trl = rows["ours"], rows["ours, TRL's worker straight at the server"], rows["TRL"]
    assert ours[2:7] == ["2", "1.0 → 2.5", "10.0", "9.00 (8.00–10.00)", "0.90"]  # median 9 groups/s of TRL's 10
    assert direct[6] == "0.90" and trl[6] == "1.00"
    assert ours[10:12] == ["0.50 (0.40–0.60)", "0.69 (0.62–0.75)"]  # 0.4 s / 640 and 0.6 s / 800 requests
    assert direct[10:12] == ["0.01", "—"] and trl[10:12] == ["—", "—"]
    assert "96 groups" in text


def test_a_run_with_no_balancer_thread_has_no_cost_per_request():
    assert HopRun(figures("trl", 1.0, 1), None, 8.0).balancer_ms_per_request is None
    assert HopRun(figures("ours", 1.0, 0), 0.1, 0.0).balancer_ms_per_request is None
    assert math.isclose(HopRun(figures("ours", 1.0, 1), 0.008, 8.0).balancer_ms_per_request, 1.0)


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
        traced_run(tmp_path / "run", "ours-direct", config, placement=Placement(frozenset({2, 1}), thread_cpu=True))
    command = started[0]
    assert command[:3] == ["taskset", "--cpu-list", "1,2"]
    assert command[command.index("--kind") + 1] == "ours-direct" and command[-1] == "--thread-cpu"
    with pytest.raises(RuntimeError):
        traced_run(tmp_path / "unbound", "trl", config)
    assert "taskset" not in started[1] and "--thread-cpu" not in started[1]


def test_trls_worker_is_sent_to_the_first_server_and_the_rest_of_the_pool_is_the_learners():
    pool = SimpleNamespace(servers=ServerSet(["http://a:8000", "http://b:8000"]), url="http://127.0.0.1:1",
                           transfer="the weight sync")
    direct = DirectRolloutPool(pool)
    assert direct.url == "http://a:8000"
    assert direct.transfer == "the weight sync"


def test_the_section_is_one_of_the_benchs():
    from bench.__main__ import MODULES, SECTIONS

    assert "balancer_hop" in SECTIONS and MODULES["balancer_hop"] == "balancer_hop"
    assert balancer_hop.NAME == "balancer_hop"


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
