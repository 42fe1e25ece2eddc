"""A live change of spec.rollout.replicas in the pure status derivation: a scale-up creates the new servers' pods
and keeps the learner; a scale-down takes the removed servers out of the run config first, then deletes each pod
once the learner no longer reports it, or after the drain deadline."""

from __future__ import annotations

import json

import pytest

from grpo_operator import builders, run_config_map
from grpo_operator.run_ref import RunRef
from grpo_operator.status import ConfigureRollout, CreateChildren, DeletePods
from grpo_operator.status.scaling import gang_scale_in_effect
from tests.operator.test_status import at, condition, pod, reasons, report, running_pods, spec_of, step
from tests.operator.test_status_rollout import crashed, running_with

#: request_timeout 5 s + the pods' 30 s grace period.
QUICK_DRAIN = {"extraArgs": {"request_timeout": 5}}
DEADLINE = 35


def servers(*states: str) -> list[dict]:
    """The learner's report of servers 0.. in these states (`-` leaves that replica out)."""
    return [{"replica": i, "url": f"http://r-rollout-{i}.r-rollout.ns.svc:8000", "ready": state == "serving",
             "state": state} for i, state in enumerate(states) if state != "-"]


def scaled(replicas: int):
    return spec_of(rollout={"replicas": replicas}, training=QUICK_DRAIN)


def test_a_scale_up_creates_the_new_servers_and_keeps_the_learner_running():
    status = running_with(scaled(1), 1)
    decision = step(scaled(3), status, running_pods(replicas=1), report(groupsConsumed=4, groupsTrained=4,
                                                                        rollout=servers("serving")), now=at(5))
    assert decision.actions == [CreateChildren()]  # the missing ordinals 1 and 2; no pod is deleted or recreated
    assert decision.status["phase"] == "Running"
    assert "Scaled" in reasons(decision)
    rollout = decision.status["rollout"]
    assert rollout["replicas"] == 1  # pods that exist: the scale subresource's status replicas
    assert rollout["selector"] == "grpo.dev/run=r,grpo.dev/role=rollout"
    assert [server["replica"] for server in rollout["servers"]] == [0, 1, 2]
    assert condition(decision.status, "RolloutReady")["message"] == "1/3 rollout servers ready"
    up = step(scaled(3), decision.status, running_pods(replicas=3), report(groupsConsumed=5, groupsTrained=5,
              rollout=servers("serving", "joining", "serving")), now=at(10))
    assert up.actions == [] and up.status["rollout"]["replicas"] == 3
    assert [s.get("state") for s in up.status["rollout"]["servers"]] == ["serving", "joining", "serving"]
    assert "Scaled" not in reasons(up)


def test_a_scale_down_waits_for_the_learner_to_drain_each_removed_server():
    status = running_with(scaled(3), 3)
    progress = report(groupsConsumed=4, groupsTrained=4, rollout=servers("serving", "serving", "serving"))
    down = step(scaled(1), status, running_pods(replicas=3), progress, now=at(5))
    # The URLs leave the run config first; the learner has not seen that yet, so no pod goes.
    assert down.actions == [ConfigureRollout(1)]
    assert "Scaled" in reasons(down) and down.status["phase"] == "Running"
    rollout = down.status["rollout"]
    assert rollout["replicas"] == 3
    assert [(s["replica"], s.get("drainStartTime")) for s in rollout["servers"]] == [
        (0, None), (1, "2026-01-01T12:00:05Z"), (2, "2026-01-01T12:00:05Z")]
    assert condition(down.status, "RolloutReady")["message"] == "1/1 rollout servers ready"
    # Server 2 has left the learner's report; server 1 still drains.
    progress = report(groupsConsumed=5, groupsTrained=5, rollout=servers("serving", "draining"))
    one_left = step(scaled(1), down.status, running_pods(replicas=3), progress, now=at(10))
    assert one_left.actions == [ConfigureRollout(1), DeletePods(("r-rollout-2",), reason="drained")]
    assert reasons(one_left) == ["Drained"]
    assert one_left.status["rollout"]["servers"][1]["state"] == "draining"
    # The drain start is kept from the first pass that saw the server surplus, not restarted by later passes.
    assert one_left.status["rollout"]["servers"][1]["drainStartTime"] == "2026-01-01T12:00:05Z"
    pods = [p for p in running_pods(replicas=3) if p.name != "r-rollout-2"]
    gone = step(scaled(1), one_left.status, pods, report(groupsConsumed=6, groupsTrained=6,
                rollout=servers("serving")), now=at(15))
    assert gone.actions == [ConfigureRollout(1), DeletePods(("r-rollout-1",), reason="drained")]
    assert gone.status["phase"] == "Running" and gone.status["restarts"] == 0



def test_servers_scaled_back_while_they_drain_join_the_run_config_again():
    """3 -> 1 -> 3 before servers 1 and 2 have drained: their pods are kept, so none is missing, and the run config
    must list their URLs again (the learner admits them again), whatever count it lists now."""
    status = running_with(scaled(3), 3)
    progress = report(groupsConsumed=4, groupsTrained=4, rollout=servers("serving", "serving", "serving"))
    down = step(scaled(1), status, running_pods(replicas=3), progress, now=at(5), configured_servers=3)
    assert down.actions == [ConfigureRollout(1)]
    draining = report(groupsConsumed=5, groupsTrained=5, rollout=servers("serving", "draining", "draining"))
    back = step(scaled(3), down.status, running_pods(replicas=3), draining, now=at(8), configured_servers=1)
    assert back.actions == [ConfigureRollout(3)]  # no pod to create, none to delete
    assert [s.get("drainStartTime") for s in back.status["rollout"]["servers"]] == [None, None, None]
    assert condition(back.status, "RolloutReady")["message"] == "3/3 rollout servers ready"
    # The config written (or read) lists the three: nothing more to do.
    joined = report(groupsConsumed=6, groupsTrained=6, rollout=servers("serving", "joining", "serving"))
    assert step(scaled(3), back.status, running_pods(replicas=3), joined, now=at(10),
                configured_servers=3).actions == []


def test_a_run_config_that_lists_other_servers_than_the_spec_is_rewritten():
    """Whatever made them differ (an operator restarted between a scale and its config write, a patch that
    failed), a live run's config follows spec.rollout.replicas."""
    status = running_with(scaled(2), 2)
    progress = report(groupsConsumed=4, groupsTrained=4, rollout=servers("serving"))
    assert step(scaled(2), status, running_pods(replicas=2), progress, now=at(5),
                configured_servers=1).actions == [ConfigureRollout(2)]


def test_a_server_scaled_away_and_back_keeps_its_restart_count():
    spec = scaled(2)
    status = running_with(spec, 2)
    restarted = step(spec, status, [*running_pods(replicas=1), crashed("r-rollout-1", 1)], now=at(5)).status
    assert restarted["rollout"]["servers"][1]["restarts"] == 1 and restarted["rollout"]["restarts"] == 1
    back_up = step(spec, restarted, running_pods(replicas=2), now=at(6)).status
    down = step(scaled(1), back_up, running_pods(replicas=2), None, now=at(10))
    gone = step(scaled(1), down.status, running_pods(replicas=1), None, now=at(15)).status
    assert [s["replica"] for s in gone["rollout"]["servers"]] == [0]  # status lists the servers that serve or drain
    assert gone["rollout"]["restarts"] == 1  # the run's total keeps the removed server's restarts
    up = step(spec, gone, running_pods(replicas=1), None, now=at(20))
    assert up.status["rollout"]["servers"][1]["restarts"] == 1 and up.status["rollout"]["restarts"] == 1
    again = step(spec, up.status, [*running_pods(replicas=1), crashed("r-rollout-1", 1, restarts=1)], now=at(25))
    assert again.status["rollout"]["servers"][1]["restarts"] == 2

def test_a_server_still_reported_after_the_drain_deadline_is_deleted_with_a_warning():
    status = running_with(scaled(2), 2)
    still = report(groupsConsumed=4, groupsTrained=4, rollout=servers("serving", "draining"))
    down = step(scaled(1), status, running_pods(replicas=2), still, now=at(5))
    waiting = step(scaled(1), down.status, running_pods(replicas=2), still, now=at(5 + DEADLINE - 1))
    assert waiting.actions == [ConfigureRollout(1)]
    overdue = step(scaled(1), waiting.status, running_pods(replicas=2), still, now=at(5 + DEADLINE))
    assert overdue.actions == [ConfigureRollout(1), DeletePods(("r-rollout-1",), reason="drained")]
    [event] = [e for e in overdue.events if e.reason == "DrainDeadlineExceeded"]
    assert event.type == "Warning"
    assert event.message.startswith("r-rollout-1 left the rollout set 35 s ago (the drain deadline) and the learner "
                                    "still reports it draining: deleting it anyway")


def test_an_unreadable_learner_report_waits_for_the_drain_deadline():
    status = running_with(scaled(2), 2)
    down = step(scaled(1), status, running_pods(replicas=2), None, now=at(5),
                progress_error="connection refused")
    assert down.actions == [ConfigureRollout(1)]
    overdue = step(scaled(1), down.status, running_pods(replicas=2), None, now=at(5 + DEADLINE),
                   progress_error="connection refused")
    assert DeletePods(("r-rollout-1",), reason="drained") in overdue.actions
    [event] = [e for e in overdue.events if e.reason == "DrainDeadlineExceeded"]
    assert "the learner's progress cannot be read" in event.message


def test_with_no_learner_running_a_removed_server_goes_at_once():
    status = running_with(scaled(2), 2)
    pods = [pod("r-rollout-0"), pod("r-rollout-1"), pod("r-learner-0", "Pending", False)]
    down = step(scaled(1), status, pods, None, now=at(5))
    assert DeletePods(("r-rollout-1",), reason="drained") in down.actions
    assert down.actions[0] == ConfigureRollout(1)


def test_a_removed_server_that_exits_is_deleted_not_restarted():
    status = running_with(scaled(2), 2)
    pods = [pod("r-rollout-0"), crashed("r-rollout-1", code=1), pod("r-learner-0")]
    decision = step(scaled(1), status, pods, report(groupsConsumed=4, groupsTrained=4,
                    rollout=servers("serving", "draining")), now=at(5))
    assert decision.actions == [ConfigureRollout(1), DeletePods(("r-rollout-1",), reason="drained")]
    assert "RolloutRestarted" not in reasons(decision)
    assert decision.status["rollout"]["restarts"] == 0 and decision.status["phase"] == "Running"


def test_a_refused_scale_is_reported_once_and_cleared():
    status = running_with(scaled(2), 2)
    why = "spec.rollout.replicas: 3 is not applied to the running run, which keeps 2 rollout servers: ..."
    first = step(scaled(2), status, running_pods(replicas=2), report(groupsConsumed=4, groupsTrained=4), now=at(5),
                 scale_refused=why)
    assert reasons(first) == ["ScaleRefused"] and first.status["rollout"]["scaleRefused"] == why
    again = step(scaled(2), first.status, running_pods(replicas=2), report(groupsConsumed=4, groupsTrained=4),
                 now=at(10), scale_refused=why)
    assert "ScaleRefused" not in reasons(again) and again.actions == []
    cleared = step(scaled(2), again.status, running_pods(replicas=2), report(groupsConsumed=4, groupsTrained=4),
                   now=at(15))
    assert "scaleRefused" not in cleared.status["rollout"]


# --- builders ----------------------------------------------------------------------------------------------------
RUN = RunRef("r", "ns", "uid-r", 1)


def test_the_run_config_gets_new_rollout_urls_and_keeps_the_rest():
    config_map = builders.build_config_map(RUN, scaled(1))
    config = json.loads(config_map["data"]["run.json"])
    urls = builders.rollout_urls("r", "ns", 3)
    data = run_config_map.with_rollout_urls(config_map, urls)
    rewritten = json.loads(data["run.json"])
    assert rewritten["rollout"]["urls"] == urls == [
        f"http://r-rollout-{i}.r-rollout.ns.svc:8000" for i in range(3)]
    assert {**rewritten, "rollout": None} == {**config, "rollout": None}
    assert {k: v for k, v in rewritten["rollout"].items() if k != "urls"} == {
        k: v for k, v in config["rollout"].items() if k != "urls"}
    assert run_config_map.rollout_urls_of({"data": data}) == urls
    assert run_config_map.with_rollout_urls({"data": data}, urls) is None  # already there: no write


@pytest.mark.parametrize("text", ["", "{\"rollout\": [", "[]", "{\"model\": \"m\"}"])
def test_a_torn_run_config_is_refused_not_rewritten(text):
    with pytest.raises(ValueError, match="run.json in ConfigMap r-config has no rollout object"):
        run_config_map.with_rollout_urls({"metadata": {"name": "r-config"}, "data": {"run.json": text}}, ["u"])
    assert run_config_map.rollout_urls_of({"data": {"run.json": text}}) is None


def test_the_drain_deadline_is_the_request_timeout_plus_the_grace_period():
    assert builders.drain_deadline_seconds(spec_of()) == 600 + 30
    assert builders.drain_deadline_seconds(scaled(1)) == DEADLINE
    assert builders.drain_deadline_seconds(spec_of(training={"extraArgs": {"request_timeout": "x"}})) == 630
    slow_stop = spec_of(rollout={"podTemplateOverride": {"spec": {"terminationGracePeriodSeconds": 90}}})
    assert builders.drain_deadline_seconds(slow_stop) == 600 + 90


def test_the_rollout_selector_selects_what_the_rollout_pods_carry():
    pod_labels = builders.build_rollout_pod(RUN, scaled(1), 0, trainer_image="img")["metadata"]["labels"]
    selector = builders.rollout_selector("r")
    assert dict(part.split("=") for part in selector.split(",")).items() <= pod_labels.items()
    learner_labels = builders.build_learner_pod(RUN, scaled(1), 0, trainer_image="img")["metadata"]["labels"]
    assert not dict(part.split("=") for part in selector.split(",")).items() <= learner_labels.items()


def gang_spec(replicas: int):
    return spec_of(rollout={"replicas": replicas}, scheduling={"gang": {"scheduler": "coscheduling"}})


def test_a_gang_keeps_the_servers_it_started_with_and_says_how_to_get_more():
    in_effect, refused = gang_scale_in_effect(gang_spec(3), configured_servers=2)
    assert in_effect.rollout.replicas == 2
    assert refused == ("spec.rollout.replicas: 3 is not applied to the running run, which keeps 2 rollout servers: "
                       "its pods are one gang (spec.scheduling.gang) whose PodGroup counts them; set it back to 2, "
                       "or create a new run with the count you need")


@pytest.mark.parametrize("spec, configured", [
    (scaled(3), 2),  # no gang: a live scale goes through (ConfigureRollout, DeletePods)
    (gang_spec(2), 2),  # the count it runs with
    (gang_spec(3), None),  # the run config not read yet
])
def test_a_replica_count_a_run_can_take_is_not_refused(spec, configured):
    assert gang_scale_in_effect(spec, configured) == (spec, None)
