"""The pure rule for an existing child object CreateChildren finds: the run config rendered again for pods about to
start from an edited spec, the PodGroup resized with the gang, and nothing touched while the run has pods."""

from __future__ import annotations

from typing import Any

from grpo_operator import builders, podgroup
from grpo_operator.api import GENERATION_ANNOTATION, parse_spec
from grpo_operator.run_ref import RunRef
from grpo_operator.status.children import (
    child_patch,
    rendered_generation,
    service_replaced,
    stale_pod_groups,
    stale_services,
)
from tests.support.specs import minimal_spec

GANG = {"gang": {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 600}}


def built(kind: str, replicas: int = 2, generation: int = 1) -> dict[str, Any]:
    spec = minimal_spec(rollout={"replicas": replicas})
    spec["scheduling"] = GANG
    run = RunRef("run", "ml", "uid-1", generation=generation)
    (child,) = [c for c in builders.build_children(run, parse_spec(spec), trainer_image="img") if c["kind"] == kind]
    return child


def test_an_unchanged_config_map_and_pod_group_are_left_alone():
    for kind in ("ConfigMap", "PodGroup"):
        assert child_patch(built(kind), built(kind), generation=1, live=False) is None


def test_a_config_map_from_an_older_generation_is_rendered_again():
    existing, child = built("ConfigMap", generation=1), built("ConfigMap", generation=2)
    assert rendered_generation(existing) == 1
    patch = child_patch(child, existing, generation=2, live=False)
    assert patch == {"metadata": {"annotations": child["metadata"]["annotations"]}, "data": child["data"]}
    assert patch["metadata"]["annotations"][GENERATION_ANNOTATION] == "2"


def test_a_config_map_rendered_for_other_counts_is_rendered_again_at_the_same_generation():
    # Kueue admits a run again at the size its spec asked for after a refused one: same generation, more servers.
    child = built("ConfigMap", replicas=3)
    assert child_patch(child, built("ConfigMap", replicas=2), generation=1, live=False) == {
        "metadata": {"annotations": child["metadata"]["annotations"]}, "data": child["data"]}


def test_a_pod_group_of_another_size_is_patched_to_the_gangs_size():
    child = built("PodGroup", replicas=3)
    assert child_patch(child, built("PodGroup", replicas=2), generation=1, live=False) == {"spec": child["spec"]}


def test_a_live_runs_children_are_never_patched():
    assert child_patch(built("ConfigMap", replicas=3, generation=2), built("ConfigMap"), generation=2,
                       live=True) is None
    assert child_patch(built("PodGroup", replicas=3), built("PodGroup"), generation=1, live=True) is None


def test_a_missing_or_torn_generation_annotation_counts_as_the_first():
    assert rendered_generation({"metadata": {}}) == 1
    assert rendered_generation({"metadata": {"annotations": {GENERATION_ANNOTATION: "x"}}}) == 1


def environment_service(port: int) -> dict[str, Any]:
    spec = minimal_spec(environments=[{"name": "guess", "image": "game:1", "port": port}])
    run = RunRef("run", "ml", "uid-1")
    (service,) = [c for c in builders.build_children(run, parse_spec(spec), trainer_image="img")
                  if c["kind"] == "Service" and c["metadata"]["name"] == "run-env-guess"]
    return service


def test_an_environment_service_with_a_cluster_ip_is_replaced_live_or_not_as_its_cluster_ip_cannot_change():
    child = environment_service(8765)
    existing = environment_service(8765)
    existing["spec"] |= {"clusterIP": "10.0.0.7", "type": "ClusterIP", "sessionAffinity": "None"}
    assert service_replaced(child, existing)
    del existing["spec"]["clusterIP"]
    assert service_replaced(child, existing)
    existing["spec"]["clusterIP"] = "None"
    assert not service_replaced(child, existing)
    assert not service_replaced(built("ConfigMap"), built("ConfigMap"))


def test_a_service_forwarding_another_port_is_patched_and_the_api_servers_defaults_are_left_alone():
    existing = environment_service(8765)
    existing["spec"] |= {"clusterIP": "None", "type": "ClusterIP", "sessionAffinity": "None"}
    assert child_patch(environment_service(8765), existing, generation=1, live=False) is None
    child = environment_service(9000)
    assert child_patch(child, existing, generation=1, live=False) == {
        "spec": {"ports": child["spec"]["ports"], "selector": child["spec"]["selector"]}}
    assert child_patch(child, existing, generation=1, live=True) is None


def test_the_services_the_spec_no_longer_names_are_stale():
    children = [environment_service(8765), built("ConfigMap")]
    owned = [{"metadata": {"name": "run-env-guess"}}, {"metadata": {"name": "run-env-code"}}, {"metadata": {}}]
    assert stale_services(children, owned) == ["run-env-code"]


def test_a_pod_group_the_spec_no_longer_asks_for_is_stale():
    """The gang removed, or moved to the other scheduler (the other kind under the same name)."""
    def children(scheduling: dict[str, Any] | None) -> list[dict[str, Any]]:
        spec = minimal_spec() | ({"scheduling": scheduling} if scheduling else {})
        return builders.build_children(RunRef("run", "ml", "uid-1"), parse_spec(spec), trainer_image="img")

    assert stale_pod_groups(children(GANG)) == [podgroup.VOLCANO_API]
    assert stale_pod_groups(children({"gang": {"scheduler": "volcano"}})) == [podgroup.COSCHEDULING_API]
    assert stale_pod_groups(children(None)) == [podgroup.COSCHEDULING_API, podgroup.VOLCANO_API]


def test_a_pod_group_edited_while_suspended_is_patched_before_the_pods_start():
    existing, child = built("PodGroup"), built("PodGroup")
    child["spec"]["scheduleTimeoutSeconds"] = 60
    assert child_patch(child, existing, generation=2, live=False) == {"spec": child["spec"]}
