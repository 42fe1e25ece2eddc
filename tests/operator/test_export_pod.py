"""The export pod of a cluster run (grpo_operator.export_pod): learner rank 0's pod running the export entry, when a
run may be exported, and what the pod's end means."""

from __future__ import annotations

import kubernetes_validate
import pytest

from grpo_operator import builders
from grpo_operator.api import ATTEMPT_ANNOTATION, ROLE_LABEL, RUN_LABEL, parse_spec
from grpo_operator.cluster.pods import observe_pod, pod_facts
from grpo_operator.export_pod import (
    Exported,
    ExportFailed,
    build_export_pod,
    export_outcome,
    export_refusal,
)
from grpo_operator.run_ref import RunRef
from grpo_operator.run_status import GRPORunStatus, PinnedRevision, parse_status
from grpo_trainer.contract.report import ExportReport
from tests.operator.test_builders import KUBERNETES_VERSION
from tests.support.specs import minimal_spec

RUN = RunRef("run", "ml", "uid-1")
STORE = {"uri": "s3://models/run", "credentialsSecret": "store-keys", "endpoint": "http://s3.example:8333"}


def spec(**overrides):
    return parse_spec(minimal_spec(**overrides))


def test_the_export_pod_is_learner_rank_0s_pod_running_the_export_entry():
    run_spec = spec(output={"volume": {"persistentVolumeClaim": {"claimName": "models"}}},
                    checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "checkpoints"}}},
                    learner={"nodes": 2, "image": "registry.example/trainer:2", "resources": {"limits": {"cpu": "2"}}})
    learner = builders.build_learner_pod(RUN, run_spec, 0, trainer_image="img")
    pod = build_export_pod(RUN, run_spec, GRPORunStatus(), trainer_image="img",
                           checkpoint="/var/lib/grpo/checkpoints/checkpoint-8")
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    assert pod["metadata"]["name"] == "run-export"
    assert pod["metadata"]["labels"][RUN_LABEL] == "run" and pod["metadata"]["labels"][ROLE_LABEL] == "export"
    assert ATTEMPT_ANNOTATION not in pod["metadata"].get("annotations", {})
    # Deleted with the run, but never one of the run's controlled pods (the operator's failure policy ignores it).
    assert pod["metadata"]["ownerReferences"] == [{**RUN.owner_reference(), "controller": False,
                                                   "blockOwnerDeletion": False}]
    assert pod_facts(pod).owner_uid is None
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "export" and "ports" not in container
    assert container["command"] == ["python", "-m", "grpo_trainer", "export", "--config", "/etc/grpo/run.json",
                                    "--checkpoint", "/var/lib/grpo/checkpoints/checkpoint-8"]
    (learner_container,) = learner["spec"]["containers"]
    assert container["image"] == learner_container["image"] == "registry.example/trainer:2"
    assert container["resources"] == learner_container["resources"]
    assert container["volumeMounts"] == learner_container["volumeMounts"]
    assert pod["spec"]["volumes"] == learner["spec"]["volumes"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"models", "checkpoints"}
    assert {"name": "GRPO_ROLE", "value": "export"} in container["env"]
    assert "hostname" not in pod["spec"] and "subdomain" not in pod["spec"]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_the_export_pod_reaches_the_checkpoint_store_and_the_output_store():
    run_spec = spec(output=STORE, checkpoint={"uri": "s3://models/checkpoints", "credentialsSecret": "store-keys",
                                              "endpoint": "http://s3.example:8333"})
    pod = build_export_pod(RUN, run_spec, GRPORunStatus(), trainer_image="img")
    (container,) = pod["spec"]["containers"]
    assert container["command"][-2:] == ["--config", "/etc/grpo/run.json"]
    secrets = {v["valueFrom"]["secretKeyRef"]["name"] for v in container["env"] if "valueFrom" in v
               and "secretKeyRef" in v["valueFrom"]}
    assert secrets == {"store-keys"}
    assert {"name": "AWS_ENDPOINT_URL_S3", "value": "http://s3.example:8333"} in container["env"]
    assert {"name": "config", "configMap": {"name": "run-config"}} in pod["spec"]["volumes"]


def test_a_run_is_exported_once_no_learner_writes_checkpoints_and_only_with_an_output():
    with_output = spec(output=STORE)
    assert export_refusal(spec(), parse_status({"phase": "Failed"})).startswith("spec.output is not set")
    for phase in ("Succeeded", "Failed", "Suspended"):
        assert export_refusal(with_output, parse_status({"phase": phase})) is None
    for phase in ("Pending", "Starting", "Running"):
        assert export_refusal(with_output, parse_status({"phase": phase})).startswith(f"the run is {phase}: ")
    assert export_refusal(with_output, parse_status({})).startswith("the run is not started yet")


def _ended(phase: str, exit_code: int, message: str) -> dict:
    pod = build_export_pod(RUN, spec(output=STORE), GRPORunStatus(), trainer_image="img")
    pod["status"] = {"phase": phase, "containerStatuses": [
        {"name": "export", "state": {"terminated": {"exitCode": exit_code, "message": message}}}]}
    return pod


REPORT = ExportReport(uri="s3://models/run", path="/var/lib/grpo/output/run", step=8, bytes=1234, sha256="a" * 64,
                      time=1.7e9)


def test_the_export_pods_end_is_its_report_or_its_error():
    assert export_outcome(observe_pod(_ended("Succeeded", 0, REPORT.model_dump_json()))) == Exported(REPORT)
    failed = export_outcome(observe_pod(_ended(
        "Failed", 74, "grpo export: checkpoint.directory /var/lib/grpo/checkpoints: no complete checkpoint")))
    assert failed == ExportFailed("pod run-export: the export failed: grpo export: checkpoint.directory "
                                  "/var/lib/grpo/checkpoints: no complete checkpoint")
    refused = export_outcome(observe_pod(_ended("Failed", 78, "grpo export: invalid config")))
    assert isinstance(refused, ExportFailed) and "the run config was refused: grpo export: invalid" in refused.message
    silent = export_outcome(observe_pod(_ended("Succeeded", 0, "done")))
    assert isinstance(silent, ExportFailed) and "without an export report" in silent.message
    pending = build_export_pod(RUN, spec(output=STORE), GRPORunStatus(), trainer_image="img")
    assert export_outcome(observe_pod(pending)) is None


@pytest.mark.parametrize("phase", ["Pending", "Running"])
def test_a_pod_that_has_not_ended_has_no_outcome(phase):
    pod = build_export_pod(RUN, spec(output=STORE), GRPORunStatus(), trainer_image="img")
    pod["status"] = {"phase": phase}
    assert export_outcome(observe_pod(pod)) is None


def test_the_export_pod_is_held_to_the_models_pinned_digest_like_the_runs_later_pods():
    run_spec = spec(model="s3://models/base", output=STORE)
    digest = "manifest:" + "ab" * 32
    status = GRPORunStatus(model=PinnedRevision(name="s3://models/base", requested="digest", revision=digest))
    (container,) = build_export_pod(RUN, run_spec, status, trainer_image="img")["spec"]["containers"]
    assert {"name": "GRPO_MODEL_DIGEST", "value": digest} in container["env"]
    (unpinned,) = build_export_pod(RUN, run_spec, GRPORunStatus(), trainer_image="img")["spec"]["containers"]
    assert "GRPO_MODEL_DIGEST" not in {variable["name"] for variable in unpinned["env"]}
