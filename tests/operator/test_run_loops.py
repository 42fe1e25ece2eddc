"""RunLoops: one task per run; a finished run's loop ends and starts again only when its spec changes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpo_operator.cluster.run_loops import RunLoops

LOGGER = logging.getLogger(__name__)


def _body(generation: int) -> dict[str, Any]:
    return {"metadata": {"name": "r", "namespace": "ml", "uid": "u", "generation": generation}}


async def _settle(loops: RunLoops) -> None:
    for _ in range(20):
        await asyncio.sleep(0)
        if "u" not in loops:
            return


def test_a_finished_run_gets_a_pass_again_only_when_its_spec_changes():
    async def scenario() -> list[int]:
        seen: list[int] = []

        async def finished_pass(body: Any, logger: Any) -> bool:
            seen.append(body["metadata"]["generation"])
            return False
        loops = RunLoops()
        loops.observe("u", _body(1), finished_pass, 0.01, LOGGER)
        await _settle(loops)
        loops.observe("u", _body(1), finished_pass, 0.01, LOGGER)  # its own status write: nothing to do
        await _settle(loops)
        loops.observe("u", _body(2), finished_pass, 0.01, LOGGER)  # a TTL set, a cleanPodPolicy changed
        await _settle(loops)
        return seen
    assert asyncio.run(scenario()) == [1, 2]


def test_an_edit_that_arrives_during_the_last_pass_gets_a_pass_of_its_own():
    async def scenario() -> list[int]:
        seen: list[int] = []
        edited = asyncio.Event()

        async def finished_pass(body: Any, logger: Any) -> bool:
            seen.append(body["metadata"]["generation"])
            await edited.wait()
            return False
        loops = RunLoops()
        loops.observe("u", _body(1), finished_pass, 0.01, LOGGER)
        await asyncio.sleep(0)
        loops.observe("u", _body(2), finished_pass, 0.01, LOGGER)  # the loop runs: it only takes the body
        edited.set()
        await asyncio.wait_for(_wait_done(loops), 5)
        return seen
    assert asyncio.run(scenario()) == [1, 2]


async def _wait_done(loops: RunLoops) -> None:
    while "u" in loops:
        await asyncio.sleep(0.01)
