"""The run's inputs where the learner and the rollout server load them: an `s3://` model or dataset.path is
downloaded once into the inputs cache (`InputsConfig.cache_dir`: on spec.modelCache.volume in a pod, so that a
restarted pod or a new rollout server finds it there) and named by its local path from then on; a path must exist; the
credentials the spec names must have arrived. Every problem is an `InputError` naming the field: a user mistake, the
pod's exit 78.

The local path of an s3:// input depends only on its URI and the cache folder (`local_path`), so that the learner
(whose requests name the model), the rollout server (which serves it under that name) and its probe agree without
asking the store. A download is staged and renamed into place last (`object_store.download`): a path that exists is
complete, and one that exists is never downloaded again. The cache keys by URI: a different model at the same URI
is not read again while the cache holds the old one (upload it under a new prefix).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from ..contract.config import InputsConfig, RunConfig
from ..contract.pod_env import HUB_TOKEN_ENV, INPUT_CREDENTIALS_ENV_PREFIX
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
          client=None) -> str:
    """`value`'s local path, downloaded first when it is an s3:// URI not in the cache yet; InputError naming
    `field`."""
    if not is_object_store_uri(value):
        if value.startswith("/") and not os.path.exists(value):
            raise InputError(f"{field}: {value}: no such file or directory (is its volume, spec.inputs.volume, "
                             "mounted?)")
        return value
    target = Path(local_path(value, config, environ))
    if target.exists():
        logger.info("%s: %s is in the inputs cache at %s", field, value, target)
        return str(target)
    from .object_store import ObjectStoreError, client_from_env, download

    try:
        location = parse_uri(value, field)
        logger.info("%s: downloading %s to %s", field, value, target)
        download(location, target, client=client or client_from_env(store_environ(config.inputs, environ)))
    except (ObjectStoreError, ValueError) as error:
        raise InputError(f"{field}: {error}") from None
    return str(target)


def resolve(config: RunConfig, *, dataset: bool, environ: Mapping[str, str] = os.environ,
            client=None) -> RunConfig:
    """`config` with its model (and, with `dataset`, its dataset.path) where this process loads them, downloaded
    where they are s3:// URIs; InputError naming the field."""
    values = [config.model, *([config.dataset.path] if dataset and config.dataset.path is not None else [])]
    check_credentials(config.inputs, object_store=any(map(is_object_store_uri, values)), environ=environ)
    resolved = config.model_copy(deep=True)
    resolved.model = fetch(config.model, "model", config, environ=environ, client=client)
    if dataset and config.dataset.path is not None:
        resolved.dataset.path = fetch(config.dataset.path, "dataset.path", config, environ=environ, client=client)
    return resolved
