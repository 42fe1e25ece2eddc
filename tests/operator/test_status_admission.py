"""Kueue admission replayed through derive_status alone: what the pass saw of the run's Workload in, the actions
on it out (create, give back an evicted one's quota, resize, finish), one pass at a time, no API server.

The cluster's port turns a Workload into this observation (cluster/kueue.py `observe`, tested in test_kueue.py with
the emulator and in tests/controlplane/test_kueue.py with the real Kueue) and carries the actions out.
"""

from __future__ import annotations

import pytest

from grpo_operator.api import parse_spec
from grpo_operator.status import (
    CreateChildren,
    CreateWorkload,
    DeletePods,
    FinishWorkload,
    ReleaseQuota,
    ResizeWorkload,
    WorkloadObservation,
)
from grpo_operator.status.admission import InEffect, spec_counts, within_admission, workload_actions
from tests.operator.test_status import at, pod, report, running_pods, spec_of, step
from tests.operator.test_status_environments import environment_pod
from tests.support.specs import minimal_spec

WAITING = ("WaitingForAdmission", "waiting for Kueue to admit the run (LocalQueue team-q)")
EVICTED = ("Evicted", "evicted by Kueue: Preempted; pods deleted, the run resumes from its checkpoint when Kueue "
                      "admits it again")
ADMITTED = WorkloadObservation(exists=True, reserved=True)


def test_a_queued_run_is_admitted_evicted_given_back_admitted_again_and_finished_by_its_passes_alone():
    spec = spec_of(runPolicy={"cleanPodPolicy": "None"})
    # Queued, no Workload yet: the run waits, and the pass asks for its Workload (after the status is written).
    first = step(spec, {}, [], hold=WAITING, workload=WorkloadObservation(exists=False))
    assert first.status["phase"] == "Suspended" and first.actions == [CreateWorkload()]
    # Created, not admitted: nothing to do but wait.
    waiting = step(spec, first.status, [], now=at(5), hold=WAITING, workload=WorkloadObservation(exists=True))
    assert waiting.actions == []
    # Admitted: the pods.
    admitted = step(spec, waiting.status, [], now=at(10), workload=ADMITTED)
    assert admitted.actions == [CreateChildren()]
    running = step(spec, admitted.status, running_pods(), report(groupsConsumed=3, groupsTrained=3), now=at(20),
                   workload=ADMITTED)
    assert running.status["phase"] == "Running" and running.actions == []
    # Evicted: the pods go first; the quota is kept while any of them still runs.
    evicted = WorkloadObservation(exists=True, reserved=True, evicted=True)
    held = step(spec, running.status, running_pods(), now=at(30), hold=EVICTED, workload=evicted)
    assert held.status["phase"] == "Suspended"
    assert held.actions == [DeletePods(("r-learner-0", "r-rollout-0"), reason="suspended")]
    assert ReleaseQuota() not in step(spec, held.status, [pod("r-rollout-0")], now=at(31), hold=EVICTED,
                                      workload=evicted).actions
    # Every pod deleted (being deleted counts): the quota is given back, so Kueue queues the Workload again.
    going = [pod("r-rollout-0", terminating=True), pod("r-learner-0", terminating=True)]
    gone = step(spec, held.status, going, now=at(32), hold=EVICTED, workload=evicted)
    assert gone.actions == [ReleaseQuota()]
    requeued = step(spec, gone.status, [], now=at(33), hold=WAITING, workload=WorkloadObservation(exists=True))
    assert requeued.actions == []
    # Admitted again: the pods come back; the learner resumes and finishes; the Workload is marked Finished once.
    back = step(spec, requeued.status, [], now=at(40), workload=ADMITTED)
    assert back.actions == [CreateChildren()]
    final = report(phase="Succeeded", groupsConsumed=40, groupsTrained=40, epochsDone=1)
    done = [pod("r-rollout-0"), pod("r-learner-0", "Succeeded", False, exit_code=0,
                                    message=final.termination_message())]
    finished = step(spec, back.status, done, now=at(60), workload=ADMITTED)
    assert finished.status["phase"] == "Succeeded" and finished.actions == [FinishWorkload()]
    marked = WorkloadObservation(exists=True, reserved=True, finished=True)
    assert step(spec, finished.status, done, now=at(61), workload=marked).actions == []


def test_a_run_that_fails_while_admitted_finishes_its_workload_after_cleaning_its_pods():
    spec = spec_of(runPolicy={"backoffLimit": 0})
    running = step(spec, step(spec, {}, [], workload=ADMITTED).status, running_pods(), report(groupsTrained=1),
                   workload=ADMITTED)
    crashed = [pod("r-rollout-0"), pod("r-learner-0", "Failed", False, exit_code=1)]
    failed = step(spec, running.status, crashed, now=at(30), workload=ADMITTED)
    assert failed.status["phase"] == "Failed"
    assert failed.actions == [DeletePods(("r-rollout-0",), reason="cleanPodPolicy Running"), FinishWorkload()]


def test_a_run_without_a_queue_has_no_workload_action():
    spec = spec_of()
    assert step(spec, {}, []).actions == [CreateChildren()]


@pytest.mark.parametrize(("workload", "finished", "pods_exist", "actions"), [
    (WorkloadObservation(exists=True, resizable=True), False, False, [ResizeWorkload()]),
    # Kueue resizes no Workload that holds quota: the run keeps its admitted count (admission.within_admission).
    (WorkloadObservation(exists=True, reserved=True, resizable=True), False, True, []),
    (WorkloadObservation(exists=True, evicted=True), False, False, []),  # given back already
    (WorkloadObservation(exists=False), True, False, []),  # ended before it had one: nothing to finish
])
def test_the_workload_rule(workload, finished, pods_exist, actions):
    assert workload_actions(workload, finished=finished, pods_exist=pods_exist) == actions


@pytest.mark.parametrize("rollout, learner", [(1, 1), (3, 2), (2, 1)])
def test_a_run_within_its_admission_runs_as_its_spec_says(rollout, learner):
    """Fewer pods than admitted (a scale-down) need no new admission: the quota stays reserved."""
    spec = parse_spec(minimal_spec(rollout={"replicas": rollout}, learner={"nodes": learner}))
    assert within_admission(spec, {"rollout": 3, "learner": 2}, "grporun-r") == InEffect(spec)


def test_no_role_runs_more_pods_than_kueue_admitted_for_its_pod_set():
    spec = parse_spec(minimal_spec(rollout={"replicas": 3}, learner={"nodes": 2}))
    in_effect = within_admission(spec, {"rollout": 1, "learner": 2}, "grporun-r")
    assert (in_effect.spec.rollout.replicas, in_effect.spec.learner.nodes) == (1, 2)
    assert in_effect.refused.startswith("spec.rollout.replicas: 3 is more than the 1 rollout pod(s) Kueue admitted "
                                        "(Workload grporun-r); the run keeps the admitted count")
    assert spec.rollout.replicas == 3, "the spec itself is not changed"

    in_effect = within_admission(spec, {"rollout": 1, "learner": 1}, "grporun-r")
    assert (in_effect.spec.rollout.replicas, in_effect.spec.learner.nodes, in_effect.spec.learner_world_size) == (
        1, 1, 1)
    assert in_effect.refused.startswith("spec.rollout.replicas: 3 is more than the 1 rollout pod(s) Kueue admitted; "
                                        "spec.learner.nodes: 2 is more than the 1 learner pod(s) Kueue admitted")
    assert in_effect.environments_refused == {}


def test_an_environment_runs_no_more_servers_than_kueue_admitted_for_its_pod_set():
    spec = parse_spec(minimal_spec(environments=[{"name": "guess", "image": "game:1", "replicas": 3},
                                                 {"name": "other", "image": "game:1", "replicas": 1}]))
    assert spec_counts(spec) == {"rollout": 1, "learner": 1, "env-guess": 3, "env-other": 1}
    in_effect = within_admission(spec, {"rollout": 1, "learner": 1, "env-guess": 2, "env-other": 1}, "grporun-r")
    assert [e.replicas for e in in_effect.spec.environments] == [2, 1]
    assert in_effect.refused is None, "the rollout servers and the learner run as asked"
    assert list(in_effect.environments_refused) == ["guess"]
    assert in_effect.environments_refused["guess"].startswith(
        "spec.environments[0].replicas: 3 is more than the 2 env-guess pod(s) Kueue admitted (Workload grporun-r); "
        "the environment keeps the admitted count")


def test_an_environment_kueue_admitted_without_servers_gets_none_when_scaled_up_live():
    """An environment of 0 servers has no pod set in the Workload: Kueue admitted none of its pods, so a live scale
    from 0 is refused like any count above the admission, not run outside the quota."""
    spec = parse_spec(minimal_spec(environments=[{"name": "guess", "image": "game:1", "replicas": 2}]))
    in_effect = within_admission(spec, {"rollout": 1, "learner": 1}, "grporun-r")
    assert [e.replicas for e in in_effect.spec.environments] == [0]
    assert in_effect.environments_refused["guess"].startswith(
        "spec.environments[0].replicas: 2 is more than the 0 env-guess pod(s) Kueue admitted")


def test_a_refused_environment_scale_shows_on_its_status_entry_once_with_an_event():
    """status.environments[].wanted is the count in effect (what Kueue admitted); scaleRefused says why the count
    asked for is not, as status.rollout.scaleRefused does for the rollout servers."""
    asked = parse_spec(minimal_spec(environments=[{"name": "guess", "image": "game:1", "replicas": 3}]))
    in_effect = within_admission(asked, {"rollout": 1, "learner": 1, "env-guess": 1}, "grporun-r")
    spec, why = in_effect.spec, in_effect.environments_refused
    pods = [*running_pods(), environment_pod("r-env-guess-0")]
    first = step(spec, step(spec, {}, [], workload=ADMITTED).status, pods, report(groupsTrained=1),
                 workload=ADMITTED, environment_scale_refused=why)
    assert first.status["environments"] == [{"name": "guess", "wanted": 1, "replicas": 1, "ready": 1,
                                              "restarts": 0, "scaleRefused": why["guess"]}]
    assert "scaleRefused" not in first.status["rollout"]
    assert [(e.type, e.reason, e.message) for e in first.events if e.reason == "ScaleRefused"] == [
        ("Warning", "ScaleRefused", why["guess"])]
    again = step(spec, first.status, pods, report(groupsTrained=2), now=at(5), workload=ADMITTED,
                 environment_scale_refused=why)
    assert "ScaleRefused" not in [e.reason for e in again.events]
    cleared = step(spec, again.status, pods, report(groupsTrained=3), now=at(10), workload=ADMITTED)
    assert "scaleRefused" not in cleared.status["environments"][0]
