"""Read the learner's `GET /progress` (rank 0 serves it on contract.LEARNER_HTTP_PORT).

Called once per reconcile pass of a running run; a short timeout because 50 runs share one event loop and a
learner busy in an optimizer step must not hold the operator up. A failed read returns why it failed: the status
keeps the last report, and after a few failed reads in a row the run's progress is reported as unknown (never as
stalled: a NetworkPolicy or a mesh in the way does not mean the learner stopped training).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
from pydantic import ValidationError

from grpo_trainer.contract import LEARNER_HTTP_PORT, PROGRESS_PATH, ProgressReport, parse_progress

#: (namespace, pod name, pod IP) -> the URL of that pod's /progress. Tests swap in 127.0.0.1 and a local port.
ProgressUrlFn = Callable[[str, str, str], str]
DEFAULT_TIMEOUT_SECONDS = 3.0


def pod_progress_url(namespace: str, pod: str, ip: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{LEARNER_HTTP_PORT}{PROGRESS_PATH}"


async def poll_progress(session: aiohttp.ClientSession, url: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                        logger: logging.Logger | logging.LoggerAdapter | None = None,
                        ) -> tuple[ProgressReport | None, str | None]:
    """(the learner's report, None), or (None, why it could not be read)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            return parse_progress(await response.text()), None
    except (TimeoutError, aiohttp.ClientError, ValidationError, ValueError) as error:
        reason = f"{url}: {error or type(error).__name__}"
        if logger is not None:
            logger.debug(f"no progress from {reason}")
        return None, reason
