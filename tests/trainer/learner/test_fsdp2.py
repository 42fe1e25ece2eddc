"""FSDP2 learners (`learner.strategy: fsdp2`) on two gloo ranks under the pod's own launch line, and the weight
sync's gather order.

The real GRPOLearner trains sharded (grpo_trainer.learner.sharding makes accelerate's CPU ranks FSDP2): with the
scripted rollout worker (tests/support/learner/learner_scenario.py) as a learner of two machines, each with its own
checkpoint folder, for an exact resume through the trainer's own sharded checkpoint from the object store, and as the
pod runs it (`python -m grpo_trainer learner`) against the session's vLLM server for the
consolidated export, with and without LoRA, and for the refusal of a run accelerate does not shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, EXIT_SUCCEEDED, LearnerPhase
from grpo_trainer.contract.config import LoraConfig, OutputConfig, RunConfig
from grpo_trainer.contract.launch import GangLayout, learner_argv
from grpo_trainer.learner.checkpoints import PROGRESS_STATE_FILE, MarkerError, read_marker
from grpo_trainer.learner.trainer import GRPOLearner
from grpo_trainer.rollout.weight_sync import FilesystemWeightTransfer, gathered_before_sending, gathered_parameters
from grpo_trainer.storage.model_export import ExportError
from grpo_trainer.storage.reexport import export_from_checkpoint
from tests.support.paths import REPO
from tests.support.ports import free_port
from tests.trainer.learner.test_e2e_cpu import PROMPTS, termination_report, tiny_run_config

SCENARIO = str(REPO / "tests" / "support" / "learner" / "learner_scenario.py")
RANKS = 2
LEARNER_TIMEOUT_S = 900


class Recorded:
    """Named parameters that record how many were taken."""

    def __init__(self, count: int):
        self.named = [(f"p{i}", torch.full((2,), float(i))) for i in range(count)]
        self.taken = 0

    def __iter__(self):
        for pair in self.named:
            self.taken += 1
            yield pair


def test_a_sender_on_its_own_thread_gets_parameters_all_gathered_before_the_first():
    # TRL's NCCL client consumes the iterator on a daemon thread between broadcasts to vLLM: every gather must be
    # done on the caller's thread first, in the other ranks' order.
    source = Recorded(5)
    handed = gathered_before_sending(source, torch.device("cpu"))
    assert source.taken == 5
    received = []
    consumer = threading.Thread(target=lambda: received.extend(handed))
    consumer.start()
    consumer.join()
    assert [name for name, _ in received] == [f"p{i}" for i in range(5)]


def test_a_sender_on_the_callers_thread_takes_each_parameter_as_it_is_gathered():
    source = Recorded(3)
    stream = gathered_parameters(source, torch.device("cpu"))
    assert source.taken == 0
    next(stream)
    assert source.taken == 1


def learner_stand_in(*, main: bool, ranks: int, transfer) -> SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"), is_main_process=main,
                                  num_processes=ranks)
    return SimpleNamespace(accelerator=accelerator, model=model, weight_transfer=transfer)


@pytest.mark.parametrize(("main", "ranks", "transfer", "eager"), [
    (True, 2, "nccl", True),  # TRL's NCCL client, with other ranks to gather with
    (True, 1, "nccl", False),  # one rank: no collective to order, no copy of the model
    (False, 2, None, False),  # another rank walks the gathers as they come
    (True, 2, "filesystem", False),  # the filesystem writer consumes on the caller's thread
])
def test_the_learner_gathers_everything_first_only_for_a_threaded_sender_among_ranks(main, ranks, transfer, eager,
                                                                                    monkeypatch):
    from grpo_trainer.learner import trainer

    chosen = []
    monkeypatch.setattr(trainer, "gathered_before_sending",
                        lambda named, device: chosen.append("first") or gathered_before_sending(named, device))
    monkeypatch.setattr(trainer, "gathered_parameters",
                        lambda named, device: chosen.append("each") or gathered_parameters(named, device))
    sender = {"nccl": object(), "filesystem": FilesystemWeightTransfer.__new__(FilesystemWeightTransfer),
              None: None}[transfer]
    stream = GRPOLearner._streaming_iter(learner_stand_in(main=main, ranks=ranks, transfer=sender))
    assert chosen == ["first" if eager else "each"]
    assert [name for name, _ in stream] == ["weight", "bias"]


def two_ranks(entry: tuple[str, ...], *, config: str = "unused", strategy: str = "fsdp2") -> list[str]:
    """The learner pod's launch line (grpo_trainer.contract.launch) for two CPU ranks on this machine."""
    return learner_argv(config, gang=GangLayout(processes_per_machine=RANKS, main_process_port=free_port()),
                        python=sys.executable, entry=entry, strategy=strategy, device="cpu")


def two_machines(tiny_model_dir: str, out: Path, store_env: dict[str, str], *args: str) -> list[dict]:
    """The scripted scenario under fsdp2 as a learner of two machines (pods) of one rank each, both on this machine,
    each with a checkpoint folder of its own (OUT/machine-K), as pods with an emptyDir each. Each rank's result."""
    port = free_port()
    launched = []
    for machine in range(RANKS):
        folder = out / f"machine-{machine}"
        folder.mkdir(parents=True)
        argv = learner_argv("unused", gang=GangLayout(num_machines=RANKS, machine_rank=machine, main_process_port=port),
                            python=sys.executable, entry=(SCENARIO, "--model", tiny_model_dir, "--out", str(folder),
                                                          *args),
                            strategy="fsdp2", device="cpu")
        log = (folder / "log").open("w")
        launched.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **store_env}),
                         folder))
    for process, folder in launched:
        code = process.wait(timeout=LEARNER_TIMEOUT_S)
        assert code == EXIT_SUCCEEDED, (folder / "log").read_text()[-4000:]
    return [json.loads((out / f"machine-{rank}" / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


def shards(rank: int) -> set[str]:
    return {f"{folder}/__{rank}_0.distcp" for folder in ("pytorch_model_fsdp_0", "optimizer_0")}


@pytest.mark.slow
@pytest.mark.s3
def test_fsdp2_machines_train_sharded_upload_their_own_shards_and_resume_exactly_from_the_store(
        tiny_model_dir, tmp_path, s3_server, s3_bucket, monkeypatch):
    """Two learner machines, each with its own folder (an emptyDir each, nothing shared), checkpoint to the store:
    each uploads its own rank's shards, and the marker, put once both are up, vouches for all of them. Restarted
    with empty folders, both resume from the store's newest complete checkpoint and end as the uninterrupted run;
    an export from the store's newest gathers the shards into the model the run ended with."""
    prefix = "runs/fsdp2"
    run = ("--scenario", "varied", "--prompts", "8", "--save-steps", "2", "--checkpoint-uri",
           f"s3://{s3_bucket}/{prefix}")
    started = time.monotonic()
    whole = two_machines(tiny_model_dir, tmp_path / "whole", s3_server.env(), *run)
    for rank in whole:
        assert rank["outcome"] == "succeeded" and rank["world_size"] == RANKS
        assert rank["sharded_parameters"] == rank["parameters"] > 0  # every parameter an FSDP2 shard (DTensor)
    assert whole[0]["checksum"] == whole[1]["checksum"]  # both ranks gathered the same whole model
    progress = whole[0]["progress"]
    assert progress["groupsConsumed"] == progress["groupsTotal"] == progress["groupsTrained"] == 8
    assert progress["epochsDone"] == 1 and whole[0]["consumed_absolute"] == list(range(8))
    print(f"fsdp2 run of two machines to the bound: {time.monotonic() - started:.0f}s")

    # The trainer's own sharded save: each machine's folder holds its own rank's shards of model and optimizer;
    # machine 0's marker vouches for its folder, and the store's for both machines' files.
    metadata = {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"}
    local = [tmp_path / "whole" / f"machine-{machine}" / "checkpoints" / "checkpoint-2" for machine in range(RANKS)]
    vouched_locally = set(read_marker(str(local[0]))["files"])
    assert shards(0) | metadata <= vouched_locally and not shards(1) & vouched_locally
    assert {p.relative_to(local[1]).as_posix() for p in local[1].rglob("*.distcp")} == shards(1)
    assert not (local[1] / PROGRESS_STATE_FILE).exists()
    client = s3_server.client()
    stored = json.loads(client.get_object(Bucket=s3_bucket,
                                          Key=f"{prefix}/checkpoint-2/{PROGRESS_STATE_FILE}")["Body"].read())
    assert shards(0) | shards(1) | metadata <= set(stored["files"])
    assert stored["digest"] != json.loads((local[0] / PROGRESS_STATE_FILE).read_text())["digest"]

    # The last checkpoint as a kill during its commit leaves it: every file up, no marker. Restarted on new nodes
    # (empty folders), both machines take checkpoint-2 from the store and end where the uninterrupted run ended:
    # every group trained once, the same weights to the bit.
    client.delete_object(Bucket=s3_bucket, Key=f"{prefix}/checkpoint-4/{PROGRESS_STATE_FILE}")
    started = time.monotonic()
    resumed = two_machines(tiny_model_dir, tmp_path / "restarted", s3_server.env(), *run)
    for machine, rank in enumerate(resumed):
        assert rank["resumed_from"] == str(tmp_path / "restarted" / f"machine-{machine}" / "checkpoints" /
                                           "checkpoint-2")
    assert [rank["global_step"] for rank in resumed] == [rank["global_step"] for rank in whole]
    before = set(next(entry for entry in whole[0]["timeline"] if entry["step"] == 2)["stepped"])
    after = set(resumed[0]["stepped_groups"])
    assert not before & after and before | after == set(range(8))
    assert [rank["checksum"] for rank in resumed] == [rank["checksum"] for rank in whole]
    print(f"fsdp2 resume of two machines from the store's checkpoint-2: {time.monotonic() - started:.0f}s")

    # `grporun export` (the export pod) on a new node: the store's newest checkpoint, every rank's shard of it,
    # gathered into one transformers model, the weights the learner ended with.
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    config = RunConfig.model_validate({
        "model": tiny_model_dir, "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "length"}],
        "checkpoint": {"directory": str(tmp_path / "export-pod"), "uri": f"s3://{s3_bucket}/{prefix}"},
        "output": {"directory": str(tmp_path / "exported"), "uri": (tmp_path / "exported").as_uri()}})
    exported = export_from_checkpoint(config)
    assert exported.step == resumed[0]["global_step"]
    model = AutoModelForCausalLM.from_pretrained(exported.path, dtype=torch.float32)
    assert sum(float(p.detach().double().sum()) for p in model.parameters()) == resumed[0]["checksum"]
    # One machine's folder alone holds its own shard only: the export names the shard it lacks.
    with pytest.raises(ExportError, match=r"pytorch_model_fsdp_0: the shards could not be gathered into one model: "
                                          r".*__1_0\.distcp"):
        export_from_checkpoint(config, str(local[0]))

    shard = local[0] / "optimizer_0" / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(MarkerError, match="vouches for optimizer_0/__0_0.distcp, whose content changed"):
        read_marker(str(local[0]))


def entrypoint_run(config_path: Path, log_path: Path, *, strategy: str = "fsdp2") -> tuple[int, float]:
    """`python -m grpo_trainer learner` on two ranks, launched for `strategy` as the learner pod launches it."""
    command = two_ranks(("-m", "grpo_trainer", "learner"), config=str(config_path), strategy=strategy)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=LEARNER_TIMEOUT_S,
                              cwd=REPO).returncode
    return code, time.monotonic() - started


LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_an_fsdp2_learner_pod_trains_to_the_bound_and_vllm_serves_its_consolidated_export(vllm_server, tmp_path,
                                                                                          lora):
    """The tiny example under fsdp2 on two ranks: sharded from the first step, synced whole (gathered from the
    shards) to the server after each step, and exported as one transformers model that from_pretrained loads and
    that is what the server serves. With training.lora the adapter trains sharded, each sync loads it alone, and
    the export merges it into the base weights (the adapter beside them)."""
    from peft import PeftModel

    from grpo_trainer.rollout.weight_sync import adapter_name
    from tests.support.servers.vllm_server import restore_model_weights, sync_weights
    from tests.trainer.rollout.test_weight_sync import greedy_logprob_hf, greedy_logprob_vllm

    restore_model_weights(vllm_server, tmp_path / "model-weights")  # a fresh server's weights, the adapter's base
    config_path, config = tiny_run_config(tmp_path, vllm_server, training__epochs=1.0, training__lora=lora,
                                          learner__strategy="fsdp2", learner__processes_per_node=RANKS)
    code, seconds = entrypoint_run(config_path, tmp_path / "learner.log")
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_SUCCEEDED, log[-4000:]
    assert log.count("fsdp2: all") == RANKS and f"DTensors over {RANKS} ranks" in log  # every rank sharded
    report = termination_report(config)
    prompts = len(PROMPTS.read_text().splitlines())
    assert report.phase == LearnerPhase.SUCCEEDED and report.epochs_done == 1
    assert report.groups_consumed == report.groups_total == prompts
    assert report.groups_trained + report.dropped_total == prompts and report.groups_trained > 0

    final = Path(config.output_dir) / "final"
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert not [name for name in exported.state_dict() if "lora" in name]  # a plain model either way
    untrained = AutoModelForCausalLM.from_pretrained(vllm_server.model, dtype=torch.float32)
    assert greedy_logprob_hf(exported) != pytest.approx(greedy_logprob_hf(untrained), abs=1e-4)  # it trained
    served = vllm_server.model
    if lora is not None:
        assert "weight sync: the adapter alone" in log
        from_adapter = PeftModel.from_pretrained(untrained, final / "adapter").merge_and_unload()
        assert greedy_logprob_hf(from_adapter) == pytest.approx(greedy_logprob_hf(exported), abs=1e-5)
        served = adapter_name(report.weight_syncs)
    # The last sync followed the last step: the server serves the trained policy, which is the export.
    assert greedy_logprob_vllm(vllm_server.url, served) == pytest.approx(greedy_logprob_hf(exported), abs=1e-4)
    if lora is not None:
        # `grporun export` of the run's last checkpoint (its shards of peft's model): the base with the adapter
        # merged in, the adapter beside it; transformers loads it, and the server serves it, as the run's own export.
        output = tmp_path / "exported-again"
        again = export_from_checkpoint(config.model_copy(update={"output": OutputConfig(
            directory=str(output), uri=output.as_uri())}))
        reexported = AutoModelForCausalLM.from_pretrained(again.path, dtype=torch.float32)
        assert (Path(again.path) / "adapter" / "adapter_config.json").exists()
        assert greedy_logprob_hf(reexported) == pytest.approx(greedy_logprob_hf(exported), abs=1e-5)
        sync_weights(vllm_server, reexported.named_parameters(), tmp_path / "reexport-weights")
        assert greedy_logprob_vllm(vllm_server.url, vllm_server.model) == pytest.approx(
            greedy_logprob_hf(reexported), abs=1e-4)
    print(f"fsdp2 {'LoRA ' if lora else ''}run on {RANKS} ranks reached the bound in {seconds:.0f}s: "
          f"{report.message}")


@pytest.mark.slow
@pytest.mark.vllm
def test_an_fsdp2_learner_that_accelerate_runs_as_ddp_refuses_to_train_with_exit_78(vllm_server, tmp_path):
    # The ddp launch line for an fsdp2 spec: accelerate builds a MULTI_CPU state without a plugin, the fallback a
    # launcher or accelerate itself could make silently.
    config_path, config = tiny_run_config(tmp_path, vllm_server, learner__strategy="fsdp2",
                                          learner__processes_per_node=RANKS)
    code, seconds = entrypoint_run(config_path, tmp_path / "learner.log", strategy="ddp")
    log = (tmp_path / "learner.log").read_text(errors="replace")
    assert code == EXIT_INVALID_CONFIG, log[-4000:]
    report = termination_report(config)
    assert report.phase == LearnerPhase.FAILED and report.global_step == 0
    assert report.message.startswith("learner.strategy fsdp2: ") and "\n" not in report.message
    assert "runs the ranks as MULTI_CPU" in report.message
    print(f"refused in {seconds:.0f}s: {report.message}")
