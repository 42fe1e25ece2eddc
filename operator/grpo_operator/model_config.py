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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def read_hub_config(repo_id: str, hub: HubAccess) -> ConfigRead:
    """config.json of the hub model `repo_id`, fetched alone; (None, why) naming what the hub answered."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import httpx, validate_repo_id

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
    except GatedRepoError:
        return None, (f"{where} is gated, and the hub refused its {CONFIG_FILE} without a token that may read it "
                      "(HF_TOKEN)")
    except RepositoryNotFoundError:
        return None, f"{where}: the hub has no such model (or it is private, and no token that may read it was given)"
    except RevisionNotFoundError:
        return None, f"{where}: the hub has no such revision"
    except LocalEntryNotFoundError as error:  # the download's own request failed after the first one passed
        return None, f"{where}: the hub cannot be reached ({error})"
    except EntryNotFoundError:
        return None, f"{where}: the hub has no {CONFIG_FILE} for it"
    except HfHubHTTPError as error:
        return None, f"{where}: the hub answered HTTP {error.response.status_code} for its {CONFIG_FILE}"
    except OfflineModeIsEnabled:
        return None, f"{where}: HF_HUB_OFFLINE is set, so the hub is not asked for its {CONFIG_FILE}"
    except httpx.HTTPError as error:
        return None, f"{where}: the hub cannot be reached ({type(error).__name__}: {error or 'no answer'})"
    except OSError as error:  # the temporary folder, or the file in it
        return None, f"{where}: its {CONFIG_FILE} could not be kept to read ({error})"
    except ValueError as error:
        return None, f"{where}: its {CONFIG_FILE} is not JSON ({error})"
