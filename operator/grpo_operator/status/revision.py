"""One revision for the whole run, as pure rules: which of a spec's hub model and dataset are pinned to a commit,
what a pass does with the commits the hub named (or with why it named none), and the spec every pod is built from.

A hub model (spec.model that is neither a path nor s3://) and a hub dataset (spec.dataset.name) are pinned unless
their revision is `unpinned`: the branch or tag asked for (main when none) is resolved to a commit once, before the
run's first pod, and kept in status.model / status.dataset. Every pod is built from `pinned_spec`, so a rollout
server added by a scale-up hours later, or a pod recreated after a restart, loads the same commit as the first.
While a commit is not known the run waits, Pending with the reason, and the startup deadline bounds the wait (no
pod starts unpinned). A run whose pods exist already (made by an operator that did not pin) is not held back.

A path or s3:// model is not pinned by the hub: its bytes are what the volume or the store holds when each pod
loads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from grpo_trainer.contract.store_uri import is_hub_id

from ..api import UNPINNED_REVISION, GRPORunSpec
from ..run_status import GRPORunStatus, PinnedRevision

#: The revision the hub loads when none is named.
DEFAULT_REVISION = "main"

PinKind = Literal["model", "dataset"]


@dataclass(frozen=True)
class PinRequest:
    """A hub repository of the spec to pin: its `kind`, the spec field that names its revision, its id, the
    revision asked for."""

    kind: PinKind
    field: str
    name: str
    requested: str


@dataclass(frozen=True)
class HubPins:
    """What the pass learned from the hub (Observation.pins): the commits it named, by kind, and why it named none
    for the others (it could not be reached); None when it was not asked this pass."""

    commits: Mapping[PinKind, str] = field(default_factory=dict)
    waiting: str | None = None


def pin_requests(spec: GRPORunSpec) -> list[PinRequest]:
    requests = []
    if is_hub_id(spec.model) and spec.model_revision != UNPINNED_REVISION:
        requests.append(PinRequest("model", "spec.modelRevision", spec.model,
                                   spec.model_revision or DEFAULT_REVISION))
    dataset = spec.dataset
    if dataset.name is not None and dataset.revision != UNPINNED_REVISION:
        requests.append(PinRequest("dataset", "spec.dataset.revision", dataset.name,
                                   dataset.revision or DEFAULT_REVISION))
    return requests


def _held(status: GRPORunStatus, kind: PinKind) -> PinnedRevision | None:
    return status.model if kind == "model" else status.dataset


def unresolved(spec: GRPORunSpec, status: GRPORunStatus) -> list[PinRequest]:
    """The spec's requests whose commit the status does not hold (for that repository and revision)."""
    return [request for request in pin_requests(spec)
            if (held := _held(status, request.kind)) is None
            or (held.name, held.requested) != (request.name, request.requested)]


def take_pins(spec: GRPORunSpec, status: GRPORunStatus, pins: HubPins | None, *, pods_exist: bool) -> str | None:
    """Record in `status` the commits the hub named this pass; why the run must wait for the others (None: its pods
    may be made). A run whose pods exist is never held back."""
    if pods_exist:
        return None
    for request in unresolved(spec, status):
        commit = pins.commits.get(request.kind) if pins is not None else None
        if commit:
            pinned = PinnedRevision(name=request.name, requested=request.requested, revision=commit)
            if request.kind == "model":
                status.model = pinned
            else:
                status.dataset = pinned
    missing = unresolved(spec, status)
    if not missing:
        return None
    what = " and ".join(f"{request.field} {request.requested} of {request.name}" for request in missing)
    why = pins.waiting if pins is not None and pins.waiting else "the hub has not been asked yet"
    return (f"waiting to resolve {what} to a commit before any pod starts: {why} (the run fails at its "
            "startupDeadlineSeconds; set the revision to a commit, or to `unpinned`, to start without the hub)")


def pinned_spec(spec: GRPORunSpec, status: GRPORunStatus) -> GRPORunSpec:
    """`spec` with each revision the status pinned replaced by its commit: what every pod is built from."""
    update: dict[str, object] = {}
    for request in pin_requests(spec):
        held = _held(status, request.kind)
        if held is None or (held.name, held.requested) != (request.name, request.requested):
            continue
        if request.kind == "model":
            update["model_revision"] = held.revision
        else:
            update["dataset"] = spec.dataset.model_copy(update={"revision": held.revision})
    return spec.model_copy(update=update) if update else spec
