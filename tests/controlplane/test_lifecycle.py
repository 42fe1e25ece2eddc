"""The operator's lifecycle scenarios (tests/test_operator_lifecycle.py, the same functions) on the real
kube-apiserver, with the operator running as the chart's ServiceAccount under the real RBAC authorizer.

Importing a scenario here makes pytest run it again with this module's `cluster` fixture: one suite, two backends.
Left out, with the reason:
- test_ttl_after_finished_deletes_the_run_and_its_children: children go by ownerReference garbage collection,
  kube-controller-manager's job; it runs in tests/controlplane/test_garbage_collection.py, with the collector;
- test_a_lifecycle_survives_watch_streams_that_keep_ending and
  test_events_are_read_only_for_pods_that_are_not_ready_and_without_the_permission_the_run_goes_on: they read the
  emulator's request log;
- test_bad_spec_fails_with_a_field_naming_reason_and_creates_nothing: the real server refuses that spec at
  creation (tests/controlplane/test_api.py checks that), so the operator never sees it.
"""

from __future__ import annotations

import pytest

from tests.operator.test_lifecycle import (  # noqa: F401 (collected here again, against the real server)
    test_a_child_the_api_server_rejects_fails_the_run_naming_it,
    test_a_clean_pod_policy_changed_after_the_run_finished_is_applied,
    test_a_newer_learners_report_keeps_the_runs_status_moving,
    test_a_rollout_server_that_exits_is_replaced_alone_until_its_restart_limit,
    test_a_run_another_controller_manages_gets_no_children_and_no_status,
    test_a_server_that_runs_but_is_never_ready_is_explained_by_the_kubelets_probe_failures,
    test_a_ttl_set_after_the_run_finished_deletes_it,
    test_an_unknown_built_in_reward_fails_at_once_and_creates_nothing,
    test_apply_creates_config_map_services_and_pods_owned_by_the_run,
    test_crash_restarts_then_fails_after_backoff_limit,
    test_environment_services_follow_a_spec_edited_while_suspended,
    test_image_pull_backoff_surfaces_a_reason,
    test_learner_exit_zero_succeeds_and_removes_rollout_pods,
    test_learner_progress_lands_in_status_and_printer_columns,
    test_no_progress_for_the_deadline_sets_stalled_and_clears_when_progress_resumes,
    test_one_failed_learner_node_restarts_the_whole_learner_gang,
    test_operator_restart_mid_run_creates_no_duplicates_and_status_continues,
    test_stall_exit_fails_with_reason_stalled_and_no_retry,
    test_suspend_deletes_pods_and_resume_recreates_them,
)
from tests.support.controlplane.control_plane_cluster import cluster  # noqa: F401 (the real-server `cluster` fixture)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]
