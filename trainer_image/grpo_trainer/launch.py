"""How a learner process is launched: one pure function, used by the operator's pods and by `grporun local`.

Torch-free (the operator imports it). Two traps it exists to avoid, both silent:
- accelerate ignores MASTER_ADDR/RANK-style variables: without explicit --num_machines/--machine_rank/
  --main_process_ip/--main_process_port each node trains alone at world size 1.
- `accelerate launch --cpu` picks accelerate's single-process launcher whatever --num_processes says (checked with
  accelerate 1.15: 2 requested, 1 ran). `--multi_gpu` is accelerate's name for its torchrun launcher; on CPU the
  ranks then join with gloo because the learner's config sets `use_cpu`.
And one that is loud: torchrun reports any failed worker as exit 1, so with several processes the launcher runs under
`grpo_trainer.gang`, which gives the pod the exit code its ranks decided (and passes SIGTERM to the ranks).
"""

from __future__ import annotations

LEARNER_ENTRY = ("-m", "grpo_trainer", "learner")
MAIN_PROCESS_PORT = 29500


def learner_argv(
    config_path: str,
    *,
    num_machines: int = 1,
    processes_per_machine: int = 1,
    machine_rank: int = 0,
    main_process_ip: str = "127.0.0.1",
    main_process_port: int = MAIN_PROCESS_PORT,
    python: str = "python",
    entry: tuple[str, ...] = LEARNER_ENTRY,
) -> list[str]:
    """argv of one learner machine (pod). `entry` is what the launched Python runs (a module or a script)."""
    arguments = [*entry, "--config", config_path] if entry == LEARNER_ENTRY else list(entry)
    world_size = num_machines * processes_per_machine
    if world_size == 1:
        return [python, *arguments]
    return [
        python, "-m", "grpo_trainer.gang", "--ranks", str(processes_per_machine), "--",
        python, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_machines", str(num_machines), "--machine_rank", str(machine_rank),
        "--main_process_ip", main_process_ip, "--main_process_port", str(main_process_port),
        "--num_processes", str(world_size),
        *arguments,
    ]
