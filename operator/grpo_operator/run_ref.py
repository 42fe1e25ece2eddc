"""The run a pass works on, as its child objects and its status see it: a GRPORun's name, namespace and uid (who
the children belong to) and the spec generation this pass reads (what the ConfigMap and status.observedGeneration
record). One value, so the four never travel as loose strings that a caller could swap."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .api import API_VERSION, KIND


@dataclass(frozen=True)
class RunRef:
    name: str
    namespace: str
    uid: str
    #: metadata.generation: 1 for a run whose spec was never edited.
    generation: int = 1

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> RunRef:
        """The reference of a GRPORun from its metadata (an API server answer or a kopf body)."""
        return cls(metadata["name"], metadata["namespace"], metadata["uid"], int(metadata.get("generation") or 1))

    def owner_reference(self) -> dict[str, Any]:
        """The controller ownerReference every child carries: deleting the run deletes it."""
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid, "controller": True,
                "blockOwnerDeletion": True}
