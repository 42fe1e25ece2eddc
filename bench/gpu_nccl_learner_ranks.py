"""GPU check, not run by the tests or `python -m bench`: does NCCL weight sync work from several learner ranks?

`grporun validate` and the CRD refuse `rollout.weightSync.mode: nccl` with more than one learner process until this
check passes on GPUs (docs/learner.md, "Weight sync"). It needs 3 GPUs on one machine: learner ranks on GPUs 0 and 1,
the vLLM server on GPU 2, and the GPU image's environment (vLLM, TRL). It runs the learner and the rollout server
through the pods' own entrypoints on the tiny model (built offline), with the weight-sync deadline as the watchdog:

    python bench/gpu_nccl_learner_ranks.py [--workdir DIR] [--deadline 120] [--epochs 3]

Pass: the learner exits 0, every rank synced (its report counts syncs past the cold one) and the server serves the
learner's last weight version. A hang shows as exit 42 with `stallCause: weight_sync` in the report (the
interleaved-send deadlock of TRL 1.16's multi-rank `_sync_weight`); anything else prints the logs' tails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
LEARNER_GPUS, SERVER_GPU = "0,1", "2"


def run_config(model: str, prompts: Path, url: str, workdir: Path, deadline: int, epochs: float) -> dict:
    from grpo_trainer.contract.config import (
        CheckpointConfig,
        DatasetConfig,
        LearnerConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
        TrainingConfig,
        WeightSyncConfig,
    )

    config = RunConfig(
        run_name="nccl-ranks", model=model,
        dataset=DatasetConfig(path=str(prompts)), rewards=[RewardConfig(name="letter_a_fraction")],
        training=TrainingConfig(epochs=epochs, num_generations=8, per_device_train_batch_size=8,
                                max_completion_length=16, token_budget=512, learning_rate=1e-2),
        rollout=RolloutConfig(urls=[url], max_model_len=128, gpu_memory_utilization=0.2, device="cuda",
                              weight_sync=WeightSyncConfig(mode="nccl", deadline_seconds=deadline)),
        learner=LearnerConfig(nodes=1, processes_per_node=2, device="cuda", http_port=0),
        checkpoint=CheckpointConfig(directory=str(workdir / "checkpoints"), save_steps=1000),
        output_dir=str(workdir / "out"), termination_message_path=str(workdir / "termination.json"),
    )
    return config.to_wire()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--deadline", type=int, default=120, help="rollout.weightSync.deadlineSeconds")
    parser.add_argument("--epochs", type=float, default=3)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="nccl-ranks-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from grpo_operator.local.processes import free_port
    from grpo_trainer.contract.launch import GangLayout, learner_argv
    from grpo_trainer.testing.tiny_assets import build_tiny_model

    model = str(build_tiny_model(workdir / "model"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config_path = workdir / "run.json"
    config_path.write_text(json.dumps(run_config(model, ROOT / "examples" / "tiny-prompts.jsonl", url, workdir,
                                                 args.deadline, args.epochs)))
    server_log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    server = subprocess.Popen([sys.executable, "-m", "grpo_trainer", "rollout", "--config", str(config_path),
                               "--port", str(port)], stdout=server_log, stderr=subprocess.STDOUT,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": SERVER_GPU}, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print((workdir / "server.log").read_text(errors="replace")[-4000:])
                print("FAIL: the vLLM server did not start")
                return 2
            time.sleep(2)
        argv = learner_argv(str(config_path), gang=GangLayout(processes_per_machine=2, main_process_port=free_port()),
                            python=sys.executable)
        with open(workdir / "learner.log", "wb") as learner_log:
            learner = subprocess.run(argv, stdout=learner_log, stderr=subprocess.STDOUT, timeout=3600,
                                     env={**os.environ, "CUDA_VISIBLE_DEVICES": LEARNER_GPUS})
        report = json.loads((workdir / "termination.json").read_text())
        served = requests.get(f"{url}/weight_info", timeout=10).json().get("weight_version")
        print(json.dumps({"exit": learner.returncode, "phase": report["phase"], "stallCause": report.get("stallCause"),
                          "weightSyncs": report["weightSyncs"], "weightSyncSeconds": report["weightSyncSeconds"],
                          "weightVersion": report["weightVersion"], "served": served,
                          "message": report["message"]}, indent=1))
        works = learner.returncode == 0 and report["weightSyncs"] > 1
        if not works:
            print((workdir / "learner.log").read_text(errors="replace")[-6000:])
        print("PASS: NCCL weight sync works from 2 learner ranks" if works else "FAIL")
        return 0 if works else 1
    finally:
        server.terminate()
        server.wait(timeout=60)
        server_log.close()


if __name__ == "__main__":
    sys.exit(main())
