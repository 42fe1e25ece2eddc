"""grpo_trainer.contract's progress report as the operator reads it: untrusted input from a tenant's pod, refused
with the field named when it holds a value the Kubernetes API cannot store (the operator copies it into status)."""

from __future__ import annotations

import json

import pytest

from grpo_trainer.contract.codes import TERMINATION_MESSAGE_MAX_BYTES, LearnerPhase, ReplicaState, StallCause
from grpo_trainer.contract.config import RunConfig, load_run_config
from grpo_trainer.contract.pod_env import environment_url_variable
from grpo_trainer.contract.report import (
    ExportReport,
    ProgressReport,
    RolloutReplicaReport,
    TrackedRunReport,
    TrackerLossReport,
    parse_progress,
)

INT64_MAX = 2**63 - 1  # the API server stores integers as int64

HOSTILE = [
    ('{"rewardMean": NaN}', "rewardMean"),
    ('{"rewardMean": Infinity}', "rewardMean"),
    ('{"rewardMean": 1e400}', "rewardMean"),
    ('{"globalStep": 1e400, "rewardMean": NaN}', "globalStep"),
    (f'{{"globalStep": {INT64_MAX + 1}}}', "globalStep"),
    ('{"groupsTrained": 99999999999999999999999}', "groupsTrained"),
    ('{"globalStep": "5"}', "globalStep"),
    ('{"globalStep": true}', "globalStep"),
    ('{"globalStep": 2.5}', "globalStep"),
    ('{"epochs": 1e400}', "epochs"),
    ('{"lastTrainedTime": NaN}', "lastTrainedTime"),
    ('{"phase": 7}', "phase"),
    (f'{{"dropped": {{"lost": {INT64_MAX}, "stale": 1}}}}', "dropped"),
    ('{"rollout": [{"replica": 0, "url": "u", "samples": -1}]}', "rollout[0].samples"),
    ('{"rollout": [{"replica": 0, "url": "u", "requestSeconds": NaN}]}', "rollout[0].requestSeconds"),
    ('{"rollout": [{"replica": 0, "url": "u", "weightVersion": "v' + "9" * 100 + '"}]}', "rollout[0].weightVersion"),
    # The exported model: copied into status.output, so held to what status can say.
    (f'{{"output": {{"uri": "u", "path": "p", "step": 1, "bytes": 1, "sha256": "{"G" * 64}", "time": 1}}}}',
     "output.sha256"),
    ('{"output": {"uri": "u", "path": "p", "step": -1, "bytes": 1, "sha256": "' + "a" * 64 + '", "time": 1}}',
     "output.step"),
    ('{"output": {"uri": "u", "path": "p", "step": 1, "bytes": 1, "sha256": "' + "a" * 64 + '", "time": 1e300}}',
     "output.time"),
    ('{"output": {"uri": "", "path": "p", "step": 1, "bytes": 1, "sha256": "' + "a" * 64 + '", "time": 1}}',
     "output.uri"),
    # The episodes of a run with tools: copied into status.progress.episodes.
    ('{"episodes": 7}', "episodes"),
    ('{"episodes": {"toolCalls": "5"}}', "episodes.toolCalls"),
    ('{"episodes": {"turns": -1}}', "episodes.turns"),
    ('{"episodes": {"forked": 1.5}}', "episodes.forked"),
    ('{"episodes": {"environmentFailures": {"sandbox": NaN}}}', "episodes.environmentFailures.sandbox"),
    ('{"episodes": {"environmentFailures": {"no such name!": 1}}}', "episodes.environmentFailures"),
    ('{"episodes": {"environmentFailures": ' + json.dumps({f"e{i}": 1 for i in range(33)}) + '}}',
     "episodes.environmentFailures"),
    (f'{{"episodes": {{"environmentFailures": {{"a": {INT64_MAX}, "b": 1}}}}}}', "episodes.environmentFailures"),
    # The trackers' runs: copied into status.tracking.
    ('{"tracking": [{"tracker": "mlflow", "runId": 7, "uri": "u"}]}', "tracking[0].runId"),
    ('{"tracking": [{"tracker": "mlflow", "runId": "r", "uri": ""}]}', "tracking[0].uri"),
    ('{"tracking": [{"tracker": "mlflow", "runId": "r", "uri": "u"}], "output": 1}', "output"),
    ('{"tracking": ' + json.dumps([{"tracker": "mlflow", "runId": "r", "uri": "u"}] * 4) + '}', "tracking"),
    # The trackers lost mid-run: into TrackingDegraded's message.
    ('{"trackingLost": [{"tracker": "mlflow", "since": "2026-12-05", "reason": "r"}]}', "trackingLost[0].since"),
    ('{"trackingLost": [{"tracker": "mlflow", "since": NaN, "reason": "r"}]}', "trackingLost[0].since"),
    ('{"trackingLost": [{"tracker": "mlflow", "since": -1, "reason": "r"}]}', "trackingLost[0].since"),
    ('{"trackingLost": [{"tracker": "mlflow", "since": 1e300, "reason": "r"}]}', "trackingLost[0].since"),
    ('{"trackingLost": [{"tracker": 7, "since": 1, "reason": "r"}]}', "trackingLost[0].tracker"),
    ('{"trackingLost": [{"tracker": "", "since": 1, "reason": "r"}]}', "trackingLost[0].tracker"),
    ('{"trackingLost": [{"tracker": "mlflow", "since": 1, "reason": "' + "r" * 513 + '"}]}',
     "trackingLost[0].reason"),
    ('{"trackingLost": [{"tracker": "mlflow", "since": 1}]}', "trackingLost[0].reason"),
    ('{"trackingLost": "mlflow"}', "trackingLost"),
    ('{"trackingLost": ' + json.dumps([{"tracker": "mlflow", "since": 1, "reason": "r"}] * 4) + '}', "trackingLost"),
]


@pytest.mark.parametrize(("body", "field"), HOSTILE)
def test_a_report_with_a_value_status_cannot_hold_is_refused_naming_the_field(body, field):
    with pytest.raises(ValueError) as refused:
        parse_progress(body)
    assert str(refused.value).startswith(f"{field}: ") and "\n" not in str(refused.value)


def test_the_largest_values_the_api_server_stores_are_accepted():
    report = parse_progress(json.dumps({
        "phase": "Running", "groupsTotal": INT64_MAX, "groupsConsumed": INT64_MAX, "groupsTrained": INT64_MAX,
        "dropped": {"lost": INT64_MAX}, "globalStep": INT64_MAX, "epochsDone": INT64_MAX, "epochs": 1.7e308,
        "rewardMean": -1.7e308, "lastTrainedTime": 1.7e308, "rollout": [{"replica": 0, "url": "u", "samples": 3}],
    }))
    assert report.global_step == INT64_MAX and report.dropped_total == INT64_MAX


def test_what_the_learner_writes_it_reads_back():
    report = ProgressReport(phase="Running", groups_total=12, groups_consumed=5, groups_trained=4, reward_mean=0.25,
                            epochs=1.5, last_trained_time=1.7e9, rollout=[RolloutReplicaReport(
                                replica=0, url="http://r:8000", ready=True, weight_version="v3", samples=9)])
    assert parse_progress(report.model_dump_json(by_alias=True)) == report
    assert parse_progress(report.termination_message()) == report


def test_the_exported_model_survives_the_termination_messages_bound():
    export = ExportReport(uri="pvc://models/" + "r" * 1000, path="/var/lib/grpo/model/" + "r" * 1000, step=INT64_MAX,
                          bytes=INT64_MAX, sha256="f" * 64, time=1.7e9)
    report = ProgressReport(phase="Succeeded", groups_total=12, output=export, message="m" * 5000, rollout=[
        RolloutReplicaReport(replica=index, url=f"http://r-{index}:8000") for index in range(64)])
    message = report.termination_message()
    assert len(message.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    assert parse_progress(message).output == export  # the rollout detail and the message give way first
    tracked = [TrackedRunReport(tracker=name, run_id="i" * 128, uri="u" * 1024) for name in ("a", "b", "c")]
    message = report.model_copy(update={"tracking": tracked}).termination_message()
    assert len(message.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    assert parse_progress(message).output == export  # the trackers' runs give way too: the status keeps them


def test_a_newer_learners_tracked_run_is_read_without_its_new_fields():
    report = parse_progress(json.dumps({"tracking": [{"tracker": "mlflow", "runId": "r1", "uri": "http://m/#/r1",
                                                      "artifactUri": "s3://a"}]}))
    assert report.tracking == [TrackedRunReport(tracker="mlflow", run_id="r1", uri="http://m/#/r1")]


def test_a_newer_learners_lost_tracker_is_read_without_its_new_fields_and_an_older_report_has_none():
    report = parse_progress(json.dumps({"trackingLost": [{"tracker": "mlflow", "since": 1.7e9, "reason": "gone (u)",
                                                          "step": 12, "lostMetrics": 40}]}))
    assert report.tracking_lost == [TrackerLossReport(tracker="mlflow", since=1.7e9, reason="gone (u)")]
    assert parse_progress('{"phase": "Running"}').tracking_lost == []


NEWER_LEARNER = {
    "phase": "Paused", "groupsTotal": 12, "groupsConsumed": 6, "groupsTrained": 3, "stallCause": "reward_timeout",
    "dropped": {"no_signal": 1, "reward_timeout": 2}, "samplesMasked": {"non_finite": 1, "clipped": 4},
    "samplesScored": 10, "tokensPerSecond": 812.5, "newSection": {"nested": [1, 2]},
    "rollout": [{"replica": 0, "url": "u", "state": "warming", "samples": 3, "kvCacheUsage": 0.5}],
}


def test_a_newer_learners_report_is_read_with_what_this_version_does_not_know_carried_as_text():
    """A learner image upgraded before the operator: fields it added are ignored, reasons, phases and states it
    added are kept as their names, and the counts still add up."""
    report = parse_progress(json.dumps(NEWER_LEARNER))
    assert report.phase == "Paused" and report.stall_cause == "reward_timeout"
    assert report.dropped["reward_timeout"] == 2 and report.dropped_total == 3
    assert report.dropped["stale"] == 0  # the reasons this version knows are all there
    assert report.samples_masked["clipped"] == 4 and report.masked_fraction == 0.5
    assert report.rollout[0].state == "warming" and report.rollout[0].samples == 3
    assert not hasattr(report, "tokens_per_second")
    assert parse_progress(report.termination_message()) == report


def test_known_names_still_read_as_this_versions_enums():
    report = parse_progress('{"phase": "Stalled", "stallCause": "weight_sync", '
                            '"rollout": [{"replica": 0, "url": "u", "state": "draining"}]}')
    assert report.phase is LearnerPhase.STALLED and report.stall_cause is StallCause.WEIGHT_SYNC
    assert report.rollout[0].state is ReplicaState.DRAINING


def test_the_stall_verdict_is_the_learners_and_an_older_learners_is_its_phase():
    running = parse_progress('{"phase": "Running", "stalled": true, "stallCause": "streak", "stallStreak": 2, '
                             '"stallLimit": 9}')
    assert running.stall_verdict and running.stall_cause is StallCause.STREAK  # its rule, not streak >= limit
    assert not parse_progress('{"phase": "Running", "stalled": false, "stallStreak": 9, "stallLimit": 9}').stall_verdict
    newer = parse_progress('{"phase": "Running", "stalled": true, "stallCause": "reward_timeout"}')
    assert newer.stall_verdict and newer.stall_cause == "reward_timeout"
    # A learner older than `stalled` says it only by stopping as stalled.
    assert not parse_progress('{"phase": "Running", "stallStreak": 9, "stallLimit": 9}').stall_verdict
    older = parse_progress('{"phase": "Stalled", "stallCause": "weight_sync"}')
    assert older.stalled is None and older.stall_verdict
    assert parse_progress(running.termination_message()) == running


@pytest.mark.parametrize(("body", "field"), [
    ('{"stalled": "true"}', "stalled"),
    ('{"stalled": 1}', "stalled"),
    ('{"dropped": {"reward_timeout": "2"}}', "dropped.reward_timeout"),
    ('{"dropped": {"reward_timeout": -1}}', "dropped.reward_timeout"),
    ('{"dropped": {"reward_timeout": 1.5}}', "dropped.reward_timeout"),
    ('{"dropped": {"Not A Reason": 1}}', "dropped"),
    ('{"dropped": {"' + "r" * 100 + '": 1}}', "dropped"),
    ('{"dropped": {' + ", ".join(f'"r{i}": 1' for i in range(100)) + '}}', "dropped"),
    ('{"samplesMasked": {"clipped": NaN}}', "samplesMasked.clipped"),
    ('{"phase": "' + "P" * 100 + '"}', "phase"),
    ('{"phase": ""}', "phase"),
    ('{"stallCause": 3}', "stallCause"),
    ('{"rollout": [{"replica": 0, "url": "u", "state": true}]}', "rollout[0].state"),
])
def test_what_a_newer_learner_adds_is_still_held_to_strict_types_and_bounds(body, field):
    with pytest.raises(ValueError) as refused:
        parse_progress(body)
    assert str(refused.value).startswith(f"{field}: ") and "\n" not in str(refused.value)


def test_an_fsdp2_learner_is_accepted_on_either_device_and_with_lora():
    # CPU ranks shard too (grpo_trainer.learner.sharding); an unsharded model is refused when training starts.
    for learner in ({"device": "cpu", "strategy": "fsdp2"}, {"strategy": "fsdp2", "fsdp": {"cpuOffload": True}}):
        config = RunConfig.model_validate({"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}],
                                           "learner": learner, "training": {"lora": {"r": 8}}})
        assert config.learner.strategy == "fsdp2"
        assert config.learner.fsdp.cpu_offload == learner.get("fsdp", {}).get("cpuOffload", False)


@pytest.mark.parametrize(("name", "variable"), [("guess", "GRPO_ENVIRONMENT_GUESS_URL"),
                                                ("code-exec-2", "GRPO_ENVIRONMENT_CODE_EXEC_2_URL")])
def test_an_environments_url_variable_is_its_name_upper_cased_with_dashes_as_underscores(name, variable):
    assert environment_url_variable(name) == variable


def test_the_run_config_carries_the_environments_urls_and_a_config_without_them_has_none():
    base = {"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}]}
    assert load_run_config(json.dumps(base)).environments == {}
    urls = {"guess": "http://r-env-guess.ns.svc:8765"}
    assert load_run_config(json.dumps({**base, "environments": urls})).environments == urls
