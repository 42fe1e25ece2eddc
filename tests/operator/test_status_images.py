"""The image digests a run's pods ran, kept in the run config for the export's provenance (status/images.py): each
digest a running pod reports is added by role, none is dropped, and nothing is done while the config's images are
not known or already hold them."""

from __future__ import annotations

import json

from grpo_operator import run_config_map
from grpo_operator.status import PodObservation, RecordImages
from grpo_operator.status.images import images_to_record
from tests.operator.test_status import at, report, running_pods, spec_of, step
from tests.operator.test_status_rollout import running_with

OLD = "localhost/grpo-trainer@sha256:" + "1" * 64
NEW = "localhost/grpo-trainer@sha256:" + "2" * 64
GAME = "sha256:" + "3" * 64


def with_images(pods: list[PodObservation], image_id: str | None) -> list[PodObservation]:
    return [PodObservation(**{**vars(p), "image_id": image_id}) for p in pods]


def test_a_running_runs_images_are_recorded_in_its_config_once():
    status = running_with(spec_of(), 1)
    pods = with_images(running_pods(), OLD)
    first = step(spec_of(), status, pods, report(groupsConsumed=1), now=at(5), configured_images={})
    assert RecordImages({"learner": [OLD], "rollout": [OLD]}) in first.actions
    again = step(spec_of(), first.status, pods, report(groupsConsumed=2), now=at(10),
                 configured_images={"learner": [OLD], "rollout": [OLD]})
    assert not any(isinstance(action, RecordImages) for action in again.actions)


def test_images_are_not_recorded_before_the_config_is_read_or_the_containers_started():
    status = running_with(spec_of(), 1)
    unknown = step(spec_of(), status, with_images(running_pods(), OLD), report(groupsConsumed=1), now=at(5))
    unstarted = step(spec_of(), status, running_pods(), report(groupsConsumed=1), now=at(5), configured_images={})
    assert not any(isinstance(action, RecordImages) for action in unknown.actions + unstarted.actions)


def test_a_new_digest_joins_the_ones_recorded_and_environments_are_keyed_by_name():
    configured = {"rollout": [OLD], "learner": [OLD]}
    pods = [PodObservation("r-rollout-0", "rollout", "Running", True, image_id=NEW),
            PodObservation("r-learner-0", "learner", "Running", True, image_id=OLD),
            PodObservation("r-env-guess-0", "environment", "Running", True, image_id=GAME),
            PodObservation("r-env-guess-1", "environment", "Running", True, image_id=GAME)]
    assert images_to_record("r", ["guess"], pods, configured) == {
        "rollout": [OLD, NEW], "learner": [OLD], "environment/guess": [GAME]}
    recorded = {"rollout": [NEW, OLD], "learner": [OLD], "environment/guess": [GAME]}
    assert images_to_record("r", ["guess"], pods, recorded) is None
    assert images_to_record("r", ["guess"], pods, None) is None


def test_a_config_maps_images_are_read_and_set_in_place():
    data = {"run.json": json.dumps({"rollout": {"urls": ["u"]}, "images": {"learner": [OLD]}})}
    config_map = {"metadata": {"name": "r-config"}, "data": data}
    assert run_config_map.images_of(config_map) == {"learner": [OLD]}
    assert run_config_map.images_of({"data": {"run.json": json.dumps({"rollout": {}})}}) == {}
    assert run_config_map.images_of({"data": {"run.json": "{torn"}}) is None
    assert run_config_map.with_images(config_map, {"learner": [OLD]}) is None  # already there: no write
    written = run_config_map.with_images(config_map, {"learner": [OLD, NEW]})
    assert json.loads(written["run.json"]) == {"rollout": {"urls": ["u"]}, "images": {"learner": [OLD, NEW]}}
