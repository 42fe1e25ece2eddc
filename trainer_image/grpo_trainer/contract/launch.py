"""How a learner process is launched: one pure function, used by the operator's pods and by `grporun local`.

Torch-free (the operator imports it). Two traps it exists to avoid, both silent:
- accelerate ignores MASTER_ADDR/RANK-style variables: without explicit --num_machines/--machine_rank/
  --main_process_ip/--main_process_port each node trains alone at world size 1.
- `accelerate launch --cpu` picks accelerate's single-process launcher whatever --num_processes says (checked with
  accelerate 1.15: 2 requested, 1 ran). `--multi_gpu` is accelerate's name for its torchrun launcher; on CPU the
  ranks then join with gloo because the learner's config sets `use_cpu`.
- `accelerate launch --use_fsdp` on a CPU run: accelerate (1.15) applies its FSDP plugin to GPU-type runs only, so
  a `use_cpu` learner stays DDP; the config refuses fsdp2 on CPU (contract.config.LearnerConfig).
And one that is loud: torchrun reports any failed worker as exit 1, so with several processes the launcher runs under
`grpo_trainer.learner.gang`, which gives the pod the exit code its ranks decided (and passes SIGTERM to the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

LEARNER_ENTRY = ("-m", "grpo_trainer", "learner")
MAIN_PROCESS_PORT = 29500


@dataclass(frozen=True)
class GangLayout:
    """Where one learner machine (pod) sits in the run's gang: how many machines and ranks per machine, which
    machine this is, and where machine 0 waits for the others to join."""

    num_machines: int = 1
    processes_per_machine: int = 1
    machine_rank: int = 0
    main_process_ip: str = "127.0.0.1"
    main_process_port: int = MAIN_PROCESS_PORT


ONE_PROCESS = GangLayout()


def learner_argv(
    config_path: str,
    *,
    gang: GangLayout = ONE_PROCESS,
    python: str = "python",
    entry: tuple[str, ...] = LEARNER_ENTRY,
    strategy: str = "ddp",
    cpu_offload: bool = False,
) -> list[str]:
    """argv of one learner machine (pod). `entry` is what the launched Python runs (a module or a script).

    `strategy` is `learner.strategy`: ddp launches plain data-parallel ranks; fsdp2 launches them under accelerate's
    FSDP2 plugin (`fsdp_flags`), also for a single process, where sharding over one rank leaves the CPU offload."""
    arguments = [*entry, "--config", config_path] if entry == LEARNER_ENTRY else list(entry)
    world_size = gang.num_machines * gang.processes_per_machine
    if world_size == 1 and strategy == "ddp":
        return [python, *arguments]
    mode = ["--multi_gpu"] if strategy == "ddp" else fsdp_flags(cpu_offload=cpu_offload)
    return [
        python, "-m", "grpo_trainer.learner.gang", "--ranks", str(gang.processes_per_machine), "--",
        python, "-m", "accelerate.commands.launch", *mode,
        "--num_machines", str(gang.num_machines), "--machine_rank", str(gang.machine_rank),
        "--main_process_ip", gang.main_process_ip, "--main_process_port", str(gang.main_process_port),
        "--num_processes", str(world_size),
        *arguments,
    ]


def fsdp_flags(*, cpu_offload: bool) -> list[str]:
    """accelerate's FSDP2 plugin (each flag as `accelerate launch --help` of 1.15 spells it).

    - one FSDP unit per decoder layer: TRANSFORMER_BASED_WRAP without a class list takes the model's own
      `_no_split_modules` (its decoder layer class), so any transformers causal LM wraps without naming it here;
    - reshard after forward: a layer's full weights live only while it computes (the memory FSDP2 is chosen for);
    - SHARDED_STATE_DICT: each rank writes its own shard of a checkpoint (torch.distributed.checkpoint), no rank
      gathers the whole model to save; the final model is gathered once, by grpo_trainer.learner.main;
    - cpu_ram_efficient_loading: rank 0 alone reads the checkpoint and the other ranks get their shards from it, so
      a node holds the model in CPU memory once, not once per rank (the launcher refuses it without
      sync_module_states, which FSDP2 itself no longer reads);
    - bf16 mixed precision: the layers compute, and the gradients are reduced, in bf16 (accelerate's FSDP2 policy
      for bf16), while the sharded master weights and the optimizer stay fp32.
    """
    return [
        "--use_fsdp", "--fsdp_version", "2",
        "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_reshard_after_forward", "true",
        "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
        "--fsdp_cpu_ram_efficient_loading", "true",
        "--fsdp_sync_module_states", "true",
        "--fsdp_offload_params", "true" if cpu_offload else "false",
        "--mixed_precision", "bf16",
    ]
