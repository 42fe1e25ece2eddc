"""The channel between the learner's supervision of its rollout servers (rank 0) and the router in TRL's worker child.

One memory-mapped file (on /dev/shm where there is one), written by both sides, each half by one writer:

- **the routes** (the learner writes): the weight version the pool serves and, per server, its slot, URL, index,
  state (serving, draining, out), how often it was admitted and how often its requests in flight were abandoned.
  JSON with its CRC-32 behind a sequence number: the router reads the 8-byte number for each request and parses the
  routes only when it changed. A read caught mid-write fails its CRC and is taken again later; meanwhile the router
  routes by the last good copy. No lock is shared across the processes, so none can be left held by a dead one.
- **the tallies** (the router writes): per slot, counters that only grow (requests sent and ended, completions,
  failures, requests re-sent to it, refusals by the server's weight-version gate), the seconds of requests in flight
  integrated over time, the wall time of its last completion, and its last failure's text. Each is one aligned
  8-byte word with one writer, so the learner reads a value whole whenever it looks.

A slot belongs to one URL for the learner's life; its tallies keep counting if the URL leaves and comes back.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path

#: Slots in one board: a run has at most 1024 rollout servers (the spec's bound); URLs that come and go (a local
#: run's ports) take more over a learner's life.
CAPACITY = 4096
ROUTES_BYTES = 1024 * 1024
ERROR_BYTES = 256
_HEADER = struct.Struct("<QII")  # sequence number, length of the routes' JSON, its CRC-32
_ROUTES_AT = _HEADER.size


class RouteBoardError(OSError):
    """The board's file cannot be made or mapped (a full or missing /dev/shm or temporary folder)."""


class Tally(IntEnum):
    """The router's counters per slot (float64 words)."""

    SENT = 0  # attempts sent to the server
    ENDED = 1  # attempts that ended, however: SENT - ENDED are in flight
    DONE = 2  # completions it returned
    FAILED = 3  # attempts that failed on it (connection, 5xx, timeout, abandoned)
    RETRIED = 4  # attempts it got for a request that had failed on another server
    REFUSED = 5  # attempts its gate refused: it holds an older version than the pool
    BUSY_S = 6  # attempts in flight integrated over time (seconds)
    LAST_DONE = 7  # wall time of its last completion (0: none)


_TALLIES_AT = _ROUTES_AT + ROUTES_BYTES
_ERRORS_AT = _TALLIES_AT + CAPACITY * len(Tally) * 8
SIZE = _ERRORS_AT + CAPACITY * ERROR_BYTES


class RouteState(str, Enum):
    SERVING = "serving"  # takes new requests
    DRAINING = "draining"  # its requests in flight finish there; no new ones
    OUT = "out"  # not in the pool (joining, failed, hung, behind): no new requests


@dataclass(frozen=True)
class Route:
    slot: int
    url: str
    index: int
    state: RouteState
    admissions: int  # times it was admitted: a failure the router saw before the latest admission is history
    abandons: int  # times its requests in flight were given up (hung, failed a weight sync): the router re-sends them


@dataclass(frozen=True)
class Routes:
    version: int  # the pool's weight version: a server must hold at least this one to serve a request
    servers: tuple[Route, ...] = ()


@dataclass(frozen=True)
class SlotTally:
    sent: float = 0.0
    ended: float = 0.0
    done: float = 0.0
    failed: float = 0.0
    retried: float = 0.0
    refused: float = 0.0
    busy_s: float = 0.0
    last_done: float = 0.0
    error: str = ""

    @property
    def in_flight(self) -> int:
        return max(int(self.sent - self.ended), 0)


def board_directory() -> str:
    """Memory, not a disk, where the system offers it (a pod's /dev/shm is a tmpfs)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


class RouteBoard:
    """`create()` in the learner, `attach(path)` in the router's process."""

    def __init__(self, path: str, *, owner: bool):
        self.path = path
        self.owner = owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)
        self._words = memoryview(self._map)[_TALLIES_AT:_ERRORS_AT].cast("d")
        self._seen_sequence = -1
        self._routes = Routes(version=0)

    @classmethod
    def create(cls) -> RouteBoard:
        directory = board_directory()
        try:
            fd, path = tempfile.mkstemp(prefix="grpo-routes-", dir=directory)
            try:
                os.ftruncate(fd, SIZE)
            finally:
                os.close(fd)
            return cls(path, owner=True)
        except OSError as error:
            raise RouteBoardError(f"the rollout route board ({SIZE // 1024} KiB) cannot be made in {directory}: "
                                  f"{error.strerror or error}") from error

    @classmethod
    def attach(cls, path: str) -> RouteBoard:
        return cls(path, owner=False)

    def close(self) -> None:
        self._words.release()
        self._map.close()
        if self.owner:
            Path(self.path).unlink(missing_ok=True)

    # -- routes: the learner writes, the router reads ----------------------------------------------------------------
    def publish(self, routes: Routes) -> None:
        text = json.dumps({"version": routes.version, "servers": [
            [r.slot, r.url, r.index, r.state.value, r.admissions, r.abandons] for r in routes.servers]}).encode()
        if len(text) > ROUTES_BYTES:
            raise ValueError(f"the routes of {len(routes.servers)} servers take {len(text)} bytes; the board holds "
                             f"{ROUTES_BYTES}")
        sequence = _HEADER.unpack_from(self._map, 0)[0]
        self._map[_ROUTES_AT:_ROUTES_AT + len(text)] = text
        _HEADER.pack_into(self._map, 0, sequence + 1, len(text), zlib.crc32(text))

    def routes(self) -> Routes:
        """The latest routes that read whole (the last good copy while a write is under way)."""
        sequence, length, crc = _HEADER.unpack_from(self._map, 0)
        if sequence == self._seen_sequence:
            return self._routes
        text = self._map[_ROUTES_AT:_ROUTES_AT + min(length, ROUTES_BYTES)]
        if zlib.crc32(text) != crc:
            return self._routes  # caught mid-write
        try:
            data = json.loads(text)
            routes = Routes(int(data["version"]), tuple(
                Route(slot, url, index, RouteState(state), admissions, abandons)
                for slot, url, index, state, admissions, abandons in data["servers"]))
        except (ValueError, KeyError, TypeError):
            return self._routes
        self._seen_sequence, self._routes = sequence, routes
        return routes

    @property
    def sequence(self) -> int:
        return _HEADER.unpack_from(self._map, 0)[0]

    # -- tallies: the router writes, the learner reads ---------------------------------------------------------------
    def add(self, slot: int, tally: Tally, amount: float = 1.0) -> None:
        self._words[slot * len(Tally) + tally] += amount

    def set(self, slot: int, tally: Tally, value: float) -> None:
        self._words[slot * len(Tally) + tally] = value

    def record_error(self, slot: int, error: str) -> None:
        """The slot's last failure, in words (written before its FAILED or REFUSED count grows)."""
        data = error.encode(errors="replace")[:ERROR_BYTES - 2]
        at = _ERRORS_AT + slot * ERROR_BYTES
        self._map[at + 2:at + 2 + len(data)] = data
        struct.pack_into("<H", self._map, at, len(data))

    def tally(self, slot: int) -> SlotTally:
        base = slot * len(Tally)
        words = [self._words[base + field] for field in Tally]
        at = _ERRORS_AT + slot * ERROR_BYTES
        (length,) = struct.unpack_from("<H", self._map, at)
        error = bytes(self._map[at + 2:at + 2 + min(length, ERROR_BYTES - 2)]).decode(errors="replace")
        return SlotTally(*words, error=error)
