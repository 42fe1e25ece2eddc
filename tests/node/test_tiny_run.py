"""The shipped agentic run on the real node, from the user's side: `kubectl apply` of examples/tiny-agentic.yaml into a
namespace that enforces the `restricted` Pod Security Standard, the operator the chart installed
(tests/support/node/operator_release.py), rollout, learner and environment pods run as containers from the trainer
image, and `kubectl wait --for=condition=Succeeded`. The guess game is the run's own environment, twice
(spec.environments: pods the operator runs behind a Service): over HTTP from three servers, which the learner's
environment factory plays with each episode held on one server, and over OpenEnv from another, which the learner
plays itself; the prompts alternate between them. The test deletes the first HTTP server's pod once its first
episode is under way: the episodes that meet that server gone are counted as the environment's failures, the other
servers go on serving, and the operator creates the pod again while the run goes on to its bound. The restricted
policy refuses hostPath volumes, so the model, the weight-sync folder and the folder the trained model goes to
(spec.output.volume) come from PersistentVolumeClaims, as a cluster's admin would provide them. The model itself comes
from a real S3 server on this machine (spec.model `s3://`, downloaded by both roles), and the trained model goes back to
it too (spec.output.uri); the same run reports to a real MLflow tracking server (spec.tracking.mlflow). The pods reach
both through the node's address."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from grpo_operator.builders import environment_pod_name
from grpo_trainer.contract.codes import EXPORT_MANIFEST_FILE
from grpo_trainer.testing.guess_env import FIRST_EPISODE_LINE
from tests.support.node.node import Node
from tests.support.node.node_runs import (
    GUESS_GAME,
    OPENENV_GAME,
    RUN,
    TWO_GAMES_PROMPTS,
    NodeRun,
    read_exported_model,
    shared_folder,
    store_access,
    tiny_manifest,
)
from tests.support.node.operator_release import OperatorRelease
from tests.support.servers.mlflow_server import MISSING, MLFLOW, check_tracked_run, running_mlflow_server
from tests.support.servers.s3_server import S3Server

pytestmark = [pytest.mark.node, pytest.mark.slow, pytest.mark.s3]


def claimed_folder(node: Node, namespace: str, name: str, folder: Path) -> dict:
    """`folder` as a PersistentVolume (hostPath, made by the cluster's admin) and a claim on it in `namespace`, bound
    by the controller-manager's binder: the pod sees only the claim, which the restricted policy admits. Returns
    the pod's volume source for the claim."""
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{name}"},
              "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                       "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "manual",
                       "claimRef": {"namespace": namespace, "name": name},
                       "hostPath": {"path": str(folder), "type": "Directory"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "manual",
                      "volumeName": f"{namespace}-{name}", "resources": {"requests": {"storage": "1Gi"}}}}
    node.apply(volume, claim)
    node.kubectl("wait", "-n", namespace, "--for=jsonpath={.status.phase}=Bound", f"pvc/{name}", "--timeout=60s")
    return {"persistentVolumeClaim": {"claimName": name}}


CLAIMS = ("tiny-data", "tiny-weights", "tiny-models")
EXPERIMENT = "node-tiny"
GAME_SERVERS = 3
GAME_PODS = [environment_pod_name(RUN, GUESS_GAME, index) for index in range(GAME_SERVERS)]
OPENENV_POD = environment_pod_name(RUN, OPENENV_GAME, 0)
READY = [{"name": GUESS_GAME, "wanted": GAME_SERVERS, "replicas": GAME_SERVERS, "ready": GAME_SERVERS, "restarts": 0},
         {"name": OPENENV_GAME, "wanted": 1, "replicas": 1, "ready": 1, "restarts": 0}]
EPOCHS = 3  # 24 groups


def game_environments(image: str) -> list[dict]:
    """The guess game as two spec.environments[] entries, both from the trainer image: over HTTP
    (grpo_trainer.testing.guess_env, GAME_SERVERS servers, played by the environment factory) and over OpenEnv
    (grpo_trainer.testing.guess_openenv, played by the learner with OpenEnv's client)."""
    def server(module: str) -> list[str]:
        return ["/opt/learner/bin/python", "-m", module, "--host", "0.0.0.0", "--port", "8000"]

    return [{"name": GUESS_GAME, "image": image, "port": 8000, "replicas": GAME_SERVERS,
             "command": server("grpo_trainer.testing.guess_env")},
            {"name": OPENENV_GAME, "protocol": "openenv", "image": image, "port": 8000,
             "command": server("grpo_trainer.testing.guess_openenv")}]


def delete_a_game_server_mid_run(run: NodeRun) -> str:
    """Once the first HTTP game server's pod has opened an episode (its log says so once), the pod deleted at once,
    as a lost node or an eviction would. The rollout worker plays the run's episodes 16 at a time, so episodes are in
    flight on it (their rewards asked of a server that no longer holds them): they fail and are counted
    (environment failures), while the other servers, to which no episode of the deleted one moves, go on. Then,
    the run going on, the operator's new pod Ready and counted in status.environments. The UID the deleted pod
    had."""
    run.wait_for(lambda: run.status().get("environments") == READY, "the games' pods Ready")
    deleted = GAME_PODS[0]
    uid = run.pod(deleted)["metadata"]["uid"]
    run.wait_for_log(deleted, FIRST_EPISODE_LINE)
    run.node.kubectl("delete", "pod", deleted, "-n", run.namespace, "--grace-period=0", "--force")
    progress = run.status().get("progress", {})
    run.node.report(f"game pod deleted at {progress.get('groupsConsumed', 0)} of {progress.get('groupsTotal')} "
                    f"groups ({time.monotonic() - run.began:.1f} s after apply)")

    def replaced() -> bool:
        pod = run.pod(deleted)
        return bool(pod and pod["metadata"]["uid"] != uid and run.status().get("environments") == READY)

    run.wait_for(replaced, "the game's new pod Ready in status.environments")
    assert run.phase() not in ("Succeeded", "Failed"), "the run ended before the game's pod came back"
    # Every server played: the other HTTP servers, and the OpenEnv one.
    for pod in (*GAME_PODS[1:], OPENENV_POD):
        run.wait_for_log(pod, FIRST_EPISODE_LINE)
    return uid


def store_for_pods(node: Node, namespace: str, s3_server: S3Server, bucket: str, model: Path) -> dict:
    """The tiny model uploaded under `s3://BUCKET/tiny-model` (a plain prefix: no manifest), and a Secret with the
    store's keys in `namespace`. Returns the store's fields of spec.inputs and spec.output."""
    client = s3_server.client()
    for path in sorted(model.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"tiny-model/{path.relative_to(model).as_posix()}")
    return store_access(node, namespace, s3_server)


@pytest.mark.timeout(1800)  # the run, then a pod that loads the exported model and starts a vLLM server of its own
def test_the_tiny_run_succeeds_in_a_restricted_namespace_from_and_to_an_object_store_and_a_volume(
        operator_release: OperatorRelease, tiny_tool_data: Path, tmp_path: Path, s3_server: S3Server, s3_bucket: str):
    assert MLFLOW.exists(), MISSING
    node = operator_release.node
    namespace = node.create_namespace("tiny-restricted", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    run = NodeRun(operator_release, namespace, tmp_path)
    weights = shared_folder(tmp_path / "weights", writable=True)
    models = shared_folder(tmp_path / "models", writable=True)
    try:
        with running_mlflow_server(shared_folder(tmp_path / "mlflow", writable=True)) as mlflow:
            data_claim = claimed_folder(node, namespace, "tiny-data", tiny_tool_data)
            data_claim["persistentVolumeClaim"]["readOnly"] = True
            manifest = tiny_manifest(data_claim, claimed_folder(node, namespace, "tiny-weights", weights),
                                     example="tiny-agentic.yaml", prompts=TWO_GAMES_PROMPTS)
            spec = manifest["spec"]
            spec["training"]["epochs"] = EPOCHS
            spec["training"]["environmentFactories"] = {GUESS_GAME: spec["training"].pop("environmentFactory")}
            spec["environments"] = game_environments(operator_release.trainer.reference)
            store = store_for_pods(node, namespace, s3_server, s3_bucket, tiny_tool_data / "model")
            spec["model"] = f"s3://{s3_bucket}/tiny-model"
            spec["inputs"] = dict(store)
            spec["output"] = {"volume": claimed_folder(node, namespace, "tiny-models", models),
                              "uri": f"s3://{s3_bucket}/{RUN}", **store}
            tracking_uri = f"http://{node.expose(mlflow.port)}"
            spec["tracking"] = {"mlflow": {"trackingUri": tracking_uri, "experiment": EXPERIMENT}}
            # The server started while the claims, the store and the manifest were made. It must answer before the
            # learner starts: a tracker that does not answer at the learner's start is a configuration error (exit 78).
            mlflow.wait_ready()
            run.apply(manifest)
            deleted_uid = delete_a_game_server_mid_run(run)
            status = run.wait_succeeded()
            # The game's pod came back under its name, created again by the operator, and served the rest of the run;
            # the episodes it held when it went are counted (environment failures, their groups regenerated).
            uids = run.history.uids(GAME_PODS[0])
            assert uids[0] == deleted_uid and len(uids) == 2, uids
            progress, episodes = status["progress"], status["progress"]["episodes"]
            dropped = sum(progress.get("dropped", {}).values())
            assert progress["groupsTrained"] + dropped == progress["groupsConsumed"], progress
            assert episodes["toolCalls"] > 0 and episodes["episodes"] >= 8 * progress["groupsTrained"], episodes
            # Counted under the environment whose server went (training.environmentFactories' key); the OpenEnv
            # game lost none.
            failures = episodes.get("environmentFailures", {})
            assert set(failures) == {GUESS_GAME} and failures[GUESS_GAME] > 0, episodes
            node.report(f"agentic run: {progress}")
            # The tracker was not dropped mid-run (its reason would be here: the learner's log is in tmp_path/logs).
            degraded = [c for c in status.get("conditions", []) if c["type"] == "TrackingDegraded"]
            assert all(c["status"] != "True" for c in degraded), degraded
            tracked = check_tracked_run(mlflow.uri, EXPERIMENT, RUN, model=f"s3://{s3_bucket}/tiny-model",
                                        epochs=EPOCHS, groups_trained=status["progress"]["groupsTrained"])
        read = read_exported_model(operator_release, namespace, "tiny-models", RUN)
    finally:
        run.close()
        for name in CLAIMS:
            node.kubectl("delete", "persistentvolume", f"{namespace}-{name}", "--wait=false", check=False)
    seen = run.history.containers()
    roles = {"rollout", "learner", GUESS_GAME, OPENENV_GAME}
    assert {name.rsplit("-", 2)[-2] for name in seen} == roles, seen  # every role admitted
    for name, status_ in sorted(seen.items()):
        node.report(f"pod {name} ran as {status_['containerID']}, image {status_['image']}, "
                    f"imageID {status_['imageID']}")
        assert status_["containerID"].startswith("containerd://"), status_
        assert status_["podImage"] == operator_release.trainer.reference, status_

    # The status names the tracked run where the pods reached the server.
    assert status["tracking"] == [{"tracker": "mlflow", "runId": tracked.run_id, "uri": (
        f"{tracking_uri}/#/experiments/{tracked.experiment_id}/runs/{tracked.run_id}")}], status.get("tracking")

    # The model outlived the run's pods on the claim, whole, and went to the store, manifest last; the status names
    # the store's copy by its manifest's digest, the same bytes as the claim's.
    output = status["output"]
    manifest_digest = hashlib.sha256((models / RUN / EXPORT_MANIFEST_FILE).read_bytes()).hexdigest()
    assert output["uri"] == f"s3://{s3_bucket}/{RUN}" and output["sha256"] == manifest_digest, output
    stored = s3_server.client().get_object(Bucket=s3_bucket, Key=f"{RUN}/{EXPORT_MANIFEST_FILE}")["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == manifest_digest
    # The images the pods ran, by the digests the kubelet reported, as the operator recorded them in the run config
    # (the run takes minutes: the kubelet refreshed the learner's copy long before the export).
    digests: dict[str, set[str]] = {}
    for name, status_ in seen.items():
        role = name.rsplit("-", 2)[-2]
        environment = role in (GUESS_GAME, OPENENV_GAME)
        digests.setdefault(f"environment/{role}" if environment else role, set()).add(status_["imageID"])
    assert {key: set(value) for key, value in json.loads(stored)["images"].items()} == digests, digests
    stored_files = {item["Key"] for item in s3_server.client().list_objects_v2(
        Bucket=s3_bucket, Prefix=f"{RUN}/")["Contents"]}
    assert {f"{RUN}/{name}" for name in read["files"]} <= stored_files, (read["files"], stored_files)
    assert output["step"] > 0 and output["bytes"] > 0, output
    node.report(f"exported model {output['uri']}: step {output['step']}, {output['bytes']} bytes, {read}")
    # The reader pod saw the same files (every one matching the manifest) and both engines loaded them.
    assert read["sha256"] == output["sha256"] and read["step"] == output["step"], read
    assert "model.safetensors" in read["files"] and "tokenizer_config.json" in read["files"], read
    assert read["vllm"]["logprob"] == pytest.approx(read["transformers"]["logprob"], abs=1e-4), read
    assert len(read["vllm"]["tokens"]) == len(read["transformers"]["tokens"]) > 0, read
