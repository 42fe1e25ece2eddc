"""What a user's pod does with a model a GRPORun exported to a volume: run in the trainer image (the learner venv's
python, `python exported_model_reader.py MODEL_DIR`), it checks the files against the manifest, loads the model with
transformers, then serves the same folder with the vLLM CPU server (the rollout venv, which the image's
GRPO_ROLLOUT_PYTHON names) and asks it for a completion.
It prints one line, RESULT_PREFIX then JSON: the manifest's sha256, the step, and both engines' greedy logprob of the
next token after PROMPT and their greedy continuations. The pod's log holds stderr too, where a warning may come after
that line (multiprocessing's resource tracker, as vLLM's child ends): the prefix finds it
(tests/support/node/node_runs.reader_result). Any failure is a traceback and a non-zero exit (the test shows the
pod's log).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from grpo_trainer.contract.codes import EXPORT_MANIFEST_FILE
from grpo_trainer.contract.rollout_pod import ROLLOUT_PYTHON_ENV
from grpo_trainer.server.main import CPU_KVCACHE_SPACE_GIB, SERVER_MODULE, cpu_scheduler_flags
from grpo_trainer.storage.model_export import verify_export

PORT = 8011
PROMPT = [1, 2, 3, 4, 5]  # token ids: the tiny model's tokenizer has no words worth spelling
NEW_TOKENS = 8
RESULT_PREFIX = "exported model read: "
MAX_MODEL_LEN = 256
SERVER_START_TIMEOUT_S = 600


def with_transformers(model_dir: str) -> dict:
    import torch  # here, not at the top: the tests import RESULT_PREFIX from this file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    AutoTokenizer.from_pretrained(model_dir)  # the tokenizer is part of the export
    with torch.no_grad():
        logprob = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).max().item()
        # Greedy through end-of-sequence tokens, as the server's `ignore_eos` request is: `generate` would stop at the
        # first one (a model that answers with one at once, as the tiny tool model may, gave 1 token against 8).
        tokens = list(PROMPT)
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return {"logprob": logprob, "tokens": tokens[len(PROMPT):]}


def post(url: str, body: dict, timeout: float = 120) -> dict:
    """A JSON POST to the pod's own server (http, loopback)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return json.load(response)


def with_vllm(model_dir: str) -> dict:
    server = subprocess.Popen(
        [os.environ[ROLLOUT_PYTHON_ENV], "-m", SERVER_MODULE, "--model", model_dir, "--host", "127.0.0.1",
         "--port", str(PORT), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
         *cpu_scheduler_flags(MAX_MODEL_LEN)],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(CPU_KVCACHE_SPACE_GIB)})
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                sys.exit(f"the vLLM server exited {server.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"the vLLM server was not ready in {SERVER_START_TIMEOUT_S} s")
                time.sleep(1)
        url = f"http://127.0.0.1:{PORT}/v1/completions"
        # The server answers /health before its first request has built the CPU kernels it runs (a C++ compile: over
        # two minutes on a loaded machine), so the first request is part of its start-up and has that deadline.
        first = post(url, {"model": model_dir, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1},
                     timeout=max(deadline - time.monotonic(), 120))
        text = post(url, {"model": model_dir, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                          "ignore_eos": True, "return_token_ids": True})
        return {"logprob": first["choices"][0]["logprobs"]["token_logprobs"][0],
                "tokens": text["choices"][0]["token_ids"]}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    model_dir = sys.argv[1]
    manifest = verify_export(model_dir)  # every file as the manifest lists it, or ExportError
    result = {"sha256": hashlib.sha256((Path(model_dir) / EXPORT_MANIFEST_FILE).read_bytes()).hexdigest(),
              "step": manifest["step"], "files": sorted(entry["path"] for entry in manifest["files"]),
              "transformers": with_transformers(model_dir), "vllm": with_vllm(model_dir)}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
