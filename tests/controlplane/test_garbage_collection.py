"""Scenarios that need the garbage collector, on the real kube-apiserver with kube-controller-manager running that
controller alone (the `garbage_collector` fixture): a run's children go by their ownerReferences, not by the
operator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.operator.test_lifecycle import (  # noqa: F401 (collected here again, against the real server)
    test_ttl_after_finished_deletes_the_run_and_its_children,
)
from tests.support.controlplane.control_plane_cluster import RealCluster, real_cluster

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]


@pytest.fixture()
def cluster(garbage_collector, control_plane, admin, operator_account, namespace, progress_urls,
            emulator_options) -> Iterator[RealCluster]:
    with real_cluster(control_plane, admin, operator_account, namespace, progress_urls, emulator_options) as real:
        yield real
