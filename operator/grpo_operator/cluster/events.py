"""The run's Events, aggregated the way the Kubernetes event recorder (client-go's `record` package) does it.

The status package emits an event on a transition; when the same event comes again for the same run (same type,
reason and message: a progress endpoint that flaps, a cause that returns), it is counted on the Event already
posted (`count` and `lastTimestamp`, what `kubectl get events` shows as `(x5 over 2m)`) instead of adding one
object per occurrence. As in client-go, the posted Events are remembered in memory, a bounded LRU: after an operator
restart, or once the API server has expired the Event (1 h by default), the next occurrence posts a new one.

Events are auxiliary: a refused post or patch is logged and the pass goes on (kopf and client-go do the same).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
from kopf._cogs.clients import errors

from ..apitime import format_time
from ..status import Event
from .kube import Kube

#: Posted Events remembered for aggregation (client-go's maxLruCacheEntries).
CACHE_SIZE = 4096
#: Longer messages are cut in the middle (the length kopf cut event messages to).
MAX_MESSAGE_CHARS = 1024
COMPONENT = "grpo-operator"


@dataclass
class _Posted:
    name: str
    count: int


def _short(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = (MAX_MESSAGE_CHARS - 3) // 2
    return f"{message[:half]}...{message[-half:]}"


class EventRecorder:
    def __init__(self, cache_size: int = CACHE_SIZE):
        self._posted: OrderedDict[tuple[str, str, str, str], _Posted] = OrderedDict()
        self._cache_size = cache_size

    async def record(self, kube: Kube, body: Any, event: Event, now: datetime.datetime,
                     logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Post `event` about the object `body`, or count it on the same Event posted before."""
        metadata = body["metadata"]
        namespace, message, stamp = metadata["namespace"], _short(event.message), format_time(now)
        key = (metadata["uid"], event.type, event.reason, message)
        try:
            posted = self._posted.get(key)
            if posted is not None and await kube.patch("v1", "Event", namespace, posted.name,
                                                       {"count": posted.count + 1, "lastTimestamp": stamp}):
                posted.count += 1
                self._posted.move_to_end(key)
                return
            name = f"{metadata['name']}.{time.time_ns():x}"  # client-go's naming: the object's name and a time
            await kube.create({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": metadata["name"],
                                   "namespace": namespace, "uid": metadata["uid"]},
                "type": event.type, "reason": event.reason, "message": message,
                "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
            })
        except (errors.APIError, aiohttp.ClientError, TimeoutError) as error:
            logger.warning(f"could not post the event {event.reason} ({event.type}): {error}")
            return
        self._posted[key] = _Posted(name, 1)
        self._posted.move_to_end(key)
        while len(self._posted) > self._cache_size:
            self._posted.popitem(last=False)
