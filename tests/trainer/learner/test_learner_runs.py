"""The real GRPOLearner (TRL 1.16's AsyncGRPOTrainer subclass) on CPU with a scripted rollout worker.

Each run is tests/support/learner/learner_scenario.py in a subprocess, alone or under `accelerate launch` with two gloo
ranks, the way the learner pods launch it. Every rank writes what it saw; the assertions compare ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trl.experimental.async_grpo import AsyncGRPOConfig

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, EXIT_PREEMPTED, EXIT_STALLED, EXIT_SUCCEEDED
from grpo_trainer.contract.config import RunConfig
from grpo_trainer.contract.launch import GangLayout, learner_argv
from grpo_trainer.learner.checkpoints import read_marker
from grpo_trainer.learner.main import trainer_arguments
from grpo_trainer.storage.model_export import verify_export
from grpo_trainer.storage.reexport import export_from_checkpoint
from tests.support.ports import free_port

pytestmark = pytest.mark.slow
from tests.support.learner.learner_scenario import fork_rows  # noqa: E402
from tests.support.paths import COMPLETIONS_SERVER, REPO  # noqa: E402

SCENARIO = str(REPO / "tests" / "support" / "learner" / "learner_scenario.py")


def run(tiny_model_dir, out: Path, *args: str, ranks: int = 1, expect: int = EXIT_SUCCEEDED) -> list[dict]:
    scenario = [SCENARIO, "--model", tiny_model_dir, "--out", str(out), *args]
    if ranks == 1:
        command = [sys.executable, *scenario]
    else:
        # The learner pods' own launch line (grpo_trainer.contract.launch), with the scenario script as the entry.
        command = learner_argv("unused", gang=GangLayout(processes_per_machine=ranks, main_process_port=free_port()),
                               python=sys.executable, entry=tuple(scenario))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(results) == ranks, done.stdout[-3000:] + done.stderr[-3000:]
    # The pod's exit code is the operator's only signal: it must be exact whatever the world size.
    assert done.returncode == expect, done.stderr[-3000:]
    return results


def test_a_third_without_signal_ends_at_the_epoch_bound(tiny_model_dir, tmp_path):
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "third_no_signal", "--prompts", "9")
    progress = result["progress"]
    assert result["outcome"] == "succeeded" and progress["phase"] == "Succeeded"
    assert result["consumed_absolute"] == list(range(9))
    assert progress["groupsConsumed"] == progress["groupsTotal"] == 9
    assert progress["dropped"]["no_signal"] == 3 and progress["groupsTrained"] == 6
    assert progress["epochsDone"] == 1
    assert result["micro_batches"][-1] == 0 and result["micro_batches"].count(0) == 1  # one stop, last


def test_every_group_without_signal_raises_the_stall_error_within_one_pass(tiny_model_dir, tmp_path):
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "no_signal", "--prompts", "9", "--epochs", "3",
                    expect=EXIT_STALLED)
    assert result["outcome"] == "StallError"
    assert "9 prompt groups in a row were consumed without one training" in result["message"]
    progress = result["progress"]
    assert progress["phase"] == "Stalled" and progress["groupsConsumed"] == 9 and progress["globalStep"] == 0
    assert progress["stalled"] is True and progress["stallCause"] == "streak"  # the verdict the operator shows
    # TRL's own loop would generate forever; this one stops after the pass plus what was already queued.
    assert result["groups_generated"] < 9 + 64


def test_two_ranks_stop_at_the_same_micro_batch_with_equal_parameters(tiny_model_dir, tmp_path):
    # 6 trainable groups x 4 samples over 2 ranks x 4 samples = 3 micro-batches; GA 2 would put the stop mid window
    # (stepping on its unreduced gradients made the replicas diverge, 308.53 vs 311.73): the window is filled first.
    results = run(tiny_model_dir, tmp_path, "--scenario", "third_no_signal", "--prompts", "9", "--ga", "2",
                  ranks=2)
    rank0, rank1 = results
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["outcome"] == rank1["outcome"] == "succeeded"
    assert rank0["micro_batches"] == rank1["micro_batches"]
    micro_batches = rank0["micro_batches"]
    assert micro_batches[:3] == [1, 1, 1] and micro_batches[-1] == 0 and -1 not in micro_batches
    assert rank0["micro_batches"].count(1) == 2 * rank0["global_step"]  # every window complete, every one stepped
    assert rank0["global_step"] == rank1["global_step"]
    assert rank0["checksum"] == rank1["checksum"]
    assert rank0["consumed_absolute"] == list(range(9))


def test_two_ranks_both_raise_the_stall_error(tiny_model_dir, tmp_path):
    results = run(tiny_model_dir, tmp_path, "--scenario", "no_signal", "--prompts", "6", ranks=2, expect=EXIT_STALLED)
    assert [r["outcome"] for r in results] == ["StallError", "StallError"]
    assert results[0]["micro_batches"] == results[1]["micro_batches"] == [0]
    assert all("in a row" in r["message"] for r in results)


def test_two_ranks_with_an_invalid_config_exit_78_under_the_pod_launch_line(tmp_path):
    config = tmp_path / "run.json"
    config.write_text('{"model": "m", "dataset": {"name": "d"}, "rewards": [{"name": "accuracy"}], '
                      '"training": {"epochs": -1}}')
    command = learner_argv(str(config), gang=GangLayout(processes_per_machine=2, main_process_port=free_port()),
                           python=sys.executable)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == EXIT_INVALID_CONFIG, done.stderr[-3000:]
    assert "training.epochs" in done.stderr


def test_groups_that_never_arrive_cannot_block_the_stop(tiny_model_dir, tmp_path):
    # Every 4th group vanishes before the trainer (as TRL does with rows that have no trained token). Groups issued
    # after it arrive; once the learner's version is past max_staleness from theirs, the missing group's samples
    # would be stale if they ever came: it is regenerated (a later group takes its place), never waited for.
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "12", "--lost-every", "4",
                    "--max-staleness", "2", "--queue-maxsize", "8")
    progress = result["progress"]
    assert result["outcome"] == "succeeded" and progress["groupsConsumed"] == progress["groupsTotal"] == 12
    assert progress["regenerated"] >= 3 and progress["dropped"]["lost"] == 0
    assert progress["groupsTrained"] + sum(progress["dropped"].values()) == 12


def test_a_fast_worker_with_max_staleness_1_ends_at_the_epoch_bound(tiny_model_dir, tmp_path):
    # A worker far faster than the trainer keeps its queue full, sized as the learner sizes TRL's worker queue.
    # With TRL's 1024 samples, 9 groups in a row went stale while queued and the run ended as stalled (42); the
    # queue now holds max_staleness steps, and groups that still go stale are regenerated, not consumed.
    config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "learner": {"device": "cpu"}, "output_dir": str(tmp_path),
        "training": {"epochs": 3, "numGenerations": 4, "perDeviceTrainBatchSize": 4, "maxStaleness": 1},
    })
    queue_maxsize = AsyncGRPOConfig(**trainer_arguments(config)).queue_maxsize
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "9", "--epochs", "3",
                    "--generations", "4", "--batch", "4", "--max-staleness", "1",
                    "--queue-maxsize", str(queue_maxsize))
    progress = result["progress"]
    assert result["outcome"] == "succeeded" and progress["phase"] == "Succeeded"
    assert progress["groupsConsumed"] == progress["groupsTotal"] == 27 and progress["epochsDone"] == 3
    assert progress["groupsTrained"] + sum(progress["dropped"].values()) == 27
    assert result["micro_batches"][-1] == 0 and result["micro_batches"].count(0) == 1


def test_a_resumed_lora_run_finishes_with_the_same_consumed_set_and_its_adapter(tiny_model_dir, tmp_path):
    """training.lora's run (a peft adapter): the checkpoint holds the adapter, and resume continues from it."""
    common = ["--scenario", "third_no_signal", "--prompts", "9", "--epochs", "2", "--save-steps", "1",
              "--lora-rank", "4"]
    (first,) = run(tiny_model_dir, tmp_path / "first", *common, "--max-steps", "3")
    assert first["progress"]["message"].startswith("stopped at max_steps=3 before the epoch bound")
    checkpoints = sorted((tmp_path / "first" / "checkpoints").glob("checkpoint-*"),
                         key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, "the interrupted run saved no checkpoint"
    saved = json.loads((checkpoints[-1] / "grpo_progress.json").read_text())
    trl_state = json.loads((checkpoints[-1] / "rollout_state.json").read_text())
    start = saved["first_unconsumed"]
    assert trl_state["prompt_index"] == start > 0  # TRL's own resume cursor moved past the dropped groups

    assert (checkpoints[-1] / "adapter_model.safetensors").is_file()
    assert not (checkpoints[-1] / "model.safetensors").exists()  # the base weights never change: not saved
    assert_reexports_merged(tiny_model_dir, checkpoints[-1], tmp_path / "reexport")

    (second,) = run(tiny_model_dir, tmp_path / "second", *common, "--resume-from", str(checkpoints[-1]))
    # The resumed learner starts from the checkpoint's adapter (lora_B starts at zero: a fresh one sums otherwise).
    assert second["adapter_checksum_at_start"] == pytest.approx(first["adapter_checksum"], rel=1e-9, abs=1e-9)
    assert first["adapter_checksum"] != pytest.approx(first["adapter_checksum_at_start"], abs=1e-6)
    (uninterrupted,) = run(tiny_model_dir, tmp_path / "whole", "--scenario", "third_no_signal", "--prompts", "9",
                           "--epochs", "2", "--lora-rank", "4")
    assert second["outcome"] == "succeeded"
    assert second["start_position"] == start  # the worker restarts at the first unconsumed group: no group before
    # it (dropped ones included) is generated again
    assert second["consumed_absolute"] == uninterrupted["consumed_absolute"] == list(range(18))
    for key in ("groupsConsumed", "groupsTrained", "dropped", "epochsDone"):
        assert second["progress"][key] == uninterrupted["progress"][key], key
    # The counters count this process's groups from 0; trained, the run's total, carries the checkpoint's over.
    resumed = second["progress"]
    assert resumed["groupsCollated"] - resumed["groupsReturned"] == resumed["groupsTrained"] - saved["groups_trained"]
    assert saved["dropped"]["no_signal"] > 0 and all(p > start for p in saved["consumed_after"])


def assert_reexports_merged(tiny_model_dir, checkpoint: Path, out: Path) -> None:
    """A LoRA checkpoint exports (grporun export, the export pod) as its base with the adapter merged in, the adapter
    beside it: the merged model computes what the base with the adapter does."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "length"}],
        "checkpoint": {"directory": str(checkpoint.parent)},
        "output": {"directory": str(out / "model"), "uri": (out / "model").as_uri()}})
    exported = export_from_checkpoint(config, str(checkpoint))
    assert verify_export(exported.path)["progress"]["checkpoint"] == checkpoint.name
    merged = AutoModelForCausalLM.from_pretrained(exported.path)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                        str(Path(exported.path) / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inputs = AutoTokenizer.from_pretrained(exported.path)("a b c", return_tensors="pt")
    with torch.no_grad():
        logits = [model(**inputs).logits for model in (merged, adapted, base)]
    assert torch.allclose(logits[0], logits[1], atol=1e-5) and not torch.equal(logits[0], logits[2])


def test_a_rank_0_only_pipeline_error_reaches_every_rank(tiny_model_dir, tmp_path):
    # The worker dies on rank 0; TRL's health check raises there alone. Without the error stop, rank 1 would wait
    # in accelerate's broadcast until ddp_timeout (1800 s).
    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "50", "--worker-fails-after", "3",
                  ranks=2, expect=1)
    assert [r["outcome"] for r in results] == ["RolloutPipelineError", "RolloutPipelineError"]
    assert results[0]["micro_batches"] == results[1]["micro_batches"] and results[0]["micro_batches"][-1] == 0
    assert "scripted failure after 3 groups" in results[0]["message"]
    assert results[0]["progress"]["phase"] == "Failed"



@pytest.mark.parametrize("ga", [1, 4])
def test_only_what_reached_an_optimizer_step_counts_as_trained(tiny_model_dir, tmp_path, ga):
    # 6 trainable groups, one per micro-batch. GA 1: the stop must not run an optimizer step of its own (it
    # advanced the step counter, the LR schedule and a weight sync on zeroed gradients). GA 4: the stop would cut
    # the second window short after 2 micro-batches, whose groups were counted as trained but never stepped.
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "third_no_signal", "--prompts", "9", "--ga", str(ga))
    trained = result["micro_batches"].count(1)
    assert result["micro_batches"][-1] == 0 and -1 not in result["micro_batches"]
    assert trained == ga * result["global_step"]  # no empty step, no partial window
    assert result["progress"]["groupsTrained"] == 6 and result["consumed_absolute"] == list(range(9))
    stepped = [g for g in result["stepped_groups"] if g < 9]
    assert sorted(stepped) == [g for g in range(9) if g % 3]  # each trainable group in exactly one stepped window


def test_sigterm_checkpoints_and_a_resume_trains_every_group_exactly_once(tiny_model_dir, tmp_path):
    common = ["--scenario", "varied", "--prompts", "12", "--epochs", "2", "--ga", "2", "--save-steps", "100"]
    (first,) = run(tiny_model_dir, tmp_path / "first", *common, "--sigterm-at-step", "3", expect=EXIT_PREEMPTED)
    assert first["outcome"] == "Preempted" and first["global_step"] == 3
    assert first["message"].startswith("preempted")
    checkpoint = tmp_path / "first" / "checkpoints" / "checkpoint-3"
    saved = json.loads((checkpoint / "grpo_progress.json").read_text())  # present: the checkpoint is complete
    assert saved["groups_trained"] == len(first["stepped_groups"]) == 6  # 3 steps x 2 micro-batches x 1 group
    (second,) = run(tiny_model_dir, tmp_path / "second", *common, "--resume-from", str(checkpoint))
    assert second["outcome"] == "succeeded" and second["start_position"] == saved["first_unconsumed"]
    assert second["progress"]["groupsTrained"] == second["progress"]["groupsTotal"] == 24
    stepped = first["stepped_groups"] + [g for g in second["stepped_groups"] if g < 24]
    assert sorted(stepped) == list(range(24))  # every group trained once: none lost with the window, none twice


def test_two_ranks_preempted_save_once_and_the_pod_exits_preempted(tiny_model_dir, tmp_path):
    # Both ranks get SIGTERM (as in a deleted pod, where the supervisor passes it to each); rank 0's stream decides.
    results = run(tiny_model_dir, tmp_path, "--scenario", "varied", "--prompts", "12", "--ga", "2",
                  "--save-steps", "100", "--sigterm-at-step", "2", ranks=2, expect=EXIT_PREEMPTED)
    assert [r["outcome"] for r in results] == ["Preempted", "Preempted"]
    assert results[0]["micro_batches"] == results[1]["micro_batches"] and results[0]["global_step"] == 2
    assert results[0]["checksum"] == results[1]["checksum"]
    # The marker is written once both ranks wrote their files, and vouches for rank 1's RNG state too.
    marker = read_marker(str(tmp_path / "checkpoints" / "checkpoint-2"))
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(marker["files"])


def test_a_resumed_learner_keeps_counting_weight_versions_and_cleans_old_and_partial_ones(tiny_model_dir, tmp_path):
    # Real filesystem weight sync (safetensors into a version directory) against a stand-in server that accepts
    # the reload calls. The first learner syncs v1..v4 (the cold sync and 3 steps), then "crashes" while writing v5.
    port = free_port()
    server = subprocess.Popen([sys.executable, str(COMPLETIONS_SERVER), "s",
                               str(port)], stdout=subprocess.PIPE, text=True)
    weights = tmp_path / "weights"
    sync = ["--weights-dir", str(weights), "--weights-server", f"http://127.0.0.1:{port}"]
    common = ["--scenario", "varied", "--prompts", "6", "--epochs", "2", "--save-steps", "1", *sync]
    try:
        server.stdout.readline()
        (first,) = run(tiny_model_dir, tmp_path / "first", *common, "--max-steps", "3")
        assert first["weight_version"] == first["model_version"] == 4 and first["weight_dirs"] == ["v4"]
        (weights / ".v5.partial-99").mkdir()  # killed while writing its next version
        (weights / "v2").mkdir()  # an old one left behind
        # The newest checkpoint may be older than the newest weights (steps after the last save): resume from 2.
        checkpoint = tmp_path / "first" / "checkpoints" / "checkpoint-2"
        (second,) = run(tiny_model_dir, tmp_path / "second", *common, "--resume-from", str(checkpoint))
    finally:
        server.kill()
        server.wait()
    syncs = second["progress"]["weightSyncs"]
    assert second["outcome"] == "succeeded" and syncs >= 2
    assert second["weight_version"] == 4 + syncs  # its first sync wrote v5: not v1 again, not v4 over a live one
    assert second["weight_dirs"] == [f"v{second['weight_version']}"]  # old and partial directories removed
    # The learner's own version (samples, staleness) is the one the servers serve, though its checkpoint had 3.
    assert second["model_version"] == second["weight_version"]


def test_a_reward_that_scores_nothing_stalls_as_unscorable_even_with_drop_no_signal_off(tiny_model_dir, tmp_path):
    # Every reward returns None: TRL's worker gives every sample advantage 0. Trained, the run would end Succeeded
    # having learned nothing; these groups are unscorable, never trained, and one pass of them is a stall.
    (result,) = run(tiny_model_dir, tmp_path, "--scenario", "unscorable", "--prompts", "6", "--epochs", "3",
                    "--keep-no-signal", expect=EXIT_STALLED)
    assert result["outcome"] == "StallError" and "6 prompt groups in a row" in result["message"]
    progress = result["progress"]
    assert progress["phase"] == "Stalled" and progress["globalStep"] == 0 and progress["groupsTrained"] == 0
    assert progress["stalled"] is True and progress["stallCause"] == "streak"
    assert progress["dropped"]["unscorable"] == 6 == progress["groupsConsumed"]
    assert progress["dropped"]["no_signal"] == 0


def expected_episodes(start: int, groups: int, generations: int = 4) -> dict[str, int]:
    """What `groups` scripted multi-row groups from `start` on stamp (tests/support/learner/learner_scenario.py
    fork_rows)."""
    rows = [fork_rows(p, k) for p in range(start, start + groups) for k in range(generations)]
    return {"episodes": len(rows), "rows": sum(rows), "forked": sum(1 for r in rows if r > 1)}


def assert_episodes_counted(result: dict) -> None:
    """The learner counted the episodes of the groups it read, in order from where its worker started."""
    episodes = result["episodes"]
    assert episodes["episodes"] % 4 == 0 and episodes["episodes"] > 0
    counted = {key: episodes[key] for key in ("episodes", "rows", "forked")}
    assert counted == expected_episodes(result["start_position"], episodes["episodes"] // 4)


def assert_every_group_once(before: set[int], after: dict, total: int) -> None:
    """`before`: the groups the first process trained (that its checkpoint keeps); `after`: the resumed run."""
    progress = after["progress"]
    assert after["outcome"] == "succeeded" and progress["phase"] == "Succeeded"
    # A multi-row group spans micro-batches (and steps): a group is in every window its rows reached.
    resumed = {g for g in after["stepped_groups"] if g < total}
    assert not before & resumed, f"trained in both processes: {sorted(before & resumed)}"
    assert before | resumed == set(range(total)), f"never trained: {sorted(set(range(total)) - before - resumed)}"
    assert progress["groupsConsumed"] == progress["groupsTotal"] == total and progress["epochsDone"] == 2
    assert progress["groupsTrained"] + sum(progress["dropped"].values()) == progress["groupsConsumed"]
    assert progress["groupsTrained"] == total  # every group has signal: none dropped
    assert after["consumed_absolute"] == list(range(total))
    assert_episodes_counted(after)


MULTI_ROW = ["--scenario", "varied", "--multi-row", "--prompts", "6", "--epochs", "2", "--ga", "2"]


def test_multi_row_groups_split_across_steps_resume_after_sigterm_training_every_group_once(tiny_model_dir,
                                                                                               tmp_path):
    # Groups of 7-9 rows (conversations forked into 1-3 rows) in micro-batches of 4 rows, 2 per step: step 2 ends
    # inside group 2 (rows 0-6, 7-14, 15-23), whose other rows are in the queue, the batcher or the micro-batch
    # already fetched when the SIGTERM stops the learner.
    (first,) = run(tiny_model_dir, tmp_path / "first", *MULTI_ROW, "--save-steps", "100", "--sigterm-at-step", "2",
                   expect=EXIT_PREEMPTED)
    assert first["outcome"] == "Preempted" and first["global_step"] == 2
    assert -1 in first["micro_batches"]  # the stop discarded a window: the one holding group 2's next rows
    assert_episodes_counted(first)
    checkpoint = tmp_path / "first" / "checkpoints" / "checkpoint-2"
    saved = json.loads((checkpoint / "grpo_progress.json").read_text())
    stepped = set(first["stepped_groups"])
    assert saved["groups_trained"] == len(stepped)
    assert set(range(saved["first_unconsumed"])) | set(saved["consumed_after"]) == stepped
    (second,) = run(tiny_model_dir, tmp_path / "second", *MULTI_ROW, "--resume-from", str(checkpoint))
    assert second["start_position"] == saved["first_unconsumed"]
    assert_every_group_once(stepped, second, total=12)


def test_multi_row_groups_resume_on_another_node_after_a_kill_from_the_stores_last_checkpoint(
        tiny_model_dir, tmp_path, s3_server, s3_bucket, monkeypatch):
    """checkpoint.uri: the learner is killed at step 3, before its checkpoint, and starts again with an empty
    checkpoint folder (another node): it resumes from step 2's checkpoint in the store, and step 3's groups train
    again, every group once."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    uri = f"s3://{s3_bucket}/runs/multi-row"
    killed = subprocess.run([sys.executable, SCENARIO, "--model", tiny_model_dir, "--out", str(tmp_path / "first"),
                             *MULTI_ROW, "--save-steps", "1", "--sigkill-at-step", "3", "--checkpoint-uri", uri],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    record = json.loads((tmp_path / "first" / "killed.json").read_text())
    timeline = record["timeline"]
    stepped_by_2 = set(next(entry["stepped"] for entry in timeline if entry["step"] == 2))
    assert record["uploaded"]["step"] == 2 and record["uploaded"]["uri"] == f"{uri}/checkpoint-2"
    local = tmp_path / "first" / "checkpoints" / "checkpoint-2"
    saved = json.loads((local / "grpo_progress.json").read_text())
    assert saved["groups_trained"] == len(stepped_by_2)
    assert set(range(saved["first_unconsumed"])) | set(saved["consumed_after"]) == stepped_by_2
    (second,) = run(tiny_model_dir, tmp_path / "second", *MULTI_ROW, "--checkpoint-uri", uri)
    downloaded = tmp_path / "second" / "checkpoints" / "checkpoint-2"
    assert second["resumed_from"] == str(downloaded)
    assert json.loads((downloaded / "grpo_progress.json").read_text()) == saved
    assert second["start_position"] == saved["first_unconsumed"]
    assert second["global_step"] > 2 and second["timeline"][0]["step"] == 3  # the steps count on from the checkpoint
    assert_every_group_once(stepped_by_2, second, total=12)
