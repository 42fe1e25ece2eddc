"""One revision for the whole run, as pure rules: which of a spec's hub model and dataset are pinned to a commit,
what a pass does with the commits the hub named (or with why it named none), and the spec every pod is built from.

A hub model (spec.model that is neither a path nor s3://) and a hub dataset (spec.dataset.name) are pinned unless
their revision is `unpinned`: the branch or tag asked for (main when none) is resolved to a commit once, before the
run's first pod, and kept in status.model / status.dataset. Every pod is built from `pinned_spec`, so a rollout
server added by a scale-up hours later, or a pod recreated after a restart, loads the same commit as the first.
While a commit is not known the run waits, Pending with the reason, and the startup deadline bounds the wait (no
pod starts unpinned). A run whose pods exist already (made by an operator that did not pin) is not held back.

An s3:// model, or a path model whose folder holds an export manifest, is pinned by its content instead: the
learner reports the digest of what it loaded (its /progress `modelDigest`: the manifest's sha256, or for a store
prefix without one a digest of its keys and ETags), the first report goes on status.model (`requested: digest`),
and every pod built from then on (a rollout server added by a scale-up, a learner restarted) is given it
(`GRPO_MODEL_DIGEST`) and refuses other content with exit 78, naming the URI and both digests. The pods of the
run's first start load the model before the digest is known: they are not held to it. `grporun local` gives the
processes it starts later the same variable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_trainer.contract.pod_env import MODEL_DIGEST_ENV
from grpo_trainer.contract.store_uri import is_hub_id

from ..api import ROLE_LABEL, UNPINNED_REVISION, GRPORunSpec
from ..run_status import GRPORunStatus, PinnedRevision

#: The revision the hub loads when none is named.
DEFAULT_REVISION = "main"
#: status.model.requested of a model pinned by its content (an s3:// model, a path with an export manifest).
DIGEST_REQUESTED = "digest"

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


def take_model_digest(spec: GRPORunSpec, status: GRPORunStatus, digest: str | None) -> None:
    """Pin a model that is not on the hub to the content digest the learner reported loading (None: it reported
    none: a folder without an export manifest, or a learner older than the report's field). The first digest stays:
    a later report of another one is the learner's own refusal, which fails the run."""
    if is_hub_id(spec.model) or not digest:
        return
    if status.model is None or status.model.name != spec.model:
        status.model = PinnedRevision(name=spec.model, requested=DIGEST_REQUESTED, revision=digest)


def pinned_digest(spec: GRPORunSpec, status: GRPORunStatus) -> str | None:
    """The content digest the run's model is pinned to, or None (a hub model, or not reported yet)."""
    held = status.model
    if is_hub_id(spec.model) or held is None or held.name != spec.model or held.requested != DIGEST_REQUESTED:
        return None
    return held.revision


def with_model_digest(children: Sequence[dict[str, Any]], digest: str | None) -> list[dict[str, Any]]:
    """`children` with each rollout and learner pod given the pinned `digest` (GRPO_MODEL_DIGEST on its main
    container), so that a pod created now refuses a model whose content changed since the run started."""
    if digest is None:
        return list(children)
    pinned = []
    for child in children:
        role = (child.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL)
        if child["kind"] == "Pod" and role in ("rollout", "learner"):
            child = {**child, "spec": {**child["spec"], "containers": [
                {**c, "env": [*c.get("env", []), {"name": MODEL_DIGEST_ENV, "value": digest}]} if c["name"] == role
                else c for c in child["spec"]["containers"]]}}
        pinned.append(child)
    return pinned
