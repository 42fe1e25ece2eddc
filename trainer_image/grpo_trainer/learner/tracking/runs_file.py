"""The trackers' runs a learner that starts again continues (`RUNS_FILE`, beside the checkpoints, which outlive the
pod): rank 0 records them once they started, and the next start reads them back. A file that cannot be trusted (torn,
tampered with, another run's) is not read: the trackers then start new runs."""

from __future__ import annotations

import logging
import os

from pydantic import ValidationError

from ...contract.config import RunConfig
from .base import RecordedRuns, tracking_root

logger = logging.getLogger(__name__)

RUNS_FILE = "tracking-runs.json"
#: More than a runs file ever holds: a bigger one is not read.
RUNS_FILE_MAX_BYTES = 64 * 1024


def runs_file(config: RunConfig) -> str:
    return os.path.join(tracking_root(config), RUNS_FILE)


def run_key(config: RunConfig) -> str:
    return f"{config.namespace}/{config.run_name}"


def read_recorded_runs(config: RunConfig) -> RecordedRuns | None:
    """The runs the last start of this learner recorded; None, with a warning, for a file that cannot be trusted
    (torn, tampered with, another run's): the trackers then start new runs."""
    path = runs_file(config)
    try:
        with open(path, "rb") as file:
            data = file.read(RUNS_FILE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning(f"tracking: cannot read {path} ({error}): the trackers start new runs")
        return None
    if len(data) > RUNS_FILE_MAX_BYTES:
        logger.warning(f"tracking: {path} is over {RUNS_FILE_MAX_BYTES} bytes: the trackers start new runs")
        return None
    try:
        recorded = RecordedRuns.model_validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        logger.warning(f"tracking: {path} is not a runs file ({where}: {first['msg']}): the trackers start new runs")
        return None
    if recorded.run != run_key(config):
        logger.warning(f"tracking: {path} records the runs of {recorded.run!r}, not of {run_key(config)!r}: the "
                       "trackers start new runs")
        return None
    return recorded


def write_recorded_runs(config: RunConfig, recorded: RecordedRuns) -> None:
    """Save the runs for the next start of this learner (rank 0 only); a warning if the file cannot be written."""
    from ..checkpoints import write_json_atomically

    path = runs_file(config)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomically(path, recorded.model_dump(mode="json", by_alias=True, exclude_none=True))
    except OSError as error:
        logger.warning(f"tracking: cannot write {path} ({error}): a restarted learner will start new runs")
