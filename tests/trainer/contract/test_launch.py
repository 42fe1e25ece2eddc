"""The learner's launch line (grpo_trainer.contract.launch): ddp and fsdp2, read back by accelerate's own launcher."""

from __future__ import annotations

from unittest import mock

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env

from grpo_trainer.contract.launch import GangLayout, learner_argv


def accelerate_args(argv: list[str]):
    """What `accelerate launch` makes of the launch line's own flags (its parser and its checks, nothing started)."""
    start = argv.index("accelerate.commands.launch") + 1
    args = launch_command_parser().parse_args(argv[start:])
    args, _defaults, _mixed_precision_from_config = _validate_launch_command(args)
    return args


def fsdp_plugin_of(argv: list[str]) -> tuple[FullyShardedDataParallelPlugin, dict[str, str]]:
    """The FSDP plugin a launched rank builds: accelerate turns the flags into its environment, the plugin reads it."""
    environment = prepare_multi_gpu_env(accelerate_args(argv))
    with mock.patch.dict("os.environ", environment):
        return FullyShardedDataParallelPlugin(), environment


def test_a_ddp_learner_is_accelerates_multi_gpu_launch_and_a_single_process_runs_alone():
    argv = learner_argv("/c/run.json", gang=GangLayout(num_machines=2, processes_per_machine=4), strategy="ddp")
    args = accelerate_args(argv)
    assert args.multi_gpu and not args.use_fsdp and args.num_processes == 8
    assert learner_argv("/c/run.json", strategy="ddp") == ["python", "-m", "grpo_trainer", "learner",
                                                            "--config", "/c/run.json"]


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_an_fsdp2_learner_launches_under_accelerates_fsdp2_plugin(cpu_offload):
    gang = GangLayout(num_machines=2, processes_per_machine=4, machine_rank=1, main_process_ip="leader")
    argv = learner_argv("/c/run.json", gang=gang, strategy="fsdp2", cpu_offload=cpu_offload)
    assert argv[:6] == ["python", "-m", "grpo_trainer.learner.gang", "--ranks", "4", "--"]
    args = accelerate_args(argv)
    assert args.use_fsdp and not args.multi_gpu
    assert (args.num_machines, args.machine_rank, args.num_processes) == (2, 1, 8)
    plugin, environment = fsdp_plugin_of(argv)
    assert environment["ACCELERATE_USE_FSDP"] == "true"
    assert environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert plugin.fsdp_version == 2
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    assert plugin.reshard_after_forward is True
    assert plugin.cpu_ram_efficient_loading
    assert plugin.transformer_cls_names_to_wrap is None  # the model's own _no_split_modules decide the units
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is cpu_offload  # OffloadPolicy(): none


def test_a_single_fsdp2_process_is_launched_too():
    # One GPU with fsdp2 is how the CPU offload reaches a model the GPU alone cannot hold.
    argv = learner_argv("/c/run.json", strategy="fsdp2", cpu_offload=True)
    args = accelerate_args(argv)
    assert args.use_fsdp and args.num_processes == 1
    assert argv[-5:] == ["-m", "grpo_trainer", "learner", "--config", "/c/run.json"]
