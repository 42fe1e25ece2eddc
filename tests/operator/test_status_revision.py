"""One revision for the whole run, replayed through derive_status alone: a hub model's and dataset's commits are
pinned before the first pod, the run waits (and says why) while the hub names none, within the startup deadline;
`unpinned`, a path and a run whose pods exist are not held. The spec the pods are built from carries the commits. A
model off the hub is pinned to the content digest its learner reports, which the pods built later carry.

The cluster's port asks the hub (cluster/revisions.py; tests/operator/test_revision_pinning.py runs it with the
stand-in hub and the API emulator).
"""

from __future__ import annotations

from grpo_operator import builders
from grpo_operator.api import parse_spec
from grpo_operator.run_ref import RunRef
from grpo_operator.run_status import GRPORunStatus, parse_status
from grpo_operator.status import CreateChildren
from grpo_operator.status.revision import (
    HubPins,
    pin_requests,
    pinned_digest,
    pinned_spec,
    take_model_digest,
    with_model_digest,
)
from tests.operator.test_status import at, condition, reasons, running_pods, spec_of, step
from tests.support.specs import minimal_spec

MODEL_COMMIT, DATASET_COMMIT = "a1" * 20, "b2" * 20
UNREACHABLE = "spec.modelRevision main of model Qwen/Qwen3-0.6B: the hub cannot be reached (ConnectError: refused)"


def hub_spec(dataset_revision: str = "v1", **overrides):
    return spec_of(model="Qwen/Qwen3-0.6B", dataset={"path": None, "name": "openai/gsm8k",
                                                     "revision": dataset_revision}, **overrides)


def test_the_run_waits_for_the_commits_then_pins_them_once_and_creates_its_pods():
    spec = hub_spec()
    waiting = step(spec, {}, [], pins=HubPins({"dataset": DATASET_COMMIT}, waiting=UNREACHABLE))
    assert waiting.status["phase"] == "Pending" and CreateChildren() not in waiting.actions
    progressing = condition(waiting.status, "Progressing")
    assert progressing["reason"] == "ResolvingRevision"
    assert progressing["message"].startswith("waiting to resolve spec.modelRevision main of Qwen/Qwen3-0.6B to a "
                                             f"commit before any pod starts: {UNREACHABLE}")
    assert waiting.status["message"] == progressing["message"]
    assert reasons(waiting).count("ResolvingRevision") == 1
    # The dataset's commit is kept as soon as it is known; the model's comes on a later pass.
    assert waiting.status["dataset"] == {"name": "openai/gsm8k", "requested": "v1", "revision": DATASET_COMMIT}
    still = step(spec, waiting.status, [], now=at(5), pins=HubPins(waiting=UNREACHABLE))
    assert "ResolvingRevision" not in reasons(still)  # said once
    pinned = step(spec, still.status, [], now=at(10), pins=HubPins({"model": MODEL_COMMIT}))
    assert pinned.status["model"] == {"name": "Qwen/Qwen3-0.6B", "requested": "main", "revision": MODEL_COMMIT}
    assert CreateChildren() in pinned.actions and "message" not in pinned.status
    # Later passes ask nothing of the hub: the status holds both commits, and every pod is built at them.
    later = step(spec, pinned.status, running_pods(), now=at(20))
    assert later.status["model"]["revision"] == MODEL_COMMIT
    built = pinned_spec(spec, parse_status(later.status))
    assert (built.model_revision, built.dataset.revision) == (MODEL_COMMIT, DATASET_COMMIT)


def test_a_hub_that_never_answers_fails_the_run_at_its_startup_deadline_with_why():
    spec = hub_spec(progress={"startupDeadlineSeconds": 60})
    waiting = step(spec, {}, [], pins=HubPins(waiting=UNREACHABLE))
    failed = step(spec, waiting.status, [], now=at(61), pins=HubPins(waiting=UNREACHABLE))
    assert failed.status["phase"] == "Failed"
    assert failed.status["failure"]["reason"] == "StartupDeadlineExceeded"
    assert UNREACHABLE in failed.status["message"] and CreateChildren() not in failed.actions


def test_unpinned_a_path_and_a_run_whose_pods_exist_are_not_held():
    unpinned = hub_spec("unpinned", modelRevision="unpinned")
    assert pin_requests(unpinned) == []
    assert CreateChildren() in step(unpinned, {}, []).actions
    local = spec_of()  # /models/tiny, /data/prompts.jsonl
    assert pin_requests(local) == [] and pinned_spec(local, parse_status({})) == local
    assert CreateChildren() in step(local, {}, []).actions
    # Pods an operator that did not pin made: the run goes on as it is.
    running = step(hub_spec(), {"phase": "Running"}, running_pods(), now=at(5))
    assert running.status["phase"] != "Pending" and "model" not in running.status


def test_a_commit_asked_for_is_pinned_as_the_hub_names_it_and_a_changed_request_is_pinned_again():
    spec = hub_spec(modelRevision=MODEL_COMMIT)
    [model, _] = pin_requests(spec)
    assert (model.field, model.requested) == ("spec.modelRevision", MODEL_COMMIT)
    pinned = step(spec, {}, [], pins=HubPins({"model": MODEL_COMMIT, "dataset": DATASET_COMMIT}))
    assert pinned.status["model"]["revision"] == MODEL_COMMIT and CreateChildren() in pinned.actions
    # A status pinned for another revision (the spec edited while no pod exists) does not hold for this one.
    other = hub_spec(modelRevision="v2")
    assert pinned_spec(other, parse_status(pinned.status)).model_revision == "v2"
    assert step(other, pinned.status, [], now=at(5)).status["phase"] == "Pending"


def test_a_model_off_the_hub_is_pinned_to_the_first_digest_its_learner_reports_and_pods_built_later_carry_it():
    digest = "manifest:" + "ab" * 32
    spec = parse_spec(minimal_spec(model="s3://models/tiny"))
    status = GRPORunStatus()
    take_model_digest(spec, status, None)
    assert status.model is None and pinned_digest(spec, status) is None
    take_model_digest(spec, status, digest)
    take_model_digest(spec, status, "manifest:" + "cd" * 32)
    assert (status.model.name, status.model.requested, status.model.revision) == ("s3://models/tiny", "digest", digest)
    assert pinned_digest(spec, status) == digest
    edited = spec.model_copy(update={"model": "s3://models/other"})
    assert pinned_digest(edited, status) is None  # another model: its own digest, once reported

    hub = parse_spec(minimal_spec(model="Qwen/Qwen3-0.6B"))
    hub_status = GRPORunStatus()
    take_model_digest(hub, hub_status, digest)
    assert hub_status.model is None  # a hub model is pinned by its commit

    children = builders.build_children(RunRef("run", "ml", "uid"), parse_spec(minimal_spec(
        model="s3://models/tiny", environments=[{"name": "guess", "image": "game:1", "port": 8765}])),
        trainer_image="img")
    pinned = with_model_digest(children, digest)
    assert with_model_digest(children, None) == children
    for built, child in zip(children, pinned, strict=True):
        role = built["metadata"].get("labels", {}).get("grpo.dev/role")
        if built["kind"] == "Pod" and role in ("rollout", "learner"):
            assert child["spec"]["containers"][0]["env"] == [*built["spec"]["containers"][0]["env"],
                                                            {"name": "GRPO_MODEL_DIGEST", "value": digest}]
        else:
            assert child == built  # the run config, the Services, the environment servers
