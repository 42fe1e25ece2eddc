"""The learner's observability: /progress and /metrics from a real training run, the termination message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from functools import partial

import pytest
from prometheus_client.parser import text_string_to_metric_families

from grpo_trainer.contract.codes import (
    DROP_REASONS,
    MASK_REASONS,
    METRICS_PATH,
    PROGRESS_PATH,
    TERMINATION_MESSAGE_MAX_BYTES,
    LearnerPhase,
)
from grpo_trainer.contract.config import WEIGHT_SYNC_DEADLINE_SECONDS, RunConfig
from grpo_trainer.contract.metrics import (
    EPISODE_METRIC_NAMES,
    LEARNER_METRIC_NAMES,
    METRIC_ATTENTION_KERNEL,
    METRIC_ENVIRONMENT_FAILURES,
    METRIC_EPISODES_FORKED,
    METRIC_GLOBAL_STEP,
    METRIC_GROUPS_COLLATED,
    METRIC_GROUPS_CONSUMED,
    METRIC_GROUPS_DROPPED,
    METRIC_GROUPS_REGENERATED,
    METRIC_GROUPS_REGENERATED_ENVIRONMENT,
    METRIC_GROUPS_RETURNED,
    METRIC_GROUPS_TOTAL,
    METRIC_GROUPS_TRAINED,
    METRIC_LAST_TRAINED,
    METRIC_REPLICA_FAILURES,
    METRIC_REPLICA_READY,
    METRIC_REPLICA_SAMPLES,
    METRIC_REPLICA_VERSION_LAG,
    METRIC_REPLICA_WEIGHT_VERSION,
    METRIC_ROLLOUT_QUEUE_SAMPLES,
    METRIC_ROLLOUT_WAIT_SECONDS,
    METRIC_SAMPLES_MASKED,
    METRIC_SAMPLES_SCORED,
    METRIC_STALL_LIMIT,
    METRIC_STALL_STREAK,
    METRIC_STALLED,
    METRIC_STEP_CLIP_RATIO,
    METRIC_STEP_COMPLETION_TOKENS_MAX,
    METRIC_STEP_COMPLETION_TOKENS_MEAN,
    METRIC_STEP_ENTROPY,
    METRIC_STEP_GRAD_NORM,
    METRIC_STEP_KL,
    METRIC_STEP_LEARNING_RATE,
    METRIC_STEP_LOSS,
    METRIC_STEP_STALENESS_MAX,
    METRIC_STEP_STALENESS_MEAN,
    METRIC_TOOL_CALLS,
    METRIC_WEIGHT_SYNC_DEADLINE,
    METRIC_WEIGHT_SYNC_LAST_SECONDS,
    METRIC_WEIGHT_SYNC_RUNNING_SECONDS,
    METRIC_WEIGHT_SYNC_SECONDS,
    METRIC_WEIGHT_SYNCS,
    STEP_METRIC_NAMES,
)
from grpo_trainer.contract.report import EpisodeReport, ProgressReport, TrackedRunReport, parse_progress
from grpo_trainer.learner.exporter import ProgressServer, StepMetrics, render_metrics, write_termination_message


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (the test's own http:// URL)
        return response.read().decode()


def samples_by_name(text: str) -> dict[str, list]:
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A real GRPOLearner run (scripted rollouts, a third without signal) with its progress server, polled while
    it trains, reporting to TensorBoard as spec.tracking.tensorboard makes it."""
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from grpo_trainer.learner.tracking import configure, parameters_callback
    from grpo_trainer.learner.trainer import GRPOLearner, LearnerReporting
    from grpo_trainer.testing.scripted_worker import (
        GroupScript,
        NoWeightTransfer,
        SampleShape,
        ScriptedRolloutWorker,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = 9
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"p{i}"}] for i in range(prompts)]})
    script = GroupScript(reward=lambda p, k: 0.0 if p % 3 == 0 else float(k % 2))
    worker = ScriptedRolloutWorker(dataset_size=prompts, num_generations=4, script=script,
                                   shape=SampleShape(vocab_size=len(tokenizer)), delay_s=0.05)
    out = tmp_path_factory.mktemp("metrics-run")
    run_config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "runName": "metrics", "outputDir": str(out), "tracking": {"tensorboard": {}}})
    saved_env = dict(os.environ)
    trackers = configure(run_config)  # sets TENSORBOARD_LOGGING_DIR, as the learner does
    args = AsyncGRPOConfig(output_dir=str(out), use_cpu=True, dtype="float32", report_to=trackers.trackers,
                           num_generations=4, per_device_train_batch_size=4, token_budget=0, save_strategy="no",
                           num_train_epochs=1,
                           disable_tqdm=True, max_staleness=1000)
    # As learner_main wires it: the trackers' runs go on /progress.
    reporting = LearnerReporting(server_port=0, tracking=partial(parameters_callback, run_config, trackers))
    trainer = GRPOLearner(tiny_model_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                          rollout_worker=worker, weight_transfer=NoWeightTransfer(), reporting=reporting)
    os.environ.clear()
    os.environ.update(saved_env)
    seen: list[dict] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(json.loads(fetch(trainer.progress_url + PROGRESS_PATH)))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    trainer.train()
    done.set()
    poller.join()
    yield trainer, seen, run_config
    trainer.close()


@pytest.mark.slow
def test_progress_is_visible_while_training_and_validates(finished_run):
    trainer, seen, _ = finished_run
    reports = [ProgressReport.model_validate(body) for body in seen]
    phases = [r.phase for r in reports]
    assert LearnerPhase.RUNNING in phases
    consumed = [r.groups_consumed for r in reports]
    assert consumed == sorted(consumed), "progress must never go backwards"
    final = parse_progress(fetch(trainer.progress_url + PROGRESS_PATH))
    assert final.phase == LearnerPhase.SUCCEEDED and final.groups_consumed == final.groups_total == 9
    assert final.dropped["no_signal"] == 3 and final.groups_trained == 6 and final.last_trained_time is not None


@pytest.mark.slow
def test_metrics_parse_and_match_progress(finished_run):
    trainer, _, _ = finished_run
    text = fetch(trainer.progress_url + METRICS_PATH)
    found = samples_by_name(text)
    assert found[METRIC_GROUPS_CONSUMED][0].value == 9
    assert found[METRIC_GROUPS_TRAINED][0].value == 6
    # Collated minus returned is the trained count (the stop discarded no window here: nothing returned).
    assert found[METRIC_GROUPS_COLLATED][0].value - found[METRIC_GROUPS_RETURNED][0].value == 6
    assert found[METRIC_GROUPS_TOTAL][0].value == 9
    dropped = {s.labels["reason"]: s.value for s in found[METRIC_GROUPS_DROPPED]}
    assert dropped == {reason: (3 if reason == "no_signal" else 0) for reason in DROP_REASONS}
    assert found[METRIC_STALLED][0].value == 0
    assert found[METRIC_STALL_LIMIT][0].value == 9
    # Every sync timed: the cold one and one per step (weightSyncSteps 1), none running once the run ended.
    syncs = found[METRIC_WEIGHT_SYNCS][0].value
    assert syncs == found[METRIC_GLOBAL_STEP][0].value + 1
    assert found[METRIC_WEIGHT_SYNC_SECONDS][0].value >= found[METRIC_WEIGHT_SYNC_LAST_SECONDS][0].value > 0
    assert found[METRIC_WEIGHT_SYNC_RUNNING_SECONDS][0].value == 0
    assert found[METRIC_WEIGHT_SYNC_DEADLINE][0].value == WEIGHT_SYNC_DEADLINE_SECONDS
    # The training step scored every trained sample (6 groups of 4, and the overflow that filled the last step).
    assert found[METRIC_SAMPLES_SCORED][0].value >= 6 * 4
    assert {s.labels["reason"]: s.value for s in found[METRIC_SAMPLES_MASKED]} == dict.fromkeys(MASK_REASONS, 0)
    # The scripted worker generates slower than the tiny model trains: the learner waited, and said so.
    assert found[METRIC_ROLLOUT_WAIT_SECONDS][0].value > 0
    assert found[METRIC_ROLLOUT_QUEUE_SAMPLES][0].value >= 0
    # A CPU learner's tree attention: the per-segment SDPA kernel, in the metric and in /progress alike.
    assert [(s.labels, s.value) for s in found[METRIC_ATTENTION_KERNEL]] == [({"kernel": "sdpa"}, 1)]
    assert parse_progress(fetch(trainer.progress_url + PROGRESS_PATH)).attention_kernel == "sdpa"
    # TRL's step curves, as TRL logged them for the last step.
    last = next(entry for entry in reversed(trainer.state.log_history) if "loss" in entry)
    assert found[METRIC_STEP_LOSS][0].value == pytest.approx(last["loss"])
    assert found[METRIC_STEP_ENTROPY][0].value == pytest.approx(last["entropy"]) and last["entropy"] > 0
    assert found[METRIC_STEP_LEARNING_RATE][0].value == pytest.approx(last["learning_rate"])
    assert {s.labels["bound"] for s in found[METRIC_STEP_CLIP_RATIO]} == {"low", "high", "region"}
    assert found[METRIC_STEP_KL][0].value == pytest.approx(last["kl"])
    assert found[METRIC_STEP_STALENESS_MAX][0].value >= found[METRIC_STEP_STALENESS_MEAN][0].value >= 0
    # ... and the trackers' copy of the log carries the progress numbers beside them.
    assert last["progress/groups_dropped/no_signal"] <= 3 and last["progress/groups_trained"] <= 6
    exported = {name for name in found} | {name.removesuffix("_created") for name in found}
    # This run has no rollout servers (a scripted worker), so no per-replica series: test_router.py reads those.
    per_replica = {METRIC_REPLICA_READY, METRIC_REPLICA_WEIGHT_VERSION, METRIC_REPLICA_SAMPLES,
                   METRIC_REPLICA_FAILURES, METRIC_REPLICA_VERSION_LAG}
    # TRL's rollout worker logs the completion lengths; the scripted worker logs none, so they are absent, not 0.
    completions = {METRIC_STEP_COMPLETION_TOKENS_MEAN, METRIC_STEP_COMPLETION_TOKENS_MAX}
    # No tools, so no episode series: test_episodes_are_exported_only_for_a_run_with_tools... reads those.
    episodes = set(EPISODE_METRIC_NAMES)
    assert set(LEARNER_METRIC_NAMES) - per_replica - completions - episodes <= exported
    assert not (per_replica | completions | episodes) & exported


@pytest.mark.slow
def test_promtool_finds_no_problem_in_the_metrics(finished_run):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is not installed; `make test` installs it")
    trainer, _, _ = finished_run
    text = fetch(trainer.progress_url + METRICS_PATH)
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    complaints = check.stdout.strip() + check.stderr.strip()
    assert check.returncode == 0 and complaints == "", complaints


@pytest.mark.slow
def test_tensorboard_reads_the_runs_curves_progress_and_spec(finished_run):
    """The event files the run wrote, read by TensorBoard's own reader: TRL's curves and our progress numbers per
    step, the run's spec as text."""
    from tensorboard.backend.event_processing import event_accumulator

    from grpo_trainer.learner.tracking.base import tracking_directory

    trainer, _, run_config = finished_run
    directory = tracking_directory(run_config, "tensorboard")
    # The run on /progress (so on status.tracking): the run's name and the directory to point `tensorboard
    # --logdir` at.
    final = parse_progress(fetch(trainer.progress_url + PROGRESS_PATH))
    assert final.tracking == [TrackedRunReport(tracker="tensorboard", run_id="metrics", uri=directory)]
    events = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/entropy", "train/kl", "train/clip_ratio/region_mean",
            "train/progress/groups_trained", "train/progress/groups_dropped/no_signal",
            "train/progress/stall_streak", "train/progress/rollout_wait_s"} <= scalars, sorted(scalars)
    steps = trainer.state.global_step
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == list(range(1, steps + 1))
    trained = events.Scalars("train/progress/groups_trained")
    assert [event.value for event in trained] == sorted(event.value for event in trained)
    assert trained[-1].value <= 6 and trained[-1].value > 0
    spec = events.Tensors("grporun/spec/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "grporun.runName: metrics" in spec and "grporun.tracking.tensorboard: {}" in spec


def test_the_learner_reports_the_rollout_pool_it_is_built_with_and_stops_it_on_close(tiny_model_dir, tmp_path):
    """The rollout pool given to the learner: every report names its servers, and closing the learner stops the
    pool's supervision and removes its route board (the last report still names them)."""
    from grpo_trainer.learner.trainer import LearnerReporting
    from grpo_trainer.rollout.pool import start_rollout_pool
    from tests.support.learner.one_prompt import one_prompt_learner
    from tests.support.ports import free_port

    server = f"http://127.0.0.1:{free_port()}"  # nothing answers there: the server is in the pool, not ready
    run_config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "rollout": {"urls": [server], "weightSync": {"mode": "filesystem", "directory": str(tmp_path / "weights")}}})
    pool = start_rollout_pool(run_config, ready_timeout_s=5, tied_embeddings=False)
    try:
        learner = one_prompt_learner(tiny_model_dir, tmp_path / "out", reporting=LearnerReporting(rollout_pool=pool))
    except BaseException:
        pool.stop()
        raise
    try:
        (replica,) = learner.progress_report().rollout
        assert replica.url == server and not replica.ready
        assert learner.progress_report().rollout == pool.report()
    finally:
        learner.close()
    assert not pool.supervisor.running and not os.path.exists(pool.board.path)
    (replica,) = learner.progress_report().rollout
    assert replica.url == server
    assert [r.url for r in learner.progress_report().rollout] == [server]


def test_the_attention_kernel_is_one_labelled_series_once_chosen():
    chosen = samples_by_name(render_metrics(lambda: ProgressReport(attention_kernel="varlen")).decode())
    assert [(s.labels, s.value) for s in chosen[METRIC_ATTENTION_KERNEL]] == [({"kernel": "varlen"}, 1)]
    assert METRIC_ATTENTION_KERNEL not in samples_by_name(render_metrics(lambda: ProgressReport()).decode())
    # A newer learner's kernel this version does not know is still reported, by name.
    newer = parse_progress('{"attentionKernel": "fa4"}')
    assert newer.attention_kernel == "fa4"
    assert [s.labels for s in samples_by_name(render_metrics(lambda: newer).decode())[METRIC_ATTENTION_KERNEL]] == [
        {"kernel": "fa4"}]


def test_stalled_report_renders_as_stalled_gauge():
    report = ProgressReport(phase=LearnerPhase.STALLED, groups_total=6, groups_consumed=6, stall_streak=6,
                            stall_limit=6, dropped={"no_signal": 6})
    found = samples_by_name(render_metrics(lambda: report).decode())
    assert found[METRIC_STALLED][0].value == 1 and found[METRIC_STALL_STREAK][0].value == 6
    assert METRIC_LAST_TRAINED not in found  # never trained: absent, not a misleading 0


@pytest.mark.parametrize(("stalled", "streak", "gauge"), [(True, 2, 1), (False, 6, 0)])
def test_the_stalled_gauge_is_the_learners_verdict_while_it_runs(stalled, streak, gauge):
    # The verdict of the learner's stall rules, as /progress says it: not the streak against its limit.
    report = ProgressReport(phase=LearnerPhase.RUNNING, stalled=stalled, stall_cause="streak" if stalled else None,
                            stall_streak=streak, stall_limit=6)
    assert samples_by_name(render_metrics(lambda: report).decode())[METRIC_STALLED][0].value == gauge


def test_server_answers_404_elsewhere():
    server = ProgressServer(lambda: ProgressReport(), port=0, host="127.0.0.1").start()
    try:
        with pytest.raises(urllib.error.HTTPError) as missing:
            fetch(server.url + "/nope")
        assert missing.value.code == 404
        assert fetch(server.url + "/healthz") == "ok"
    finally:
        server.stop()


def test_termination_message_is_written_and_fits(tmp_path):
    path = tmp_path / "termination-log"
    report = ProgressReport(phase=LearnerPhase.STALLED, groups_total=9, groups_consumed=9,
                            message="stalled: " + "x" * 10_000)
    assert write_termination_message(report, str(path))
    text = path.read_text()
    assert len(text.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    parsed = parse_progress(text)
    assert parsed.phase == LearnerPhase.STALLED and parsed.message.startswith("stalled: ")


def test_unwritable_termination_path_does_not_crash(tmp_path):
    (tmp_path / "a-file").write_text("")
    assert not write_termination_message(ProgressReport(), str(tmp_path / "a-file" / "log"))


def test_termination_message_directory_is_created(tmp_path):
    assert write_termination_message(ProgressReport(), str(tmp_path / "runs" / "tiny" / "termination-log"))


def test_counters_never_go_down_when_figures_do():
    """A stop returns a discarded window's groups and a dropped group can train after all: trained, consumed and
    dropped go down then. Prometheus reads a counter that decreases as a reset, so those are gauges, and every
    counter the learner exports stays monotonic through both."""
    from grpo_trainer.progress import RolloutProgress

    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=8, epochs=1)

    def scrape() -> dict[tuple[str, tuple], tuple[str, float]]:
        """(sample name, labels) -> (family type, value)"""
        text = render_metrics(lambda: progress.report(phase=LearnerPhase.RUNNING, global_step=1)).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): (family.type, s.value)
                for family in text_string_to_metric_families(text) for s in family.samples
                if not s.name.endswith("_created")}

    progress.train([0, 1, 2])
    progress.drop(3, "no_signal")
    before = scrape()
    progress.untrain([2])  # the stop's discarded window
    progress.train([3])  # the dropped group's late sample trained after all
    after = scrape()
    assert progress.groups_trained == 3 and progress.dropped["no_signal"] == 0
    for key, (kind, value) in before.items():
        if kind == "counter":
            assert after[key][1] >= value, f"counter {key} went down: {value} -> {after[key][1]}"
    for name in (METRIC_GROUPS_TRAINED, METRIC_GROUPS_CONSUMED, METRIC_GROUPS_DROPPED):
        kinds = {kind for (sample, _), (kind, _) in before.items() if sample == name}
        assert kinds == {"gauge"}, (name, kinds)
    no_signal = (METRIC_GROUPS_DROPPED, (("reason", "no_signal"),))
    assert before[no_signal][1] == 1 and after[no_signal][1] == 0
    assert before[(METRIC_GROUPS_TRAINED, ())][1] == 3 and before[(METRIC_GROUPS_CONSUMED, ())][1] == 4
    assert after[(METRIC_GROUPS_TRAINED, ())][1] == 3 and after[(METRIC_GROUPS_CONSUMED, ())][1] == 3
    # The trained figure is derived from the counters: collated - returned.
    assert after[(METRIC_GROUPS_COLLATED, ())][1] - after[(METRIC_GROUPS_RETURNED, ())][1] == 3


def scrape_progress(progress) -> dict[tuple[str, tuple], tuple[str, float]]:
    """(sample name, labels) -> (family type, value) of the learner's /metrics for this progress."""
    text = render_metrics(lambda: progress.report(phase=LearnerPhase.RUNNING, global_step=1)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): (family.type, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_counters_start_at_zero_in_a_resumed_process_and_totals_since_the_run_began_are_gauges():
    # Prometheus reads a counter that starts a new process anywhere but 0 as a reset plus a jump: resumed at the
    # checkpoint's trained count, `collated_total` went 4 before the crash, 2 at the resumed start.
    import json as json_module

    from grpo_trainer.progress import ProgressState, RolloutProgress

    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=8, epochs=2)
    progress.train([0, 1, 2, 3])
    assert progress.regenerate(4)
    progress.train([5])
    progress.untrain([5])  # a stop's discarded window: returned
    state = json_module.loads(json_module.dumps(progress.checkpoint_state().to_dict()))
    resumed = RolloutProgress.restore(ProgressState.from_dict(state), set(), stall_groups=0, groups_per_epoch=8,
                                      epochs=2)
    found = scrape_progress(resumed)
    counters = {key: value for key, (kind, value) in found.items() if kind == "counter"}
    assert (METRIC_GROUPS_COLLATED, ()) in counters and set(counters.values()) == {0.0}
    assert found[(METRIC_GROUPS_TRAINED, ())] == ("gauge", 4.0)  # the run's total carries over, as a gauge
    assert found[(METRIC_GROUPS_REGENERATED, ())] == ("gauge", 1.0)
    resumed.train([1])  # absolute 5: the first group the resumed process trains
    found = scrape_progress(resumed)
    assert found[(METRIC_GROUPS_COLLATED, ())][1] == 1 and found[(METRIC_GROUPS_TRAINED, ())][1] == 5


def test_groups_regenerated_for_an_environment_are_a_gauge_of_their_own():
    from grpo_trainer.progress import RolloutProgress

    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=8, epochs=1)
    progress.train([0, 1])
    assert progress.regenerate(2)  # stale
    assert progress.regenerate(3, for_environment=True)
    found = scrape_progress(progress)
    assert found[(METRIC_GROUPS_REGENERATED, ())] == ("gauge", 2.0)
    assert found[(METRIC_GROUPS_REGENERATED_ENVIRONMENT, ())] == ("gauge", 1.0)


def test_a_metric_is_a_counter_exactly_when_its_name_ends_in_total():
    from grpo_trainer.progress import RolloutProgress

    progress = RolloutProgress(set(), epochs_done=0, stall_groups=0, groups_per_epoch=8, epochs=1)
    progress.train([0])
    found = scrape_progress(progress)
    kinds = {name: kind for (name, _), (kind, _) in found.items()}
    for name in LEARNER_METRIC_NAMES:
        if name in kinds:  # per-replica families are empty without a rollout pool
            assert (kinds[name] == "counter") == name.endswith("_total"), (name, kinds[name])


def test_step_metrics_export_what_trl_logged_and_skip_what_is_not_finite():
    step_metrics = StepMetrics()
    # The shape of one TRL AsyncGRPOTrainer log (`Trainer.log`'s dict after TRL's own `log`).
    step_metrics.record({
        "loss": 0.125, "grad_norm": 1.5, "learning_rate": 1e-6, "entropy": 2.25, "kl": float("nan"),
        "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.5, "clip_ratio/region_mean": 0.5,
        "completions/mean_length": 12.5, "completions/max_length": 31.0, "sample/staleness_mean": 0.75,
        "sample/staleness_max": 2.0, "epoch": 0.5, "perf/step_s": 0.1, "reward": None, "ratio": float("inf"),
    })
    text = render_metrics(lambda: ProgressReport(), step_metrics).decode()
    found = samples_by_name(text)
    assert found[METRIC_STEP_LOSS][0].value == 0.125
    assert found[METRIC_STEP_GRAD_NORM][0].value == 1.5
    assert found[METRIC_STEP_LEARNING_RATE][0].value == 1e-6
    assert found[METRIC_STEP_ENTROPY][0].value == 2.25
    assert {s.labels["bound"]: s.value for s in found[METRIC_STEP_CLIP_RATIO]} == {
        "low": 0.0, "high": 0.5, "region": 0.5}
    assert found[METRIC_STEP_COMPLETION_TOKENS_MEAN][0].value == 12.5
    assert found[METRIC_STEP_COMPLETION_TOKENS_MAX][0].value == 31.0
    assert found[METRIC_STEP_STALENESS_MEAN][0].value == 0.75
    assert found[METRIC_STEP_STALENESS_MAX][0].value == 2.0
    assert METRIC_STEP_KL not in found  # NaN: never exported
    assert "nan" not in text.lower() and "inf" not in text.lower().replace("info", "")
    # A later step's NaN keeps the last finite value; a number arriving later appears.
    step_metrics.record({"loss": float("nan"), "kl": 0.01, "entropy": "2.0"})
    found = samples_by_name(render_metrics(lambda: ProgressReport(), step_metrics).decode())
    assert found[METRIC_STEP_LOSS][0].value == 0.125 and found[METRIC_STEP_KL][0].value == 0.01
    assert found[METRIC_STEP_ENTROPY][0].value == 2.25  # a string is not a number
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert all(families[name] == "gauge" for name in STEP_METRIC_NAMES if name in families)


def test_a_learner_without_logged_steps_exports_no_step_curves():
    found = samples_by_name(render_metrics(lambda: ProgressReport(), StepMetrics()).decode())
    assert not set(STEP_METRIC_NAMES) & set(found)


def test_episodes_are_exported_only_for_a_run_with_tools_and_failures_by_environment():
    assert not set(EPISODE_METRIC_NAMES) & set(samples_by_name(render_metrics(lambda: ProgressReport()).decode()))
    episodes = EpisodeReport(episodes=16, rows=18, turns=30, tool_calls=14, tool_failures=2, forked=2,
                             environment_failures={"guess": 3})
    found = samples_by_name(render_metrics(lambda: ProgressReport(episodes=episodes)).decode())
    # Every one is a learner metric (what the chart's alerts and dashboard may read) and exported with tools.
    assert set(EPISODE_METRIC_NAMES) <= set(found) and set(EPISODE_METRIC_NAMES) <= set(LEARNER_METRIC_NAMES)
    assert [s.value for s in found[METRIC_TOOL_CALLS]] == [14]
    assert [s.value for s in found[METRIC_EPISODES_FORKED]] == [2]
    assert [(s.labels, s.value) for s in found[METRIC_ENVIRONMENT_FAILURES]] == [({"environment": "guess"}, 3)]
    assert episodes.turns_per_episode == 30 / 16 and episodes.fork_fraction == 2 / 16
    with pytest.raises(ValueError, match="not a name"):
        EpisodeReport(environment_failures={"not a name": 1})
