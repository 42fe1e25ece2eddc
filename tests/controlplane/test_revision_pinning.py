"""One revision for the whole run on the real kube-apiserver, the real kopf operator logged in as the chart's
ServiceAccount: the scenario of tests/operator/test_revision_pinning.py (the stand-in hub's branch moved mid-run, a
rollout server a scale-up adds afterwards) on the real server's ConfigMaps, status subresource and pods. The
account may not read Secrets, so the hub is asked with the operator's own token (none here: the model is public)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.operator.test_revision_pinning import (  # noqa: F401
    hub_cluster,
    test_a_branch_moved_mid_run_leaves_every_pod_on_the_pinned_commit,
)
from tests.support.controlplane.control_plane_cluster import RealCluster, real_cluster

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


@pytest.fixture()
def cluster(control_plane, admin, operator_account, namespace, progress_urls,
            emulator_options) -> Iterator[RealCluster]:
    with real_cluster(control_plane, admin, operator_account, namespace, progress_urls, emulator_options) as real:
        yield real
