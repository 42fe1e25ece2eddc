"""Why a run's pod runs but is not ready, as the kubelet tells it: its probe failures are Events on the pod (reason
`Unhealthy`, `Readiness probe failed: Get "http://10.0.0.5:8765/health": dial tcp ...: connect: connection refused`),
counted on one Event while they repeat. The pod's own status says only `ContainersNotReady`.

Events are read for a pod only while it runs and is not ready, once when it turns so and then at most every
`REFRESH_SECONDS`: a run's pass every few seconds does not become a list request per pod. They are auxiliary: without
the permission to list them (a 403: an older chart's RBAC), or when the read fails, the run's conditions say what the
pods say. A refusal is logged once per operator process, and no Events are read for `REFUSED_RETRY_SECONDS` after it
(kopf logs every refused request as an error: reading on would log one per unready pod and refresh).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from ..apitime import parse_time
from ..status import PodObservation, ProbeFailure
from .kube import APIClientError, Kube
from .pods import PodFacts

#: How long a pod's probe failure, as last read, stands before its Events are read again.
REFRESH_SECONDS = 30.0
#: The bound on one list of a pod's Events (no retry: the next refresh is the retry).
LIST_TIMEOUT_SECONDS = 5.0
#: How long a refused list (403) stops every read of Events, for all runs: RBAC granted later is found within it.
REFUSED_RETRY_SECONDS = 600.0
#: The kubelet's words for a probe that failed (`errored`: the probe itself could not run).
_PROBE_FAILED = re.compile(r"^(Readiness|Liveness|Startup) probe (?:failed|errored): ?(.*)$", re.DOTALL)


def probe_failure_of(event: Mapping[str, Any]) -> tuple[datetime.datetime, ProbeFailure] | None:
    """An `Unhealthy` Event as (when it last happened, the failure); None for another Event or a torn one. Read from
    the core/v1 fields the kubelet writes (count, first and last timestamps), or from an events.k8s.io series."""
    match = _PROBE_FAILED.match(str(event.get("message") or ""))
    if event.get("reason") != "Unhealthy" or match is None:
        return None
    series = event.get("series") if isinstance(event.get("series"), Mapping) else {}
    count = event.get("count") or series.get("count") or 1
    first = event.get("firstTimestamp") or event.get("eventTime")
    last = event.get("lastTimestamp") or series.get("lastObservedTime") or first
    try:
        first_at, last_at = parse_time(str(first)), parse_time(str(last))
    except ValueError:
        return None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    seconds = max(0.0, (last_at - first_at).total_seconds())
    return last_at, ProbeFailure(match[1].lower(), match[2], count, seconds)


def latest_probe_failure(events: Iterable[Mapping[str, Any]]) -> ProbeFailure | None:
    """The probe failure among a pod's Events that happened last."""
    failures = [read for event in events if (read := probe_failure_of(event)) is not None]
    return max(failures, key=lambda read: read[0])[1] if failures else None


@dataclasses.dataclass(frozen=True)
class _Read:
    at: datetime.datetime
    failure: ProbeFailure | None


@dataclasses.dataclass
class ProbeFailureMemory:
    """One run's last read of each not-ready pod's Events, by pod uid (a pod that turned ready is forgotten)."""

    reads: dict[str, _Read] = dataclasses.field(default_factory=dict)


class ProbeEvents:
    """Reads the probe failures of a run's pods that run but are not ready (process-wide: logs a refusal once)."""

    def __init__(self) -> None:
        self.refusal_logged = False
        self.refused_at: datetime.datetime | None = None

    async def failures(self, kube: Kube, namespace: str, pods: Sequence[tuple[PodObservation, PodFacts]],
                       memory: ProbeFailureMemory, now: datetime.datetime) -> dict[str, ProbeFailure]:
        """The latest probe failure of each running server (rollout or environment: the pods with a readiness probe)
        that is not ready, by pod name (pods without one left out)."""
        unready = {facts.uid: obs.name for obs, facts in pods if obs.role in ("rollout", "environment")
                   and obs.phase == "Running" and not obs.ready and not obs.terminating and facts.uid}
        memory.reads = {uid: read for uid, read in memory.reads.items() if uid in unready}
        failures = {}
        for uid, name in unready.items():
            read = memory.reads.get(uid)
            if (read is None or (now - read.at).total_seconds() >= REFRESH_SECONDS) and not self._refused(now):
                read = memory.reads[uid] = _Read(now, await self._read(kube, namespace, uid, now))
            if read is not None and read.failure is not None:
                failures[name] = read.failure
        return failures

    def _refused(self, now: datetime.datetime) -> bool:
        return self.refused_at is not None and (now - self.refused_at).total_seconds() < REFUSED_RETRY_SECONDS

    async def _read(self, kube: Kube, namespace: str, uid: str, now: datetime.datetime) -> ProbeFailure | None:
        try:
            events = await kube.list("v1", "Event", namespace, timeout=LIST_TIMEOUT_SECONDS,
                                     field_selector=f"involvedObject.uid={uid},reason=Unhealthy")
        except APIClientError as error:
            if error.status == 403:
                self.refused_at = now
                self._log_refusal(kube.logger, error)
            else:
                kube.logger.debug(f"reading the Events of pod {uid} failed (HTTP {error.status}): {error}")
            return None
        except (aiohttp.ClientError, TimeoutError) as error:
            kube.logger.debug(f"reading the Events of pod {uid} failed: {type(error).__name__} {error}")
            return None
        return latest_probe_failure(events)

    def _log_refusal(self, logger: logging.Logger | logging.LoggerAdapter, error: APIClientError) -> None:
        if not self.refusal_logged:
            self.refusal_logged = True
            logger.warning("cannot list Events (HTTP 403: grant list on core/v1 events, as the chart does): a pod "
                           "that is not ready is explained by its conditions alone, without the kubelet's probe "
                           f"failures: {error.message or error}")
