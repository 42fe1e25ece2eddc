"""The client an environment reaches its server through, which judges whose fault a failed call is.

An environment's tool call fails for one of two reasons, and they train differently:
- the environment failed: no connection, no answer within the call's deadline, a 5xx, an answer that is not JSON.
  `EnvironmentFailure`: the episode is unscorable and counted against its environment (grpo_trainer.agentic.tools);
- the server refused the call (a 4xx: the policy's arguments were wrong). `ToolCallRejected`: TRL returns it to the
  policy as the tool's result, and the episode trains as the policy played it.

The judgement is the transport's, not the exception class a user's HTTP library happens to raise: a connection error
that is no OSError, or a 4xx that is one, is still classified by what happened on the wire.

Each request is bounded by the client's timeout and by the deadline of the guarded call it runs in (`call_deadline`,
set by grpo_trainer.agentic.tools in the thread that runs the call), so a call to a server that never answers ends, and
frees its thread, at that deadline.

An environment's URL may name several servers (a headless Service's name, or under `grporun local` a list): each
request goes to the server its episode is pinned to (grpo_trainer.agentic.servers), so that a server holding the
episode's state sees every call of it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from .servers import EpisodePins, NoServer, check_address, current_pins, pool_for

#: Seconds one request may take when no guarded call's deadline is shorter (the spec's training.callTimeoutSeconds
#: default).
DEFAULT_TIMEOUT_S = 60.0
#: How much of a refused call's body the policy is shown.
REJECTION_CHARS = 500


class EnvironmentFailure(Exception):
    """The environment failed the call: its episode is unscorable, counted against the environment."""


class ToolCallRejected(Exception):
    """The environment refused the call as made (a 4xx): the policy's mistake, shown to it as the tool's result."""


class DeadlinePassed(EnvironmentFailure):
    """The call's deadline (`call_deadline`) came before its answer."""


_deadline = threading.local()


@contextlib.contextmanager
def call_deadline(deadline: float) -> Iterator[None]:
    """Bound every request made in this thread, until the block ends, by `deadline` (time.monotonic())."""
    previous = getattr(_deadline, "at", None)
    _deadline.at = deadline
    try:
        yield
    finally:
        _deadline.at = previous


def seconds_left(timeout_s: float) -> tuple[float, bool]:
    """The seconds a request made now may take, and whether the call's deadline (not `timeout_s`) is what bounds it
    (an answer that does not come in time is then DeadlinePassed, else EnvironmentFailure)."""
    deadline = getattr(_deadline, "at", None)
    if deadline is None or deadline - time.monotonic() >= timeout_s:
        return timeout_s, False
    return deadline - time.monotonic(), True


class EnvironmentClient:
    """JSON over HTTP to an environment's servers (`url`: http or https; a name may resolve to several, and a list
    separated by commas names several), each request within `timeout_s` and the running call's deadline, and to the
    server its episode is pinned to: within a guarded environment's call, the episode's (its first call chose the
    server with the fewest episodes in flight); outside one, the client's own, chosen by its first request and kept
    until `close`. Thread-safe: one client may serve every episode of a pool of environments."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        check_address(url)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._pool = pool_for(self.url)
        self._own_pins = EpisodePins()
        self._http = httpx.Client()

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST `payload` as JSON to `path`; the decoded answer."""
        return self._request("POST", path, payload)

    def get(self, path: str) -> Any:
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, payload: dict[str, Any] | None) -> Any:
        where = f"{method} {self.url}{path}"
        timeout, by_deadline = seconds_left(self.timeout_s)
        if timeout <= 0:
            raise DeadlinePassed(f"{where}: the call's deadline had passed")
        try:
            server = (current_pins() or self._own_pins).server(self._pool)
        except NoServer as error:
            raise EnvironmentFailure(f"{where}: {error}") from None
        where = f"{method} {server.url}{path}"
        try:
            response = self._http.request(method, server.url + path, json=payload, timeout=timeout,
                                          headers={"Host": server.host},
                                          extensions={"sni_hostname": server.hostname})
        except httpx.TimeoutException:
            raise (DeadlinePassed if by_deadline else EnvironmentFailure)(
                f"{where}: no answer within {timeout:.3g} s") from None
        except httpx.ConnectError as error:  # refused, or unreachable: no episode starts there until it answers again
            self._pool.mark_unreachable(server)
            raise EnvironmentFailure(f"{where}: {type(error).__name__}: {error}") from None
        except httpx.HTTPError as error:  # connection reset, DNS, a broken protocol
            raise EnvironmentFailure(f"{where}: {type(error).__name__}: {error}") from None
        if response.is_client_error:  # the call as the policy made it
            raise ToolCallRejected(f"HTTP {response.status_code}: {response.text[:REJECTION_CHARS]}")
        if not response.is_success:  # a 5xx, or a redirect no environment protocol makes
            raise EnvironmentFailure(f"{where}: HTTP {response.status_code}: {response.text[:REJECTION_CHARS]}")
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EnvironmentFailure(f"{where}: the answer is not JSON: {response.text[:80]!r}") from None

    def close(self) -> None:
        self._own_pins.release()
        self._http.close()
