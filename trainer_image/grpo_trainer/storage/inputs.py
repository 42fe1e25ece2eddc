"""The run's inputs where the learner and the rollout server load them: an `s3://` model or dataset.path is
downloaded once into the inputs cache (`InputsConfig.cache_dir`: on spec.modelCache.volume in a pod, so that a
restarted pod or a new rollout server finds it there) and named by its local path from then on; a path must exist; the
credentials the spec names must have arrived. Every problem is an `InputError` naming the field: a user mistake, the
pod's exit 78.

The local path of an s3:// input depends only on its URI and the cache folder (`local_path`), so that the learner
(whose requests name the model), the rollout server (which serves it under that name) and its probe agree without
asking the store. A download is staged and renamed into place last (`object_store.download`): a path that exists is
complete. At each start the cached copy is compared with what the store holds now (its manifest's digest, or the
objects' ETags): a changed input is downloaded again and replaces the old copy; a store that cannot be asked leaves
the cached copy in use, with a warning.

A run pins its model's content when it starts (status.model.revision, the learner's first report of
`model_digest`): a pod started later is given that digest (`GRPO_MODEL_DIGEST`) and refuses, before any download, a
model whose store or folder now holds other content: an InputError naming the URI and both digests.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from ..contract.codes import EXPORT_MANIFEST_FILE
from ..contract.config import InputsConfig, RunConfig
from ..contract.pod_env import HUB_TOKEN_ENV, INPUT_CREDENTIALS_ENV_PREFIX, MODEL_DIGEST_ENV
from ..contract.store_uri import (
    ACCESS_KEY_ENV,
    ENDPOINT_ENV,
    REGION_ENV,
    SECRET_KEY_ENV,
    SESSION_TOKEN_ENV,
    is_object_store_uri,
    parse_uri,
)

logger = logging.getLogger(__name__)

#: Under the inputs cache: one folder per s3:// URI.
OBJECT_STORE_FOLDER = "s3"
#: In a URI's folder: held while a process compares its cached copy with the store or downloads it.
LOCK_FILE = ".lock"
#: The boto3 variables the inputs' credentials Secret is mounted as, each under its prefixed name too.
_CREDENTIAL_ENV = (ACCESS_KEY_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV)


class InputError(Exception):
    """A model or dataset that cannot be had; one line naming the field and the cause."""


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where a process without a configured cache folder (grporun local) keeps its downloads: the user's cache."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grpo" / "inputs"


def cache_dir(config: RunConfig, environ: Mapping[str, str] = os.environ) -> Path:
    return Path(config.inputs.cache_dir) if config.inputs.cache_dir else default_cache_dir(environ)


def local_path(value: str, config: RunConfig, environ: Mapping[str, str] = os.environ) -> str:
    """Where `value` (a model or dataset.path) is loaded from: an s3:// URI's place in the inputs cache (downloaded
    there or not), anything else as it is. The folder keeps the URI's last segment, so a file keeps its suffix."""
    if not is_object_store_uri(value):
        return value
    name = PurePosixPath(value.rstrip("/")).name or "object"
    digest = hashlib.sha256(value.rstrip("/").encode()).hexdigest()[:16]
    return str(cache_dir(config, environ) / OBJECT_STORE_FOLDER / digest / name)


def store_environ(inputs: InputsConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables boto3 reads for the inputs' store: the inputs' own credentials (GRPO_INPUTS_AWS_*, from
    spec.inputs.credentialsSecret) over the plain ones (this machine's, under grporun local), the spec's endpoint and
    region over the environment's."""
    env = {name: value for name, value in environ.items() if name.startswith("AWS_")}
    for name in _CREDENTIAL_ENV:
        if environ.get(INPUT_CREDENTIALS_ENV_PREFIX + name):
            env[name] = environ[INPUT_CREDENTIALS_ENV_PREFIX + name]
    if inputs.endpoint:
        env.update({name: inputs.endpoint for name in ENDPOINT_ENV})
    if inputs.region:
        env.update({name: inputs.region for name in REGION_ENV})
    return env


def check_credentials(inputs: InputsConfig, *, object_store: bool,
                      environ: Mapping[str, str] = os.environ) -> None:
    """The Secrets the spec names have arrived (their references are optional, so a missing Secret or key is this
    one line instead of a pod that never starts); `object_store`: an s3:// input is to be read."""
    if inputs.hub_token_secret and not environ.get(HUB_TOKEN_ENV):
        raise InputError(f"inputs.hubTokenSecret: Secret {inputs.hub_token_secret!r} gave no {HUB_TOKEN_ENV} "
                         "(no such Secret, or no such key in it)")
    if object_store and inputs.credentials_secret:
        store = store_environ(inputs, environ)
        missing = [name for name in (ACCESS_KEY_ENV, SECRET_KEY_ENV) if not store.get(name)]
        if missing:
            raise InputError(f"inputs.credentialsSecret: Secret {inputs.credentials_secret!r} gave no "
                             f"{' or '.join(missing)} (no such Secret, or no such key in it)")


def fetch(value: str, field: str, config: RunConfig, *, environ: Mapping[str, str] = os.environ,
          client=None, pinned: str | None = None) -> str:
    """`value`'s local path, downloaded first when it is an s3:// URI whose current content the cache lacks;
    InputError naming `field`. `pinned`: the digest the run pinned `value` to; other content is refused."""
    if not is_object_store_uri(value):
        if value.startswith("/") and not os.path.exists(value):
            raise InputError(f"{field}: {value}: no such file or directory (is its volume, spec.inputs.volume, "
                             "mounted?)")
        if pinned is not None:
            _check_pinned(field, value, loaded_digest(value), pinned)
        return value
    from .object_store import ObjectStoreError, client_from_env, download, source_identity

    target = Path(local_path(value, config, environ))
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process at a time per URI: the learner and a rollout server starting together on one cache download once,
    # and neither replaces a copy the other has just found current.
    with open(target.parent / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            location = parse_uri(value, field)
            client = client or client_from_env(store_environ(config.inputs, environ))
            current = source_identity(location, client=client)
        except (ObjectStoreError, ValueError) as error:
            if target.exists():
                if pinned is not None:
                    _check_pinned(field, value, _cached_identity(target), pinned)
                logger.warning("%s: %s could not be compared with the store (%s); loading the cached copy at %s",
                               field, value, error, target)
                return str(target)
            raise InputError(f"{field}: {error}") from None
        if pinned is not None:
            _check_pinned(field, value, current, pinned)  # before a download replaces the cached copy
        cached = _cached_identity(target)
        if cached == current:
            logger.info("%s: %s is in the inputs cache at %s, as the store holds it", field, value, target)
            return str(target)
        try:
            if cached is None and not target.exists():
                logger.info("%s: downloading %s to %s", field, value, target)
                download(location, target, client=client)
            else:
                logger.info("%s: %s changed in the store since it was cached; downloading it again to %s", field,
                            value, target)
                fresh = target.with_name(f".{target.name}.fresh")
                _remove(fresh)  # left by a process killed before its swap
                _replace(target, download(location, fresh, client=client))
        except ObjectStoreError as error:
            raise InputError(f"{field}: {error}") from None
        _source_file(target).write_text(current, encoding="utf-8")
    return str(target)


def _check_pinned(field: str, value: str, found: str | None, pinned: str) -> None:
    if found != pinned:
        raise InputError(f"{field}: {value} holds {found or 'a model without an export manifest'}, not {pinned}, "
                         "the content the run pinned when it started (status.model.revision): it changed since; "
                         "put that content back, or start a new run for the new one")


def loaded_digest(path: str) -> str | None:
    """The content digest of a model folder as loaded (the local path `resolve` gives): what the store held when an
    s3:// copy was downloaded, else the digest of the folder's export manifest; None for a folder without one (or a
    hub id)."""
    return _cached_identity(Path(path)) if os.path.isabs(path) or os.path.exists(path) else None


def _source_file(target: Path) -> Path:
    """Beside a cached input: what the store held when it was downloaded (object_store.source_identity)."""
    return target.with_name(f".{target.name}.source")


def _cached_identity(target: Path) -> str | None:
    from .object_store import manifest_identity

    if not target.exists():
        return None
    try:
        return _source_file(target).read_text(encoding="utf-8")
    except FileNotFoundError:
        if (target / EXPORT_MANIFEST_FILE).is_file():  # cached before the identity was kept: its manifest says
            return manifest_identity((target / EXPORT_MANIFEST_FILE).read_bytes())
        return None


def _replace(target: Path, fresh: Path) -> None:
    """`fresh` in `target`'s place; the old copy removed (a process still reading it fails, and its restart loads
    the new one)."""
    old = target.with_name(f".{target.name}.old")
    _remove(old)
    os.rename(target, old)
    os.rename(fresh, target)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def resolve(config: RunConfig, *, dataset: bool, environ: Mapping[str, str] = os.environ,
            client=None) -> RunConfig:
    """`config` with its model (and, with `dataset`, its dataset.path) where this process loads them, downloaded
    where they are s3:// URIs; InputError naming the field."""
    values = [config.model, *([config.dataset.path] if dataset and config.dataset.path is not None else [])]
    check_credentials(config.inputs, object_store=any(map(is_object_store_uri, values)), environ=environ)
    resolved = config.model_copy(deep=True)
    resolved.model = fetch(config.model, "model", config, environ=environ, client=client,
                           pinned=environ.get(MODEL_DIGEST_ENV) or None)
    if dataset and config.dataset.path is not None:
        resolved.dataset.path = fetch(config.dataset.path, "dataset.path", config, environ=environ, client=client)
    return resolved
