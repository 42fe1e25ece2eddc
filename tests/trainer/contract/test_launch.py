"""The learner's launch line (grpo_trainer.contract.launch): ddp and fsdp2, read back by accelerate's own launcher."""

from __future__ import annotations

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

from grpo_trainer.contract.launch import GangLayout, learner_argv


def accelerate_args(argv: list[str]):
    """What `accelerate launch` makes of the launch line's own flags (its parser and its checks, nothing started)."""
    start = argv.index("accelerate.commands.launch") + 1
    args = launch_command_parser().parse_args(argv[start:])
    args, _defaults, _mixed_precision_from_config = _validate_launch_command(args)
    return args


def test_a_ddp_learner_is_accelerates_multi_gpu_launch_and_a_single_process_runs_alone():
    argv = learner_argv("/c/run.json", gang=GangLayout(num_machines=2, processes_per_machine=4), strategy="ddp")
    args = accelerate_args(argv)
    assert args.multi_gpu and not args.use_fsdp and args.num_processes == 8
    assert learner_argv("/c/run.json", strategy="ddp") == ["python", "-m", "grpo_trainer", "learner",
                                                            "--config", "/c/run.json"]


@pytest.mark.parametrize(("device", "cpu_offload", "precision"),
                         [("cuda", False, "bf16"), ("cuda", True, "bf16"), ("cpu", False, "no")])
def test_an_fsdp2_learners_flags_reach_every_machine_with_its_devices_precision(device, cpu_offload, precision):
    # That the ranks then train sharded is what real runs show (tests/trainer/learner/test_fsdp2.py); this is what
    # they cannot: several machines, and the GPU's offload and bf16.
    gang = GangLayout(num_machines=2, processes_per_machine=4, machine_rank=1, main_process_ip="leader")
    argv = learner_argv("/c/run.json", gang=gang, strategy="fsdp2", cpu_offload=cpu_offload, device=device)
    assert argv[:6] == ["python", "-m", "grpo_trainer.learner.gang", "--ranks", "4", "--"]
    args = accelerate_args(argv)
    assert args.use_fsdp and not args.multi_gpu
    assert (args.num_machines, args.machine_rank, args.num_processes) == (2, 1, 8)
    environment = prepare_multi_gpu_env(args)
    assert (environment["ACCELERATE_USE_FSDP"], environment["FSDP_VERSION"]) == ("true", "2")
    assert environment["ACCELERATE_MIXED_PRECISION"] == precision
    assert environment["FSDP_OFFLOAD_PARAMS"] == str(cpu_offload).lower()


def test_a_single_fsdp2_process_is_launched_too():
    # One GPU with fsdp2 is how the CPU offload reaches a model the GPU alone cannot hold.
    argv = learner_argv("/c/run.json", strategy="fsdp2", cpu_offload=True)
    args = accelerate_args(argv)
    assert args.use_fsdp and args.num_processes == 1
    assert argv[-5:] == ["-m", "grpo_trainer", "learner", "--config", "/c/run.json"]
