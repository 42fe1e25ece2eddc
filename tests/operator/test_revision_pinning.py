"""One revision for the whole run, on the API emulator with the real kopf operator and the stand-in hub: the operator
resolves the run's branch to a commit before the first pod (status.model.revision), and after the branch moves on
the hub, every pod, a rollout server a scale-up adds afterwards included, is still built at the pinned commit. A
hub that cannot be reached holds the run Pending with the reason, and no pod starts unpinned.
"""

from __future__ import annotations

import json

import pytest

from grpo_operator import builders
from grpo_trainer.contract.config import load_run_config
from grpo_trainer.server.main import build_server_command
from tests.operator.test_lifecycle import _running
from tests.support.servers.hub_server import QWEN3_06B, commit_of, silent_endpoint
from tests.support.specs import grporun, minimal_spec

pytestmark = pytest.mark.slow

FILESYSTEM = {"weightSync": {"mode": "filesystem", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}}}


def _run_config(cluster, run: str):
    [config_map] = cluster.config_maps(run)
    return load_run_config(config_map["data"][builders.CONFIG_FILE])


def _config_map_of(pod: dict) -> set[str]:
    return {volume["configMap"]["name"] for volume in pod["spec"].get("volumes", []) if "configMap" in volume}


def _revision_requests(hub) -> list[str]:
    return [path for _, path, _ in hub.requests if path.startswith("/api/")]


@pytest.fixture()
def hub_cluster(hub, monkeypatch, cluster):
    """The cluster's operator asking the stand-in hub (HF_ENDPOINT as the operator's Deployment would set it)."""
    cluster.stop_operator()
    cluster.start_operator()
    return cluster


def test_a_branch_moved_mid_run_leaves_every_pod_on_the_pinned_commit(hub, hub_cluster, learner, progress_urls):
    cluster = hub_cluster
    hub.add("pin/moving", QWEN3_06B)
    pinned = commit_of("pin/moving", "main")
    _running(cluster, learner, progress_urls, "pin", minimal_spec(model="pin/moving",
                                                                  rollout={"replicas": 1, **FILESYSTEM}))
    assert cluster.status("pin")["model"] == {"name": "pin/moving", "requested": "main", "revision": pinned}
    assert _run_config(cluster, "pin").model_revision == pinned
    assert _revision_requests(hub) == ["/api/models/pin/moving/revision/main"]  # (the fit check reads config.json)

    moved = hub.move("pin/moving")
    assert moved != pinned
    cluster.patch_spec("pin", {"rollout": {"replicas": 2}})
    cluster.wait_for(lambda: len(cluster.pods("pin", "rollout")) == 2, what="the rollout server the scale-up adds")
    cluster.kubelet.run("pin-rollout-1")
    cluster.wait_for(lambda: cluster.status("pin")["rollout"]["replicas"] == 2, what="two rollout pods in status")

    config = _run_config(cluster, "pin")
    assert config.model_revision == pinned and len(config.rollout.urls) == 2
    argv, _ = build_server_command(config)
    assert argv[argv.index("--revision") + 1] == pinned  # what each rollout server runs
    for pod in cluster.pods("pin"):  # every pod, the new server too, reads that one run config
        assert _config_map_of(pod) == {builders.config_map_name("pin")}, pod["metadata"]["name"]
    assert cluster.status("pin")["model"]["revision"] == pinned
    assert len(_revision_requests(hub)) == 1  # asked once, before the first pod


def test_a_hub_that_cannot_be_reached_holds_the_run_pending_until_it_answers(hub, monkeypatch, cluster):
    hub.add("pin/held", QWEN3_06B)
    with silent_endpoint() as silent:
        monkeypatch.setenv("HF_ENDPOINT", silent)
        cluster.stop_operator()
        cluster.start_operator()
        cluster.apply(grporun("held", minimal_spec(model="pin/held")))
        progressing = cluster.wait_for(lambda: (c := cluster.condition("held", "Progressing")) and c["reason"] ==
                                       "ResolvingRevision" and c, what="the run waiting for the hub")
        assert "spec.modelRevision main of model pin/held: the hub cannot be reached" in progressing["message"]
        assert cluster.status("held")["phase"] == "Pending" and cluster.pods("held") == []
        assert "ResolvingRevision" in cluster.event_reasons("held")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the hub answers again (the operator asks again)
    cluster.stop_operator()
    cluster.start_operator()
    cluster.wait_for(lambda: cluster.pods("held"), what="the pods, once the commit is pinned")
    assert cluster.status("held")["model"]["revision"] == commit_of("pin/held", "main")
    assert json.loads(cluster.config_maps("held")[0]["data"][builders.CONFIG_FILE])["modelRevision"] == commit_of(
        "pin/held", "main")


def test_an_s3_model_is_pinned_to_the_digest_the_learner_loaded_and_later_pods_are_held_to_it(
        cluster, learner, progress_urls):
    digest = "manifest:" + "ab" * 32
    _running(cluster, learner, progress_urls, "digest", minimal_spec(model="s3://models/tiny",
                                                                     rollout={"replicas": 1, **FILESYSTEM}))
    first_pods = {pod["metadata"]["name"] for pod in cluster.pods("digest")}
    learner.update(model_digest=digest)
    cluster.wait_for(lambda: (cluster.status("digest").get("model") or {}).get("revision") == digest,
                     what="the model's digest on status.model")
    assert cluster.status("digest")["model"] == {"name": "s3://models/tiny", "requested": "digest",
                                                 "revision": digest}
    learner.update(model_digest="manifest:" + "cd" * 32)  # a report of other content does not move the pin
    cluster.patch_spec("digest", {"rollout": {"replicas": 2}})
    cluster.wait_for(lambda: len(cluster.pods("digest", "rollout")) == 2, what="the rollout server the scale-up adds")
    assert cluster.status("digest")["model"]["revision"] == digest
    for pod in cluster.pods("digest"):
        env = {variable["name"]: variable.get("value") for variable in pod["spec"]["containers"][0]["env"]}
        if pod["metadata"]["name"] in first_pods:  # loaded before the digest was known
            assert "GRPO_MODEL_DIGEST" not in env, pod["metadata"]["name"]
        else:
            assert env["GRPO_MODEL_DIGEST"] == digest, pod["metadata"]["name"]
    assert "GRPO_MODEL_DIGEST" not in json.dumps(cluster.config_maps("digest"))  # the run config is as it was
