"""The engine's pass: observe -> derive -> write -> act, each action through the one table to the port's method.

Both adapters (cluster/reconcile.py, local/supervise.py) run this pass; the scenario tests (test_lifecycle.py, the
control plane's, `grporun local`'s) exercise it through them. Here: the pass's order, the table's coverage, and that
no other module of the package runs a pass of its own.
"""

from __future__ import annotations

import ast
import asyncio
import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from grpo_operator import engine
from grpo_operator import status as st
from grpo_operator.api import parse_spec
from grpo_operator.engine import ACTIONS, QUEUE_ACTIONS, NoQueue, Observed, QueuedRunPort, run_pass
from grpo_operator.run_ref import RunRef
from tests.support.paths import REPO
from tests.support.specs import minimal_spec

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
PACKAGE = REPO / "operator" / "grpo_operator"


class RecordingPort:
    """A port that records what the pass asks of it, in order."""

    def __init__(self, seen: st.Observation, *, written: bool = True, status: dict[str, Any] | None = None):
        self.spec = parse_spec(minimal_spec())
        self.seen, self.written, self.status = seen, written, status
        self.calls: list[tuple] = []

    async def observe(self) -> Observed[str]:
        self.calls.append(("observe",))
        return Observed(self.spec, self.status, self.seen, "what this pass read")

    async def write(self, observed: Observed[str], decision: st.Decision) -> bool:
        assert observed.state == "what this pass read"
        self.calls.append(("write", decision.status["phase"]))
        return self.written

    async def configure_rollout(self, observed: Observed[str], replicas: int) -> None:
        self.calls.append(("configure_rollout", replicas))

    async def record_images(self, observed: Observed[str], images: Mapping[str, Sequence[str]]) -> None:
        self.calls.append(("record_images", dict(images)))

    async def create_children(self, observed: Observed[str], status: dict[str, Any]) -> None:
        self.calls.append(("create_children", status["phase"]))

    async def delete_pods(self, observed: Observed[str], pods: tuple[str, ...], reason: str) -> None:
        self.calls.append(("delete_pods", pods, reason))

    async def recreate_pods(self, observed: Observed[str], pods: tuple[str, ...]) -> None:
        self.calls.append(("recreate_pods", pods))

    async def delete_run(self, observed: Observed[str]) -> None:
        self.calls.append(("delete_run",))


RUN = RunRef("tiny", "default", uid="u1")


def test_a_pass_observes_derives_writes_then_acts_on_what_it_wrote():
    port = RecordingPort(st.Observation([], None, NOW, children_exist=False))
    outcome = asyncio.run(run_pass(RUN, port))
    assert outcome is not None and outcome.decision.actions == [st.CreateChildren()]
    assert outcome.observed.state == "what this pass read"
    assert port.calls == [("observe",), ("write", "Pending"), ("create_children", "Pending")]


def test_a_run_gone_at_the_write_gets_no_action():
    port = RecordingPort(st.Observation([], None, NOW, children_exist=False), written=False)
    assert asyncio.run(run_pass(RUN, port)) is None
    assert port.calls == [("observe",), ("write", "Pending")]


def test_a_scale_down_configures_the_rollout_before_it_deletes_a_drained_server():
    spec = parse_spec(minimal_spec())
    pods = [st.PodObservation("tiny-rollout-0", "rollout", "Running", True),
            st.PodObservation("tiny-rollout-1", "rollout", "Succeeded", False, exit_code=0),
            st.PodObservation("tiny-learner-0", "learner", "Running", True)]
    port = RecordingPort(st.Observation(pods, None, NOW, configured_servers=2), status={"phase": "Running"})
    port.spec = spec
    asyncio.run(run_pass(RUN, port))
    assert port.calls[2:] == [("configure_rollout", 1), ("delete_pods", ("tiny-rollout-1",), "drained")]


class QueuedRecordingPort(RecordingPort):
    """A port with Kueue admission (engine.QueuedRunPort)."""

    async def create_workload(self, observed: Observed[str]) -> None:
        self.calls.append(("create_workload",))

    async def release_quota(self, observed: Observed[str]) -> None:
        self.calls.append(("release_quota",))

    async def resize_workload(self, observed: Observed[str]) -> None:
        self.calls.append(("resize_workload",))

    async def finish_workload(self, observed: Observed[str], status: dict[str, Any]) -> None:
        self.calls.append(("finish_workload", status["phase"]))


def test_a_queued_runs_workload_actions_go_to_a_port_with_kueue_admission():
    waiting = ("WaitingForAdmission", "waiting for Kueue to admit the run (LocalQueue q)")
    seen = st.Observation([], None, NOW, hold=waiting, workload=st.WorkloadObservation(exists=False))
    port = QueuedRecordingPort(seen)
    assert isinstance(port, QueuedRunPort) and not isinstance(RecordingPort(seen), QueuedRunPort)
    asyncio.run(run_pass(RUN, port))
    assert port.calls == [("observe",), ("write", "Suspended"), ("create_workload",)]


def test_a_workload_action_decided_for_a_port_without_kueue_is_an_error_before_anything_is_written():
    seen = st.Observation([], None, NOW, spec_error="spec.x: bad", workload=st.WorkloadObservation(exists=True))
    port = RecordingPort(seen)
    with pytest.raises(NoQueue, match="RecordingPort has no Kueue admission, but the pass decided FinishWorkload"):
        asyncio.run(run_pass(RUN, port))
    assert port.calls == [("observe",)]


@pytest.mark.parametrize("action", [cls for cls in vars(st).values()
                                    if isinstance(cls, type) and issubclass(cls, st.Action) and cls is not st.Action])
def test_every_action_the_derivation_can_return_has_one_port_method(action):
    assert (action in ACTIONS) != (action in QUEUE_ACTIONS)


def _calls(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
               for node in ast.walk(tree))


def test_the_package_runs_its_passes_through_the_engine_alone():
    """derive_status is called in one place outside the state machine itself: the engine's pass."""
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if path.parent.name != "status" and _calls(path, "derive_status"))
    assert callers == [Path(engine.__file__).name]
    runners = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _imports_run_pass(path)}
    assert runners == {"cluster/reconcile.py", "local/supervise.py"}


def _imports_run_pass(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").endswith("engine")
               and any(alias.name == "run_pass" for alias in node.names) for node in ast.walk(tree))
