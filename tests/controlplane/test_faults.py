"""The operator's fault scenarios (tests/operator/test_faults.py, the same functions) on the real kube-apiserver,
with the operator running as the chart's ServiceAccount under the real RBAC authorizer. Each fault comes from the
server's own machinery (tests/support/controlplane/control_plane_faults.py): a pod held Terminating by a finalizer, the
DisruptionTarget condition on pod status, the Eviction API, a ResourceQuota's 403, a ValidatingAdmissionPolicy's
422, and a run deleted and created again while its old pods remain (no garbage collector runs).

Left out, with the reason:
- test_a_failed_delete_does_not_count_one_crash_twice: it needs one DELETE answered 409 and the next one served;
  the real server has no way to fail a single delete on demand (admission cannot answer 409);
- test_progress_alone_is_written_at_most_every_status_interval: it counts the status PATCH requests in the
  emulator's request log, and a write that changes nothing leaves no trace on the real server;
- the tests in tests/operator/test_status_faults.py: they step the pure state machine, with no API server at all.

test_spec_fields_from_a_newer_crd_are_ignored_not_fatal runs here too: the real server prunes the field the CRD
does not declare (the default field validation only warns), so the run goes ahead as on the emulator.
"""

from __future__ import annotations

import pytest

from tests.operator.test_faults import (  # noqa: F401 (collected here again, against the real server)
    test_a_create_blocked_for_a_minute_makes_a_handful_of_events_at_most,
    test_a_final_report_status_cannot_hold_does_not_keep_the_run_from_finishing,
    test_a_learner_pod_evicted_from_a_running_gang_restarts_the_gang,
    test_a_pod_security_refusal_fails_the_run_at_once_with_the_policys_message,
    test_a_pod_stuck_terminating_is_waited_for_and_the_wait_is_bounded,
    test_a_preempted_learner_restarts_the_gang_without_using_up_the_backoff_limit,
    test_a_quota_error_on_create_is_retried_and_shown_not_fatal,
    test_a_report_status_cannot_hold_is_shown_as_unknown_and_the_next_good_one_is_written,
    test_a_run_recreated_under_the_same_name_does_not_adopt_the_old_runs_pods,
    test_a_run_that_fails_as_invalid_spec_writes_its_status_once_per_pass,
    test_a_spec_edited_while_suspended_is_applied_whole_on_resume,
    test_a_terminating_pod_is_recreated_once_it_is_gone,
    test_an_event_that_comes_again_is_counted_on_one_object,
    test_an_invalid_child_fails_the_run_and_removes_the_pods_already_created,
    test_an_unready_rollout_server_keeps_the_run_running_and_its_clock_counting,
    test_spec_fields_from_a_newer_crd_are_ignored_not_fatal,
    test_unreadable_progress_is_reported_as_unknown_never_as_a_stall,
)
from tests.support.controlplane.control_plane_cluster import cluster  # noqa: F401 (the real-server `cluster` fixture)

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]
