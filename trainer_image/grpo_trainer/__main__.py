"""`python -m grpo_trainer {rollout,learner,probe} --config run.json`: the entrypoint of both pods.

Imports stay lazy: the rollout role runs in the vLLM image, which has neither trl nor the learner's transformers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
from typing import NoReturn

from pydantic import ValidationError

from .contract.codes import EXIT_EXPORT_FAILED, EXIT_INVALID_CONFIG, EXIT_SUCCEEDED, ROLLOUT_HTTP_PORT
from .contract.config import RunConfig, load_run_config
from .contract.wire import config_error_line
from .learner import gang, preemption

#: A role's outcome is decided (and the learner's recorded) when `main` returns; what follows is the interpreter's
#: teardown, which joins non-daemon threads, multiprocessing's children and its queues' feeder threads. One blocked
#: there (a child that never reads its pipe, a library's thread) held the pod until its grace period's SIGKILL: 137,
#: read as a crash.
TEARDOWN_LIMIT_S = 20.0


def exit_with(code: int) -> NoReturn:
    """The process's end: exit with `code`, and if the teardown is still running after TEARDOWN_LIMIT_S, end it
    with that code anyway, naming what it waits on."""
    timer = threading.Timer(TEARDOWN_LIMIT_S, _exit_after_teardown, args=(code, TEARDOWN_LIMIT_S))
    timer.daemon = True
    timer.start()
    sys.exit(code)


def _exit_after_teardown(code: int, limit_s: float) -> None:
    waiting = [f"thread {t.name!r}" for t in threading.enumerate()
               if not t.daemon and t is not threading.main_thread()]
    waiting += [f"child process {p.name} (pid {p.pid})" for p in multiprocessing.active_children()]
    print(f"grpo: exiting with {code}: the process's teardown was still waiting after {limit_s:.0f}s on "
          f"{', '.join(waiting) or 'something that is neither a thread nor a child process'}",
          file=sys.stderr, flush=True)
    os._exit(code)


def read_config(path: str) -> RunConfig:
    with open(path, encoding="utf-8") as f:
        return load_run_config(f.read())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    rollout = sub.add_parser("rollout", help="run the vLLM rollout server for the run")
    rollout.add_argument("--config", required=True, help="the resolved run config (run.json)")
    rollout.add_argument("--port", type=int, default=ROLLOUT_HTTP_PORT)
    learner = sub.add_parser("learner", help="train: the GRPO learner (one process; accelerate launches several)")
    learner.add_argument("--config", required=True, help="the resolved run config (run.json)")
    export = sub.add_parser("export", help="export the model of the newest complete checkpoint to the run's output "
                            "again (after a failed export)")
    export.add_argument("--config", required=True, help="the resolved run config (run.json)")
    export.add_argument("--checkpoint", help="a checkpoint folder (default: the newest complete one)")
    probe = sub.add_parser("probe", help="exit 0 when the local rollout server generates one token (its liveness)")
    probe.add_argument("--config", required=True, help="the resolved run config (run.json)")
    probe.add_argument("--port", type=int, default=ROLLOUT_HTTP_PORT)
    probe.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for the token (default 30), or with --startup for /health (default 290)")
    probe.add_argument("--startup", action="store_true",
                       help="exit 0 once the server's /health answers (its model is loaded): the startup probe")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "learner":
        preemption.install()
        gang.record_start()
        return gang.record_outcome(learner(args.config))
    try:
        config = read_config(args.config)
    except (OSError, ValidationError) as error:
        print(f"grpo {args.role}: {describe_config_error(args.config, error)}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    if args.role == "export":
        return export(config, args.checkpoint)
    if args.role == "probe":
        if args.startup:
            return startup_probe(args.port, args.timeout)
        return probe(config, args.port, args.timeout)
    from .server.main import main as rollout_main
    from .server.main import refuse
    from .storage.inputs import InputError, resolve

    try:
        config = resolve(config, dataset=False)
    except InputError as error:
        return refuse(f"the model cannot be loaded: {error}", config.termination_message_path)
    return rollout_main(config, port=args.port)


def export(config: RunConfig, checkpoint: str | None) -> int:
    """The export alone (grpo_trainer.storage.reexport): where the model went on stdout, else why not, in one line.
    In a pod the termination message says the same: the ExportReport as JSON (what `grporun export --cluster`
    records on status.output), or the error line."""
    from .storage.model_export import ExportError
    from .storage.reexport import export_from_checkpoint, write_export_message

    try:
        exported = export_from_checkpoint(config, checkpoint)
    except ExportError as error:
        print(f"grpo export: {error}", file=sys.stderr)
        write_export_message(f"grpo export: {error}", config.termination_message_path)
        return EXIT_EXPORT_FAILED
    print(f"grpo export: model exported to {exported.uri} (step {exported.step}, {exported.bytes} bytes, manifest "
          f"sha256 {exported.sha256})")
    write_export_message(exported.model_dump_json(by_alias=True), config.termination_message_path)
    return EXIT_SUCCEEDED


def probe(config: RunConfig, port: int, timeout_s: float | None = None) -> int:
    """A one-token completion from the server on `port`: /health answers for a hung or engine-dead server too."""
    from .contract.rollout_pod import PROBE_TIMEOUT_S
    from .server.health import probe_generation
    from .storage.inputs import local_path

    # The server serves the model under the name it loaded it from (an s3:// model: its place in the inputs cache).
    model = local_path(config.model, config)
    error = probe_generation(f"http://127.0.0.1:{port}", model, timeout_s or PROBE_TIMEOUT_S)
    if error is not None:
        print(f"grpo probe: the rollout server generated no token: {error}", file=sys.stderr)
        return 1
    return 0


def startup_probe(port: int, timeout_s: float | None = None) -> int:
    """Waits for the server on `port` to answer /health: one probe run covers minutes of model load."""
    from .contract.rollout_pod import STARTUP_WAIT_S
    from .server.health import wait_healthy

    error = wait_healthy(f"http://127.0.0.1:{port}", timeout_s or STARTUP_WAIT_S)
    if error is not None:
        print(f"grpo probe: the rollout server has not started: {error}", file=sys.stderr)
        return 1
    return 0


def describe_config_error(path: str, error: OSError | ValidationError) -> str:
    if isinstance(error, OSError):
        return f"cannot read config {path}: {error.strerror}"
    return f"invalid config {path}: {config_error_line(error)}"


def learner(config_path: str) -> int:
    """The learner role's exit code (each rank's; grpo_trainer.learner.gang combines them for a multi-process pod)."""
    try:
        config = read_config(config_path)
    except (OSError, ValidationError) as error:
        print(f"grpo learner: {describe_config_error(config_path, error)}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    from .learner.main import main as learner_main

    return learner_main(config, config_path)


if __name__ == "__main__":
    exit_with(main())
