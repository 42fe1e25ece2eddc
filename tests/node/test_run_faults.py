"""What happens to a run on a real node, from the user's side: the kubelet's probes, signals and memory limits, the
Eviction API, and a two-pod learner gang. Each fault is one a cluster makes: a server frozen with SIGSTOP (its
liveness probe finds it), `kubectl drain`, `kubectl delete pod`, a memory limit the learner exceeds. The operator
is the chart's, in its container (tests/support/node/operator_release.py); the pods run the trainer image."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_operator.api import RUN_LABEL
from grpo_trainer.contract.codes import EXIT_PREEMPTED
from grpo_trainer.learner.checkpoints import PROGRESS_STATE_FILE
from tests.support.node.node import NODE_NAME
from tests.support.node.node_runs import RUN, NodeRun, host_folder, shared_folder, store_access, tiny_manifest
from tests.support.node.operator_release import OperatorRelease
from tests.support.servers.s3_server import S3Server
from tests.support.servers.vllm_server import EAGER_VLLM_ARGS

pytestmark = [pytest.mark.node, pytest.mark.slow]

LEARNER, ROLLOUT = f"{RUN}-learner-0", f"{RUN}-rollout-0"
RESUMED = "resumed: restarting at group"
#: The liveness-and-drain run's hang guard: three server starts in pods (minutes each on a loaded machine), the
#: kubelet's liveness verdict and grace (about 3 min) and the training; each of its waits ends when the run fails.
LONG_HANG_GUARD_S = 3600
#: A wait of that run with no bound of its own: what it waits for (a liveness verdict, a server's start, an eviction)
#: has the kubelet's and the operator's bounds, and a run past them fails, which ends the wait (NodeRun.wait_for).
UNTIL_THE_RUN_FAILS = math.inf
#: `grporun export --cluster`'s wait for its pod: the trainer image is on the node, the tiny model exports in seconds.
EXPORT_TIMEOUT_S = 600


def _run(release: OperatorRelease, name: str, tmp_path: Path) -> NodeRun:
    return NodeRun(release, release.node.create_namespace(name), tmp_path)


def _resumable_manifest(tiny_data: Path, tmp_path: Path) -> dict:
    """The tiny run with its checkpoints on a folder that outlives the pods, so a restarted learner resumes. Its
    servers skip vLLM's compiled warm-up (test_tiny_run.py runs the compiled path): these runs start up to three."""
    manifest = tiny_manifest(host_folder(tiny_data), host_folder(shared_folder(tmp_path / "weights", writable=True)))
    manifest["spec"]["checkpoint"]["volume"] = host_folder(shared_folder(tmp_path / "checkpoints", writable=True))
    manifest["spec"]["rollout"]["vllm"]["extraArgs"] = list(EAGER_VLLM_ARGS)
    return manifest


def _exits_seen(run: NodeRun) -> str:
    """Each ended container in a line a failure shows whole: exit code, reason, times, and its message's start (an
    exit code alone does not say whether a SIGKILL came after the outcome was written or before)."""
    return "\n".join(f"{pod}: {state.get('exitCode')} {state.get('reason')} {state.get('startedAt')} -> "
                     f"{state.get('finishedAt')}: {state.get('message', '')[:400]!r}"
                     for pod, state in run.history.exits().items())


def _exit_codes(run: NodeRun, pod: str) -> list[int]:
    return [state["exitCode"] for state in run.history.exits_of(pod)]


@pytest.mark.long
@pytest.mark.timeout(LONG_HANG_GUARD_S)
def test_a_frozen_server_is_restarted_by_its_liveness_probe_and_a_drained_run_resumes_at_the_bound(
        operator_release: OperatorRelease, tiny_data: Path, tmp_path: Path):
    node = operator_release.node
    run = _run(operator_release, "faults-drain", tmp_path)
    manifest = _resumable_manifest(tiny_data, tmp_path)
    # The drain comes at about step 4: a third of the tiny run's 58 steps is enough to resume into (5 min less).
    manifest["spec"]["training"]["epochs"] = 4
    try:
        run.apply(manifest)
        run.wait_for_log(LEARNER, "weight sync v2:", timeout=UNTIL_THE_RUN_FAILS)
        # SIGSTOP: the server keeps its port and /health's socket, but nothing answers; only the liveness probe's
        # generated token tells. The kubelet kills the container, the operator replaces the server.
        [server] = run.pod(ROLLOUT)["status"]["containerStatuses"]
        node.signal_container(server["containerID"], signal.SIGSTOP)
        run.wait_for(lambda: len(run.history.uids(ROLLOUT)) >= 2, "the frozen server replaced",
                     timeout=UNTIL_THE_RUN_FAILS)
        run.wait_for_log(LEARNER, "caught up to", timeout=UNTIL_THE_RUN_FAILS)

        # `kubectl drain` of the run's pods: the Eviction API, SIGTERM within the grace period.
        node.kubectl("drain", NODE_NAME, f"--pod-selector={RUN_LABEL}={RUN}", "--delete-emptydir-data",
                     "--ignore-daemonsets", "--timeout=180s", timeout=240)
        run.wait_for(lambda: len(run.history.uids(LEARNER)) >= 2, "the evicted learner recreated",
                     timeout=UNTIL_THE_RUN_FAILS)
        node.kubectl("uncordon", NODE_NAME)
        status = run.wait_succeeded()
    finally:
        node.kubectl("uncordon", NODE_NAME, check=False)
        run.close()
    events = node.kubectl("get", "events", "-n", run.namespace, "--field-selector",
                          f"involvedObject.name={ROLLOUT}").stdout
    assert "Liveness probe failed" in events, events
    [replaced] = status["rollout"]["servers"]
    assert replaced.get("restarts", 0) >= 1, status["rollout"]  # the liveness kill: the server's own counter
    assert EXIT_PREEMPTED in _exit_codes(run, LEARNER), _exits_seen(run)  # checkpointed on SIGTERM, then left
    assert status["disruptions"] >= 1 and status.get("restarts", 0) == 0, status  # not against backoffLimit
    assert RESUMED in run.logs(LEARNER)  # from the checkpoint the evicted learner wrote, every group once


@pytest.mark.s3
def test_a_two_pod_learner_meets_by_dns_and_a_deleted_pod_restarts_the_whole_gang_from_the_store(
        operator_release: OperatorRelease, tiny_data: Path, tmp_path: Path, s3_server: S3Server, s3_bucket: str):
    """Both ranks' pods created again, as on another node: their checkpoint folders (emptyDir) start empty, and
    each resumes from the newest checkpoint in the object store (spec.checkpoint.uri), which holds each pod's own
    files (rank 1's RNG state from rank 1's pod). Once the run Succeeded, `grporun export --cluster` exports that
    store's newest checkpoint again from a pod of its own and records it on status.output."""
    node = operator_release.node
    run = _run(operator_release, "faults-gang", tmp_path)
    manifest = _resumable_manifest(tiny_data, tmp_path)
    checkpoint = manifest["spec"]["checkpoint"]
    del checkpoint["volume"]
    store = store_access(node, run.namespace, s3_server)
    checkpoint.update(uri=f"s3://{s3_bucket}/checkpoints", **store)
    manifest["spec"]["output"] = {"uri": f"s3://{s3_bucket}/gang-model", **store}
    manifest["spec"]["learner"]["nodes"] = 2
    manifest["spec"]["training"]["epochs"] = 6  # two ranks on two cores: half the steps of the other runs
    rank1 = f"{RUN}-learner-1"
    try:
        run.apply(manifest)
        run.wait_for_log(LEARNER, "weight sync v2:")
        first = {name: run.history.uids(name) for name in (LEARNER, rank1)}
        node.kubectl("delete", "pod", rank1, "-n", run.namespace, "--wait=false")
        run.wait_for(lambda: all(len(run.history.uids(name)) >= 2 for name in first), "both ranks recreated",
                     timeout=300)
        status = run.wait_succeeded()
        learner = run.pod(LEARNER) or {}
        began = time.monotonic()
        exported = subprocess.run(
            [sys.executable, "-m", "grpo_operator.cli", "export", "--cluster", "-n", run.namespace, RUN,
             "--trainer-image", operator_release.trainer.reference, "--timeout", str(EXPORT_TIMEOUT_S)],
            env={**os.environ, "KUBECONFIG": str(node.kubeconfig)}, capture_output=True, text=True,
            timeout=EXPORT_TIMEOUT_S + 60)
        node.report(f"grporun export --cluster: {time.monotonic() - began:.0f} s, exit {exported.returncode}")
        assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
        reexported = run.status()["output"]
    finally:
        run.close()
    newest = f"checkpoints/checkpoint-{status['checkpoint']['step']}/{PROGRESS_STATE_FILE}"
    stored = s3_server.client().get_object(Bucket=s3_bucket, Key=newest)["Body"].read()
    assert "rng_state_1.pth" in json.loads(stored)["files"]  # uploaded by rank 1's pod, vouched for by rank 0's marker
    # The export pod took the store's newest checkpoint (its own folder was empty) and the status names the new
    # export: the same step as the learner's own at the end, exported later.
    output = status["output"]
    assert reexported["uri"] == output["uri"] == f"s3://{s3_bucket}/gang-model", reexported
    assert reexported["step"] == output["step"] == status["checkpoint"]["step"], (reexported, status["checkpoint"])
    assert reexported["time"] > output["time"], (reexported, output)
    assert f"recorded on GRPORun {run.namespace}/{RUN} status.output" in exported.stdout, exported.stdout
    leader = f"{LEARNER}.{RUN}-learner.{run.namespace}.svc"
    assert any(leader in arg for arg in learner["spec"]["containers"][0]["command"]), learner["spec"]
    assert EXIT_PREEMPTED in _exit_codes(run, rank1), _exits_seen(run)
    assert status["disruptions"] >= 1 and status.get("restarts", 0) == 0, status
    for rank in (LEARNER, rank1):
        assert "downloaded the checkpoint" in run.logs(rank), rank  # its own folder was empty
    assert RESUMED in run.logs(LEARNER)
    assert status["checkpoint"]["uri"].startswith(f"s3://{s3_bucket}/checkpoints/"), status.get("checkpoint")


def test_a_learner_over_its_memory_limit_is_oomkilled_retried_within_backoff_limit_and_the_reason_shown(
        operator_release: OperatorRelease, tiny_data: Path, tmp_path: Path):
    run = _run(operator_release, "faults-oom", tmp_path)
    manifest = _resumable_manifest(tiny_data, tmp_path)
    limits = {"memory": "200Mi"}  # torch and TRL alone take more to import
    manifest["spec"]["learner"]["resources"] = {"requests": limits, "limits": limits}
    manifest["spec"]["runPolicy"] = {"backoffLimit": 1}
    try:
        run.apply(manifest)
        run.wait_for(lambda: run.phase() == "Failed", "the run Failed once the retry was OOMKilled too", timeout=600)
        status = run.status()
    finally:
        run.close()
    assert [state["reason"] for state in run.history.exits_of(LEARNER)] == ["OOMKilled", "OOMKilled"], (
        _exits_seen(run))
    assert status.get("restarts") == 1 and status["failure"]["reason"] == "OOMKilled", status
    [failed] = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "BackoffLimitExceeded" and "memory limit 200Mi" in failed["message"], failed
