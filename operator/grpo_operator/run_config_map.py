"""The run config as the run's ConfigMap holds it (`run.json`), read and edited in place: a live run's config is
never rendered again, but its `rollout.urls` follow a scale (ConfigureRollout) and its `images` the pods' image
digests (RecordImages). Pure: ConfigMap objects in, `data` out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .builders import CONFIG_FILE


def with_rollout_urls(config_map: Mapping[str, Any], urls: Sequence[str]) -> dict[str, str] | None:
    """The ConfigMap's `data` with `rollout.urls` in its run config replaced by `urls`, everything else as rendered
    (a live run's config is never rendered again); None when it lists those URLs already. Raises ValueError when
    the stored run config is not a JSON object with a `rollout` object."""
    data = dict(config_map.get("data") or {})
    config = _run_config(data)
    if config is None or not isinstance(config.get("rollout"), dict):
        raise ValueError(f"{CONFIG_FILE} in ConfigMap {config_map.get('metadata', {}).get('name')} has no "
                         "rollout object")
    if config["rollout"].get("urls") == list(urls):
        return None
    config["rollout"]["urls"] = list(urls)
    data[CONFIG_FILE] = json.dumps(config, separators=(",", ":"))
    return data


def images_of(config_map: Mapping[str, Any]) -> dict[str, list[str]] | None:
    """The image digests the ConfigMap's run config records by role (`images`); None when it cannot be read."""
    config = run_config_of(config_map)
    images = config.get("images", {}) if config is not None else None
    if not isinstance(images, dict):
        return None
    return {str(key): [str(d) for d in digests] for key, digests in images.items() if isinstance(digests, list)}


def with_images(config_map: Mapping[str, Any], images: Mapping[str, Sequence[str]]) -> dict[str, str] | None:
    """The ConfigMap's `data` with `images` in its run config set to `images`, everything else as rendered; None when
    it holds those already. Raises ValueError when the stored run config is not a JSON object."""
    data = dict(config_map.get("data") or {})
    config = _run_config(data)
    if config is None:
        raise ValueError(f"{CONFIG_FILE} in ConfigMap {config_map.get('metadata', {}).get('name')} is not a run config")
    wanted = {key: list(digests) for key, digests in images.items()}
    if config.get("images") == wanted:
        return None
    config["images"] = wanted
    data[CONFIG_FILE] = json.dumps(config, separators=(",", ":"))
    return data


def run_config_of(config_map: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run config in a ConfigMap, as a JSON object; None when it holds none (or a torn one)."""
    return _run_config(config_map.get("data") or {})


def rollout_urls_of(config_map: Mapping[str, Any]) -> list[str] | None:
    """The `rollout.urls` the ConfigMap's run config lists; None when it cannot be read."""
    config = run_config_of(config_map)
    rollout = config.get("rollout") if config is not None else None
    urls = rollout.get("urls") if isinstance(rollout, dict) else None
    return urls if isinstance(urls, list) else None


def _run_config(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run config a ConfigMap's data holds, as a JSON object; None when it holds none (or a torn one)."""
    try:
        config = json.loads(data.get(CONFIG_FILE) or "null")
    except ValueError:
        return None
    return config if isinstance(config, dict) else None
