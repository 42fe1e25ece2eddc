"""Pure builders of GRPORun specs and objects for tests, and the CRD's verdict on a status (no kopf, no cluster)."""

from __future__ import annotations

import math
from typing import Any

from grpo_operator import manifest
from grpo_operator.api import API_VERSION, KIND

NAMESPACE = "default"


def minimal_spec(**overrides: Any) -> dict[str, Any]:
    """A valid spec with the CRD's defaults applied (what the API server would store), writing progress to status
    on every pass (`progress.statusIntervalSeconds: 0`) so tests read it back at once."""
    spec = {
        "progress": {"statusIntervalSeconds": 0},
        "model": "/models/tiny",
        "dataset": {"path": "/data/prompts.jsonl"},
        "rewards": [{"name": "letter_a_fraction"}],
        "rollout": {"replicas": 1},
        "learner": {"nodes": 1},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    defaulted = manifest.with_defaults({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "x"},
                                        "spec": spec})
    return defaulted["spec"]


def grporun(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec if spec is not None else minimal_spec()}


#: The API server decodes JSON integers into int64 (a larger one becomes a float, then fails `type: integer`).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def status_errors(status: dict[str, Any]) -> list[str]:
    """Problems with a status the operator is about to write: types, enums and fields the API server would prune,
    and numbers its JSON cannot carry (NaN and Infinity are not JSON; integers are int64)."""
    schema = manifest.load_crd().schema["properties"]["status"]
    return (manifest.unknown_field_errors(status, schema, "status") + manifest.schema_errors(status, "status")
            + wire_number_errors(status, "status"))


def wire_number_errors(value: Any, path: str) -> list[str]:
    if isinstance(value, dict):
        return [error for key, item in value.items() for error in wire_number_errors(item, f"{path}.{key}")]
    if isinstance(value, list):
        return [error for i, item in enumerate(value) for error in wire_number_errors(item, f"{path}[{i}]")]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: {value} is not a JSON number"]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        return [f"{path}: {value} does not fit in int64"]
    return []
