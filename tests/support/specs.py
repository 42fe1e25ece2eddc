"""Pure builders of GRPORun specs and objects for tests, and the CRD's verdict on a status (no kopf, no cluster)."""

from __future__ import annotations

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


def status_errors(status: dict[str, Any]) -> list[str]:
    """Problems with a status the operator is about to write: types, enums and fields the API server would prune."""
    schema = manifest.load_crd().schema["properties"]["status"]
    return manifest.unknown_field_errors(status, schema, "status") + manifest.schema_errors(status, "status")
