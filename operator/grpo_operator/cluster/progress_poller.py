"""Read the learner's `GET /progress` (rank 0 serves it on contract.codes.LEARNER_HTTP_PORT).

Called once per reconcile pass of a running run; a short timeout because 50 runs share one event loop and a
learner busy in an optimizer step must not hold the operator up. A failed read returns why it failed: the status
keeps the last report, and after a few failed reads in a row the run's progress is reported as unknown (never as
stalled: a NetworkPolicy or a mesh in the way does not mean the learner stopped training).

The endpoint is inside a tenant's pod, so what it answers is untrusted: the body is read up to MAX_REPORT_BYTES and
parsed under the contract's rules (finite numbers, int64 counts, strict types), and a report that breaks them is
refused, naming the field, instead of reaching the run's status, where the API server would refuse every write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from grpo_trainer.contract.codes import LEARNER_HTTP_PORT, PROGRESS_PATH
from grpo_trainer.contract.report import InvalidReport, ProgressReport, parse_progress

#: (namespace, pod name, pod IP) -> the URL of that pod's /progress. Tests swap in 127.0.0.1 and a local port.
ProgressUrlFn = Callable[[str, str, str], str]
DEFAULT_TIMEOUT_SECONDS = 3.0
#: The most of a /progress body read per poll. A report is a few KiB, and one that lists 1,024 rollout servers (the
#: most status.rollout holds) about 300 KiB (tests/operator/test_progress_poller.py measures it); one operator polls
#: every run on every pass, so a learner answering 50 MiB must not cost it 50 MiB of memory and parsing each time.
MAX_REPORT_BYTES = 1024 * 1024
_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProgressRead:
    """One poll: the learner's report, or why there is none. `invalid`: the learner answered, with a report that
    breaks the contract; unlike a timeout, the next poll will not fix it by itself, so it is shown at once."""

    report: ProgressReport | None
    error: str | None = None
    invalid: bool = False


def pod_progress_url(namespace: str, pod: str, ip: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{LEARNER_HTTP_PORT}{PROGRESS_PATH}"


class _TooLarge(ValueError):
    pass


async def poll_progress(session: aiohttp.ClientSession, url: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                        logger: logging.Logger | logging.LoggerAdapter | None = None) -> ProgressRead:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            return ProgressRead(parse_progress(await _bounded_body(response)))
    except (_TooLarge, InvalidReport) as error:
        reason = f"{url}: {error}" if isinstance(error, _TooLarge) else f"{url}: invalid report: {error}"
        invalid = True
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        reason, invalid = f"{url}: {error or type(error).__name__}", False
    if logger is not None:
        logger.debug(f"no progress from {reason}")
    return ProgressRead(None, reason, invalid)


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes:
    """The body, or _TooLarge as soon as it passes MAX_REPORT_BYTES (announced or not: chunked answers too)."""
    too_large = _TooLarge(f"the report is larger than {MAX_REPORT_BYTES} bytes")
    if response.content_length is not None and response.content_length > MAX_REPORT_BYTES:
        raise too_large
    body = bytearray()
    while chunk := await response.content.read(_CHUNK_BYTES):
        body += chunk
        if len(body) > MAX_REPORT_BYTES:
            raise too_large
    return bytes(body)
