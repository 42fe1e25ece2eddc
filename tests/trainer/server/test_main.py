"""The rollout entrypoint: the vLLM command line it builds, and how it runs the server (signals, exit code)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from grpo_trainer.__main__ import main as entry_main
from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, ROLLOUT_HTTP_PORT
from grpo_trainer.contract.config import RunConfig, TrainingConfig
from grpo_trainer.server.main import SERVER_MODULE, build_server_command


def run_config(training: dict | None = None, **rollout) -> RunConfig:
    return RunConfig.model_validate({
        "model": "/models/tiny", "dataset": {"path": "p.jsonl"}, "rewards": [{"name": "constant"}],
        "rollout": rollout, "training": training or {},
    })


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gpu_server_gets_nccl_weight_transfer_and_the_run_sizes():
    config = run_config(maxModelLen=4096, gpuMemoryUtilization=0.85, tensorParallelSize=2)
    argv, env = build_server_command(config, port=8123, python="/py")
    assert argv[:3] == ["/py", "-m", SERVER_MODULE]
    assert flag(argv, "--model") == "/models/tiny"
    assert flag(argv, "--port") == "8123"
    assert flag(argv, "--max-model-len") == "4096"
    assert flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "--dtype" not in argv  # the model's own dtype on GPU
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_cpu_server_with_filesystem_sync_serves_float32_and_a_small_kv_cache():
    config = run_config(device="cpu", weightSync={"mode": "filesystem", "directory": "/w"})
    argv, env = build_server_command(config)
    assert "--weight-transfer-config" not in argv  # no CPU transfer engine: reload_weights does the sync
    assert flag(argv, "--dtype") == "float32"
    assert flag(argv, "--port") == str(ROLLOUT_HTTP_PORT)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1


def test_cpu_server_never_chunks_a_prefill_and_its_budget_holds_the_longest_prompt():
    # A chunked prefill of a seeded request kills vllm-cpu's engine (tests/trainer/server/test_cpu_engine_stress.py).
    for max_model_len in (128, 8192):
        config = run_config(device="cpu", maxModelLen=max_model_len,
                            weightSync={"mode": "filesystem", "directory": "/w"})
        argv, _ = build_server_command(config)
        assert "--no-enable-chunked-prefill" in argv
        assert int(flag(argv, "--max-num-batched-tokens")) >= max_model_len
    gpu_argv, _ = build_server_command(run_config())
    assert "--no-enable-chunked-prefill" not in gpu_argv  # CUDA generators rewind fine


@pytest.mark.parametrize("rank, served_rank", [(1, 1), (4, 8), (16, 16), (17, 32), (300, 320)])
def test_an_adapter_synced_run_serves_with_lora_its_rank_and_a_slot_per_version_in_flight(rank, served_rank):
    config = run_config(training={"maxStaleness": 3, "lora": {"r": rank}}, device="cpu",
                        weightSync={"mode": "filesystem", "directory": "/w"})
    argv, env = build_server_command(config)
    assert "--enable-lora" in argv
    assert flag(argv, "--max-lora-rank") == str(served_rank)  # the smallest rank vLLM builds buffers for
    # versions max_staleness back are still requested, and the next one is loaded before the oldest goes
    assert flag(argv, "--max-loras") == flag(argv, "--max-cpu-loras") == "5"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


@pytest.mark.parametrize("training", [{}, {"lora": {"r": 8, "sync": "merged"}}], ids=["full", "merged-lora"])
def test_a_run_that_syncs_whole_weights_serves_without_lora(training):
    argv, env = build_server_command(run_config(training=training))
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_extra_args_come_last_so_they_override():
    config = run_config(extraArgs=["--max-num-seqs", "4", "--enforce-eager"])
    argv, _ = build_server_command(config)
    assert argv[-3:] == ["--max-num-seqs", "4", "--enforce-eager"]


def test_the_rollout_path_imports_neither_trl_nor_transformers():
    # The rollout image has vLLM's own transformers and no trl: importing the learner there would break.
    code = textwrap.dedent("""
        import sys
        import grpo_trainer.__main__, grpo_trainer.server.main
        bad = sorted(m for m in ("trl", "transformers", "torch") if m in sys.modules)
        print(",".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_invalid_config_exits_78_with_one_line_naming_the_field(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "m", "dataset": {"path": "p"}, "rewards": [{"name": "constant"}],
                                "training": {"epochs": 0}}))
    assert entry_main(["rollout", "--config", str(path)]) == EXIT_INVALID_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "training.epochs" in err


def test_missing_config_exits_78(tmp_path, capsys):
    assert entry_main(["learner", "--config", str(tmp_path / "nope.json")]) == EXIT_INVALID_CONFIG
    assert "cannot read config" in capsys.readouterr().err


FAKE_SERVER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print("ready", flush=True)
time.sleep(60)
"""


def test_serve_forwards_sigterm_and_exits_with_the_server_code(tmp_path):
    # A real child stands in for vLLM: serve() must pass SIGTERM on and return the child's own exit code.
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    runner = textwrap.dedent(f"""
        import sys
        from grpo_trainer.server.main import serve
        sys.exit(serve([sys.executable, {str(script)!r}], {{}}))
    """)
    process = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 7


def test_serve_reports_a_killed_server_as_128_plus_signal(tmp_path):
    runner = textwrap.dedent("""
        import sys
        from grpo_trainer.server.main import serve
        sys.exit(serve([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {}))
    """)
    assert subprocess.run([sys.executable, "-c", runner], timeout=30).returncode == 128 + signal.SIGKILL


# One interpreter parses every command line: importing vLLM is most of the cost (about 20 s here).
VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.loads(sys.argv[1]):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    print(json.dumps({"model": args.model, "port": args.port, "max_model_len": args.max_model_len,
                      "transfer": str(args.weight_transfer_config), "dtype": args.dtype,
                      "lora": [args.enable_lora, args.max_lora_rank, args.max_loras]}))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_parser_accepts_both_command_lines():
    from tests.support.servers.vllm_server import require_rollout_python

    python = require_rollout_python()
    gpu = run_config(maxModelLen=2048)
    cpu = run_config(training={"lora": {"r": 4}}, device="cpu", maxModelLen=128,
                     weightSync={"mode": "filesystem", "directory": "/w"})
    server_args = []
    for config in (gpu, cpu):
        argv, _ = build_server_command(config, port=8123)
        server_args.append(argv[argv.index(SERVER_MODULE) + 1:])
    out = subprocess.run([str(python), "-c", VLLM_PARSE, json.dumps(server_args)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = [json.loads(line) for line in out.stdout.strip().splitlines()[-2:]]
    assert parsed[0]["transfer"] == "WeightTransferConfig(backend='nccl')" and parsed[0]["max_model_len"] == 2048
    assert parsed[1]["dtype"] == "float32" and parsed[1]["port"] == 8123
    assert parsed[1]["lora"] == [True, 8, TrainingConfig().max_staleness + 2]
