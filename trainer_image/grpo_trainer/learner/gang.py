"""One exit code for a learner pod that runs several processes: `python -m grpo_trainer.learner.gang --ranks N -- ARGV`.

torchrun (accelerate's `--multi_gpu` launcher) turns any failed worker into its own exit 1: two ranks that both
exited 42 (stalled) left a pod that exited 1, and the operator retried a deterministic stall up to backoffLimit.
So the pod's command is this supervisor around accelerate: every rank records the outcome it decided in a directory
the supervisor made (`GRPO_GANG_DIR`), and the supervisor turns the records, with the launcher's own exit status,
into the pod's exit code.

Outcomes every rank reaches together (succeeded, stalled, preempted) are recorded and the rank exits 0, so torchrun
does not tear the other ranks down while they are still finishing (a preemption checkpoint is written by rank 0
after the others are done). Everything else exits with its own code, and torchrun stops the gang at once.

A rank records its outcome last, after its checkpoint or final save. When every rank recorded the same collective
outcome, that is the pod's exit code whatever the launcher says afterwards: a rank's interpreter teardown can still
abort (seen under load: gloo's "terminate called without an active exception", SIGABRT, after the rank had
recorded 75), and torchrun then SIGTERMs the others and exits 1, though the run's work was complete.

It also owns SIGTERM, which Kubernetes sends to the container's first process only: it is passed to the ranks
themselves (they checkpoint and exit as preempted), not to torchrun, whose own handler kills its workers 30 s later.
A rank that starts after the SIGTERM (it registers its pid once its handler is installed) gets it when it
registers: left running, it would wait for its exited peers in the process-group rendezvous until the kubelet's
SIGKILL.

Torch-free: nothing here imports more than the standard library and the contract.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..contract.codes import EXIT_EXPORT_FAILED, EXIT_INVALID_CONFIG, EXIT_PREEMPTED, EXIT_STALLED, EXIT_SUCCEEDED

GANG_DIR_ENV = "GRPO_GANG_DIR"
#: Outcomes all ranks decide at the same micro-batch: a rank records it and exits 0 (see the module docstring).
COLLECTIVE_CODES = frozenset({EXIT_SUCCEEDED, EXIT_STALLED, EXIT_PREEMPTED})
#: Codes the supervisor may report for the gang; anything else a rank or the launcher ends with is a crash.
GANG_CODES = COLLECTIVE_CODES | {EXIT_INVALID_CONFIG, EXIT_EXPORT_FAILED}
EXIT_CRASHED = 1


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _gang_dir() -> Path | None:
    value = os.environ.get(GANG_DIR_ENV)
    return Path(value) if value else None


def record_start() -> None:
    """Called first by a rank: its pid is where the supervisor sends SIGTERM."""
    directory = _gang_dir()
    if directory is not None:
        _write_atomically(directory, f"rank{_rank()}.pid", str(os.getpid()))


def _write_atomically(directory: Path, name: str, text: str) -> None:
    staging = directory / f".{name}"
    staging.write_text(text)
    staging.replace(directory / name)


def record_outcome(code: int) -> int:
    """Record the rank's exit code for the supervisor; returns the code the process should exit with."""
    directory = _gang_dir()
    if directory is None:
        return code
    _write_atomically(directory, f"rank{_rank()}.exit", str(code))
    return EXIT_SUCCEEDED if code in COLLECTIVE_CODES else code


def read_outcomes(directory: Path) -> dict[int, int]:
    return {int(path.stem.removeprefix("rank")): int(path.read_text()) for path in directory.glob("rank*.exit")}


def gang_exit_code(launcher_code: int, outcomes: Mapping[int, int], ranks: int) -> int:
    """The pod's exit code from the launcher's and the ranks' records.

    - every rank recorded the same collective outcome: that outcome (a launcher failure after it is teardown);
    - the ranks that recorded agree on an invalid config: 78 (torchrun stopped the others before they got there);
    - rank 0, which alone writes the trained model, could not export it while every other rank succeeded: 74;
    - anything else, a rank that crashed or one that never recorded, is a crash: the launcher's code, or 1 where
      that code would read as one of ours.
    """
    codes = set(outcomes.values())
    if len(codes) == 1:
        (code,) = codes
        if code in COLLECTIVE_CODES and len(outcomes) == ranks:  # decided and saved by all: see the module doc
            return code
        if code == EXIT_INVALID_CONFIG:
            return code
    others = {code for rank, code in outcomes.items() if rank != 0}
    if outcomes.get(0) == EXIT_EXPORT_FAILED and others <= {EXIT_SUCCEEDED} and len(outcomes) == ranks:
        return EXIT_EXPORT_FAILED
    if launcher_code in GANG_CODES:
        return EXIT_CRASHED
    return launcher_code


class _SigtermRelay:
    """Passes a SIGTERM to every rank that registered, and, after one arrived, to ranks that register later."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.requested = False
        self.signalled: set[str] = set()

    def on_sigterm(self, *_: object) -> None:
        self.requested = True
        self.relay()

    def relay(self) -> None:
        if not self.requested:
            return
        for path in self.directory.glob("rank*.pid"):
            if path.name in self.signalled:
                continue
            self.signalled.add(path.name)
            try:
                os.kill(int(path.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass


#: How often the supervisor looks for ranks that registered after a SIGTERM (a rank starts in seconds).
RELAY_POLL_S = 0.2


def supervise(argv: list[str], ranks: int) -> int:
    with tempfile.TemporaryDirectory(prefix="grpo-gang-") as name:
        directory = Path(name)
        relay = _SigtermRelay(directory)
        signal.signal(signal.SIGTERM, relay.on_sigterm)
        launcher = subprocess.Popen(argv, env={**os.environ, GANG_DIR_ENV: name})
        while True:
            try:
                launcher_code = launcher.wait(RELAY_POLL_S)
                break
            except subprocess.TimeoutExpired:
                relay.relay()
        if launcher_code < 0:  # killed by a signal: report it the way a shell does
            launcher_code = 128 - launcher_code
        outcomes = read_outcomes(directory)
    code = gang_exit_code(launcher_code, outcomes, ranks)
    print(f"grpo gang: launcher exited {launcher_code}, ranks recorded {dict(sorted(outcomes.items()))}; "
          f"exiting {code}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer.learner.gang", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, required=True, help="processes this pod runs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher's argv")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no launcher command after --")
    return supervise(command, args.ranks)


if __name__ == "__main__":
    sys.exit(main())
