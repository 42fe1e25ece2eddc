"""The model's `config.json` for the fit check (grpo_operator.fit): from a local directory, or fetched alone from
the hub (I/O).

`spec.model` is a local directory when the reader has it (`grporun validate`: relative to the manifest's folder;
the operator: an absolute path on its own filesystem), a hub id otherwise; an `s3://` model is not read. From the
hub only `config.json` comes (`hf_hub_download` of that file, at the run's revision), into a temporary folder:
nothing else is downloaded and nothing is kept (the operator's root filesystem is read-only). One HEAD first, with
`timeout` and no retries, so a hub that cannot be reached (refused, silent, offline) costs at most `timeout`
seconds before the check is skipped with the reason; huggingface_hub's own download would retry for a minute.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grpo_trainer.contract.store_uri import is_object_store_uri

CONFIG_FILE = "config.json"
#: Seconds the hub has to answer the first request before the check is skipped.
HUB_TIMEOUT_SECONDS = 5.0
#: The hub's URL where it is not huggingface.co (a mirror, a stand-in), as huggingface_hub spells it.
HUB_ENDPOINT_ENV = "HF_ENDPOINT"

ConfigRead = tuple[dict[str, Any] | None, str]  # (config.json, "") or (None, why not)


@dataclass(frozen=True)
class HubAccess:
    """How to reach the hub: `revision` (a branch, tag or commit; None: main), `token` (None: huggingface_hub's
    own, HF_TOKEN or a saved login), `endpoint` (None: huggingface_hub's, HF_ENDPOINT when its process started)."""

    revision: str | None = None
    token: str | None = None
    endpoint: str | None = None
    timeout: float = HUB_TIMEOUT_SECONDS


def read_model_config(model: str, hub: HubAccess, base_dir: str | os.PathLike[str] | None = None) -> ConfigRead:
    """config.json of `model`: a local directory (relative to `base_dir`, a manifest's folder; without it, only an
    absolute path is local) or a hub id; (None, why) when it cannot be had."""
    if is_object_store_uri(model):
        return None, f"spec.model {model} is in an object store; its config.json is read from a local path or the hub"
    expanded = os.path.expanduser(model)
    if os.path.isabs(expanded):
        local: Path | None = Path(expanded)
    else:
        local = Path(base_dir) / expanded if base_dir is not None else None
    if local is not None and local.is_dir():
        try:
            return json.loads((local / CONFIG_FILE).read_text()), ""
        except (OSError, ValueError) as error:
            return None, f"spec.model {model}: cannot read {CONFIG_FILE} ({error})"
    if model.startswith(("/", "./", "../", "~")):
        return None, f"spec.model {model}: no such directory here"
    return read_hub_config(model, hub)


@dataclass(frozen=True)
class HubFailure:
    """What the hub answered instead (`why`, one line); `transient`: it could not be reached, asking later may do."""

    why: str
    transient: bool


def hub_failure(error: Exception, where: str, what: str, kind: str = "model") -> HubFailure | None:
    """What huggingface_hub's `error`, raised asking for `what` of `where` (a hub `kind`), means; None when it is
    none of the hub's."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx

    if isinstance(error, GatedRepoError):
        return HubFailure(f"{where} is gated, and the hub refused {what} without a token that may read it "
                          "(HF_TOKEN)", transient=False)
    if isinstance(error, RepositoryNotFoundError):
        return HubFailure(f"{where}: the hub has no such {kind} (or it is private, and no token that may read "
                          "it was given)", transient=False)
    if isinstance(error, RevisionNotFoundError):
        return HubFailure(f"{where}: the hub has no such revision", transient=False)
    if isinstance(error, LocalEntryNotFoundError):  # a download's own request failed after the first one passed
        return HubFailure(f"{where}: the hub cannot be reached ({error})", transient=True)
    if isinstance(error, EntryNotFoundError):
        return HubFailure(f"{where}: the hub has no {what} for it", transient=False)
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code
        return HubFailure(f"{where}: the hub answered HTTP {status} for {what}", transient=status >= 500)
    if isinstance(error, OfflineModeIsEnabled):
        return HubFailure(f"{where}: HF_HUB_OFFLINE is set, so the hub is not asked for {what}", transient=False)
    if isinstance(error, httpx.HTTPError):
        return HubFailure(f"{where}: the hub cannot be reached ({type(error).__name__}: {error or 'no answer'})",
                          transient=True)
    return None


def read_hub_config(repo_id: str, hub: HubAccess) -> ConfigRead:
    """config.json of the hub model `repo_id`, fetched alone; (None, why) naming what the hub answered."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    where = f"spec.model {repo_id}" + (f" (revision {hub.revision})" if hub.revision else "")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None, f"spec.model {repo_id}: neither a directory here nor a hub id"
    try:
        # One request, bounded, no retries: it says whether the hub answers at all before the download (whose own
        # retries would take a minute).
        get_hf_file_metadata(hf_hub_url(repo_id, CONFIG_FILE, revision=hub.revision, endpoint=hub.endpoint),
                             token=hub.token, timeout=hub.timeout)
        with tempfile.TemporaryDirectory(prefix="grpo-fit-") as cache:
            path = hf_hub_download(repo_id, CONFIG_FILE, revision=hub.revision, endpoint=hub.endpoint,
                                   token=hub.token, cache_dir=cache, etag_timeout=hub.timeout)
            return json.loads(Path(path).read_text()), ""
    except Exception as error:
        failure = hub_failure(error, where, f"its {CONFIG_FILE}")
        if failure is not None:
            return None, failure.why
        if isinstance(error, OSError):  # the temporary folder, or the file in it
            return None, f"{where}: its {CONFIG_FILE} could not be kept to read ({error})"
        if isinstance(error, ValueError):
            return None, f"{where}: its {CONFIG_FILE} is not JSON ({error})"
        raise


#: A commit as the hub names it: 40 lowercase hex digits. A revision spelled so is pinned already.
COMMIT = re.compile(r"[0-9a-f]{40}")

RevisionRead = tuple[str | None, HubFailure | None]  # (the commit, None) or (None, what the hub answered instead)


def resolve_commit(repo_id: str, kind: Literal["model", "dataset"], field: str, hub: HubAccess) -> RevisionRead:
    """The commit `hub.revision` (a branch, tag or commit; None: main) of the hub model or dataset `repo_id` is at
    now: one bounded request, no retries (`hub.timeout`). A revision spelled as a commit is that commit, unasked.
    `field` names the spec field in what the failure says."""
    from huggingface_hub import HfApi

    revision = hub.revision or "main"
    if COMMIT.fullmatch(revision):
        return revision, None
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    info = api.model_info if kind == "model" else api.dataset_info
    try:
        sha = info(repo_id, revision=revision, timeout=hub.timeout).sha
    except Exception as error:
        failure = hub_failure(error, f"{field} {revision} of {kind} {repo_id}", "its commit", kind)
        if failure is None:
            raise
        return None, failure
    if not sha:
        return None, HubFailure(f"{field} {revision} of {kind} {repo_id}: the hub named no commit for it",
                                transient=True)
    return sha, None
