"""The rollout servers the run wants, read again from the run config file while the learner runs.

`rollout.urls` in the run config is the one channel for the set (docs/rollout.md, "Scaling a running run"): the
operator rewrites it in the run's ConfigMap, which the kubelet refreshes in place in the learner's volume, and
`grporun local scale` rewrites the run folder's run.json. The learner looks every few seconds. A file caught
mid-write, one that is not a valid run config, or one that names no server changes nothing: the learner keeps the
last good set and says so once, naming the file and what is wrong.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import ValidationError

from ..contract.config import load_run_config
from ..contract.wire import config_error_line
from .server_set import normalized

logger = logging.getLogger(__name__)

#: How often the learner reads the run config again. Small next to the kubelet's own refresh of a ConfigMap volume
#: (up to its sync period plus its cache's TTL, about a minute by default), so the kubelet sets the pace.
WATCH_INTERVAL_S = 2.0


class RolloutUrlsWatch:
    """`poll()` answers a new set of URLs when the file names one, else None (unchanged, or unusable)."""

    def __init__(self, path: str | os.PathLike, current: list[str]):
        self.path = Path(path)
        self.current = normalized(current)
        self._last_text: str | None = None
        self._problem: str | None = None  # the unusable state last warned about

    def poll(self) -> list[str] | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            return self._refuse(f"cannot read it ({getattr(error, 'strerror', None) or error})")
        if text == self._last_text:
            return None  # a file left as it was is not read again, nor warned about again
        self._last_text = text
        try:
            urls = normalized(load_run_config(text).rollout.urls)
        except ValidationError as error:
            return self._refuse(f"it is not a valid run config ({config_error_line(error)})")
        if not urls:
            return self._refuse("rollout.urls is empty, and a run needs at least one rollout server")
        self._problem = None
        if urls == self.current:
            return None
        self.current = urls
        return urls

    def _refuse(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            logger.warning("run config %s: %s; the learner keeps its %d rollout server(s): %s", self.path, problem,
                           len(self.current), ", ".join(self.current))
        return None
