"""The real kopf operator against the API emulator: whole lifecycles, pods driven the way a kubelet would."""

from __future__ import annotations

import pytest
from operator_fixtures import NAMESPACE, grporun, minimal_spec

pytest_plugins = ["operator_fixtures"]
pytestmark = pytest.mark.slow


def test_apply_creates_config_map_services_and_pods_owned_by_the_run(cluster):
    run = cluster.apply(grporun("alpha", minimal_spec(rollout={"replicas": 2})))
    uid = run["metadata"]["uid"]
    cluster.wait_for(lambda: len(cluster.pods("alpha")) == 3, what="3 pods")
    assert cluster.pod_names("alpha") == ["alpha-learner-0", "alpha-rollout-0", "alpha-rollout-1"]
    assert sorted(s["metadata"]["name"] for s in cluster.services("alpha")) == ["alpha-learner", "alpha-rollout"]
    assert [c["metadata"]["name"] for c in cluster.config_maps("alpha")] == ["alpha-config"]
    for child in cluster.pods("alpha") + cluster.services("alpha") + cluster.config_maps("alpha"):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "name": "alpha", "uid": uid,
                         "controller": True, "blockOwnerDeletion": True}
    status = cluster.wait_phase("alpha", "Pending")
    assert status["observedGeneration"] == 1
    assert "grpo.dev/finalizer" in cluster.run("alpha")["metadata"]["finalizers"]
