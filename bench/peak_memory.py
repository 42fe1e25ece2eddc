"""`python -m bench.peak_memory OUT_DIR learner --config run.json`: the learner's own entrypoint (`python -m
grpo_trainer ...`) run in this process, then this rank's peak memory written to `OUT_DIR/peak-rank{RANK}.json`.

The learner reports no allocator figures, and nvidia-smi's per-process memory holds the CUDA context and the
allocator's cache. What is recorded once the learner's `main` has returned (before the interpreter's teardown, which
grpo_trainer's `exit_with` may cut short): `torch.cuda.max_memory_allocated` and `max_memory_reserved` of the rank's
GPU (LOCAL_RANK, as accelerate assigns it; null without CUDA) and the process's peak resident memory. The exit code
is the learner's. accelerate launches it like the learner (`-m bench.peak_memory OUT_DIR learner --config ...`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeakMemory:
    rank: int
    cuda_allocated: int | None  # bytes
    cuda_reserved: int | None
    max_rss: int  # bytes


def peak_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"peak-rank{rank}.json"


def measure() -> PeakMemory:
    rank = int(os.environ.get("RANK", "0"))
    allocated = reserved = None
    torch = sys.modules.get("torch")  # the learner imported it; this process never starts CUDA itself
    if torch is not None and torch.cuda.is_initialized():
        device = int(os.environ.get("LOCAL_RANK", "0"))
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return PeakMemory(rank, allocated, reserved, max_rss)


def read_peaks(out_dir: Path) -> list[PeakMemory]:
    """Every rank's record in `out_dir`, by rank."""
    return sorted((PeakMemory(**json.loads(path.read_text())) for path in out_dir.glob("peak-rank*.json")),
                  key=lambda peak: peak.rank)


def main(argv: list[str]) -> None:
    from grpo_trainer.__main__ import exit_with
    from grpo_trainer.__main__ import main as grpo_main

    out_dir, learner_argv = Path(argv[0]), argv[1:]
    code = grpo_main(learner_argv)
    peak = measure()
    out_dir.mkdir(parents=True, exist_ok=True)
    peak_path(out_dir, peak.rank).write_text(json.dumps(asdict(peak)))
    exit_with(code)


if __name__ == "__main__":
    main(sys.argv[1:])
