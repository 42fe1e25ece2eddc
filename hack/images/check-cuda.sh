#!/usr/bin/env bash
# Checks the trainer image's CUDA variant where there is no GPU: builds it with build.sh (or finds it in the cache)
# and runs it with podman from the build's store as a cluster runs it (the image's user, no network). Each check runs
# the image's own Python and prints one line; the first that fails ends the script with exit 1.
#   1. the entrypoint: `python -m grpo_trainer --help`;
#   2. the learner venv imports vllm and kernels (TRL's NCCL weight sync, the baked FA3 kernel's loader), the rollout
#      venv imports vllm: on a host without a driver, as a pod's first import does;
#   3. TRL's NCCL weight-transfer client, set up against a stand-in vLLM server's HTTP answers, gets as far as its
#      first CUDA call and ends there with a CUDA/driver error (an ImportError would be a broken image);
#   4. the tree-attention rule (ATTENTION_MODULE) imports, with what its GPU branches load (torch's varlen_attn,
#      kernels.load_kernel, TRL's packing), and chooses fa3/varlen/sdpa as it should for Hopper, Ampere and Turing.
#   Usage: hack/images/check-cuda.sh     (root, as build.sh; TORCH_INDEX_URL, VLLM_WHEEL: build.sh's)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
ATTENTION_MODULE=grpo_trainer.learner.attention

read -r reference _ < <("$here/build.sh" trainer-cuda | tail -n 1)
mapfile -t podman_flags < <("$here/build.sh" --podman-flags)
# Root here may lack CAP_SYS_RESOURCE: podman's default rlimits cannot be set, explicit ones can.
run() {
  podman "${podman_flags[@]}" run --rm --network none --ulimit nofile=16384:16384 --ulimit nproc=16384:16384 \
    -e TRL_EXPERIMENTAL_SILENCE=1 "$@"
}
echo "check-cuda: $reference"

run "$reference" --help | grep -q 'learner' \
  || { echo "check-cuda: FAILED: python -m grpo_trainer --help names no learner role" >&2; exit 1; }
echo "check-cuda: ok: python -m grpo_trainer --help"

versions='import importlib.metadata as m, sys; print(sys.argv[1], *(f"{n} {m.version(n)}" for n in sys.argv[2:]), sep=", ")'
run --entrypoint /opt/learner/bin/python "$reference" -c "import vllm, kernels, trl; $versions" \
  "check-cuda: ok: learner venv: import vllm, kernels" vllm kernels trl torch \
  || { echo "check-cuda: FAILED: the learner venv cannot import vllm or kernels" >&2; exit 1; }
run --entrypoint /opt/rollout/bin/python "$reference" -c "import vllm, grpo_trainer.server.main; $versions" \
  "check-cuda: ok: rollout venv: import vllm" vllm transformers \
  || { echo "check-cuda: FAILED: the rollout venv cannot import vllm" >&2; exit 1; }

nccl_probe='
import json, threading, traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What TRL asks a GPU vLLM server before the NCCL rendezvous, answered as one would; the rendezvous request itself is
# accepted, so the learner side decides the outcome.
ANSWERS = {"/health": {}, "/get_world_size": {"world_size": 1},
           "/server_info": {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}}}

class Front(BaseHTTPRequestHandler):
    def answer(self):
        path = self.path.split("?", 1)[0]
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps(ANSWERS.get(path, {})).encode()
        self.send_response(200 if path in ANSWERS or self.command == "POST" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Front)
threading.Thread(target=server.serve_forever, daemon=True).start()

from accelerate import PartialState
from trl.experimental.async_grpo.vllm_client import VLLMClient
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

PartialState()  # what the learner has made before it builds the client (TRL logs through accelerate)

client = WeightTransferClient(VLLMClient(f"http://127.0.0.1:{server.server_address[1]}", server_timeout=60),
                              {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]})
try:
    client.init_weight_transfer()
except RuntimeError as error:
    cause = error.__cause__ or error
    frames = [f"{frame.filename}:{frame.name}" for frame in traceback.extract_tb(cause.__traceback__)]
    at_cuda = any(frame.endswith("vllm/distributed/weight_transfer/nccl_common.py:trainer_init") for frame in frames)
    message = f"{type(cause).__name__}: {cause}"
    if isinstance(cause, ImportError) or not at_cuda or not any(word in str(cause) for word in ("CUDA", "NVIDIA")):
        raise SystemExit(f"FAILED: the NCCL client did not end at its first CUDA call: {message}\n" + "\n".join(frames))
    print(f"ok: TRL NCCL weight-transfer client: {type(client).__module__}.{type(client).__qualname__} set up to "
          f"vllm trainer_init, ended at its first CUDA call: {message}")
else:
    raise SystemExit("FAILED: the NCCL client set up without a GPU")
'
run --entrypoint /opt/learner/bin/python "$reference" -c "$nccl_probe" | sed 's/^/check-cuda: /'
(( ${PIPESTATUS[0]} == 0 )) || { echo "check-cuda: FAILED: the NCCL weight-transfer probe" >&2; exit 1; }

attention_probe='
import importlib, sys
attention = importlib.import_module(sys.argv[1])
from kernels import load_kernel
from torch.nn.attention.varlen import varlen_attn
from trl.experimental.async_grpo import packing

def choice(capability, fa3_kernel_present):
    facts = attention.DeviceFacts("cuda", capability=capability, fa3_kernel_present=fa3_kernel_present)
    return attention.choose_kernel(attention.AUTO, facts).kernel.value

seen = {"sm90+fa3": choice((9, 0), True), "sm90": choice((9, 0), False), "sm80": choice((8, 0), False),
        "sm75": choice((7, 5), False)}
expected = {"sm90+fa3": "fa3", "sm90": "varlen", "sm80": "varlen", "sm75": "sdpa"}
if seen != expected:
    raise SystemExit(f"FAILED: {sys.argv[1]}.choose_kernel chose {seen}, not {expected}")
print(f"ok: {sys.argv[1]}: GPU branches import (kernels.load_kernel, torch varlen_attn, trl packing); auto chose",
      ", ".join(f"{facts} {kernel}" for facts, kernel in seen.items()))
'
run --entrypoint /opt/learner/bin/python "$reference" -c "$attention_probe" "$ATTENTION_MODULE" | sed 's/^/check-cuda: /'
(( ${PIPESTATUS[0]} == 0 )) || { echo "check-cuda: FAILED: the attention rule's GPU branches" >&2; exit 1; }
echo "check-cuda: all checks passed"
