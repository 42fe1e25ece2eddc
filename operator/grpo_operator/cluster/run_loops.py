"""One asyncio task per GRPORun, running its reconcile passes one after another, fed the run's latest body by the
watch (handlers.py, `kopf.on.event`).

This is what `kopf.daemon` would do, without its price: kopf puts a finalizer on every object that has a daemon
(so it can stop the daemon before the object goes), and a finalizer makes `kubectl delete grporun` hang whenever
no operator is running. The run's children are owned by it (ownerReferences), so nothing needs the operator at
deletion: the watch's DELETED event cancels the task, and the garbage collector removes the children.

A finished run's loop ends once a pass has nothing left to do, and starts again when the run's spec changes (a new
`metadata.generation`): a TTL set or a `cleanPodPolicy` changed after the run finished still applies, and a watch
event that changes nothing (the run's own status writes, a relist) costs no pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

#: One reconcile pass over the run's latest body; False when the run needs no more passes (finished).
Pass = Callable[[kopf.Body, Any], Awaitable[bool]]

#: How long a shutting-down operator lets a pass in flight finish before cancelling it.
STOP_GRACE_SECONDS = 10.0


class RunLoops:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._bodies: dict[str, kopf.Body] = {}
        self._finished: dict[str, int] = {}  # runs whose last pass said "done" -> the generation that pass saw
        self._stopping = asyncio.Event()

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, uid: object) -> bool:
        """Whether the run `uid` has a loop now (a finished run's loop has ended)."""
        return uid in self._tasks

    def observe(self, uid: str, body: kopf.Body, run_pass: Pass, interval: float, logger: Any) -> None:
        """The run exists as `body`: its loop sees this body from its next pass on; start the loop if none runs."""
        self._bodies[uid] = body
        if uid in self._tasks or self._finished.get(uid) == _generation(body) or self._stopping.is_set():
            return
        self._finished.pop(uid, None)
        meta = body.get("metadata", {})
        self._tasks[uid] = asyncio.create_task(self._loop(uid, run_pass, interval, logger),
                                               name=f"grporun {meta.get('namespace')}/{meta.get('name')}")

    async def _loop(self, uid: str, run_pass: Pass, interval: float, logger: Any) -> None:
        try:
            while not self._stopping.is_set():
                body = self._bodies[uid]
                keep_going = await run_pass(body, logger)
                # An edit that arrived during the pass gets a pass of its own.
                if not keep_going and _generation(self._bodies[uid]) == _generation(body):
                    self._finished[uid] = _generation(body)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), interval)
        finally:
            self._tasks.pop(uid, None)

    def forget(self, uid: str) -> None:
        """The run is gone: stop its loop now (a pass in flight writes to a deleted object and gets 404s)."""
        task = self._tasks.pop(uid, None)
        if task is not None:
            task.cancel()
        self._bodies.pop(uid, None)
        self._finished.pop(uid, None)

    async def stop(self, logger: logging.Logger) -> None:
        """Operator shutdown: let passes in flight finish (up to STOP_GRACE_SECONDS), then cancel the rest."""
        self._stopping.set()
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_SECONDS)
        for task in pending:
            logger.warning("cancelling %s: its pass did not finish within %.0f s", task.get_name(),
                           STOP_GRACE_SECONDS)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _generation(body: kopf.Body) -> int:
    """The spec's version: the API server bumps it on every spec change, never for a status write."""
    return int((body.get("metadata") or {}).get("generation") or 1)
