"""The export pod of a cluster run, as pure rules: whether a run may be exported again, the pod that does it (the
learner's own pod, running `python -m grpo_trainer export`), and what its end means.

The pod is learner rank 0's pod as the operator builds it (builders.build_learner_pod: the same image, the run
config ConfigMap, the checkpoint volume or spec.checkpoint.uri's credentials, spec.output's volume or store, the
podTemplateOverride), with the export entry as its command and nothing of a learner's gang (no ports, no hostname
on the learner Service). Its ownerReference is not a controller's: deleting the run deletes it, and the operator
never counts it among the run's learner or rollout pods.

The entry's termination message is its ExportReport as JSON (the learner's final report carries the same in
`output`), or its error line: `grporun export --cluster` records the report on status.output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from grpo_trainer.contract.codes import EXIT_EXPORT_FAILED, EXIT_INVALID_CONFIG
from grpo_trainer.contract.report import ExportReport

from .api import ATTEMPT_ANNOTATION, GRPORunSpec
from .builders import CONFIG_DIR, CONFIG_FILE, build_learner_pod, run_labels
from .run_ref import RunRef
from .run_status import FINISHED_PHASES, GRPORunStatus, Phase
from .status.decision import PodObservation
from .status.revision import pinned_digest, with_model_digest

#: The export pod's role label and container name.
EXPORT_ROLE = "export"


def export_pod_name(run: str) -> str:
    return f"{run}-export"


def export_refusal(spec: GRPORunSpec, status: GRPORunStatus) -> str | None:
    """Why the run cannot be exported now, or None: it has no spec.output, or its learner may still be writing
    checkpoints (the export reads the newest complete one, and a ReadWriteOnce checkpoint volume may still be held)."""
    if spec.output is None:
        return "spec.output is not set: there is nowhere to export the model to"
    phase = status.phase
    if phase not in FINISHED_PHASES and phase != Phase.SUSPENDED:
        return (f"the run is {phase.value if phase else 'not started yet'}: export it once it has ended (Succeeded "
                "or Failed) or while it is suspended, when no learner writes checkpoints")
    return None


def export_command(checkpoint: str | None = None) -> list[str]:
    command = ["python", "-m", "grpo_trainer", "export", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"]
    return [*command, "--checkpoint", checkpoint] if checkpoint else command


def build_export_pod(run: RunRef, spec: GRPORunSpec, status: GRPORunStatus, *, trainer_image: str,
                     checkpoint: str | None = None) -> dict[str, Any]:
    """The export pod of `run`: learner rank 0's pod running the export entry (`checkpoint`: a checkpoint folder as
    the pod sees it; default the newest complete one), held like the run's later pods to the model's pinned digest
    (a LoRA export loads the base model)."""
    (pod,) = with_model_digest([build_learner_pod(run, spec, 0, trainer_image=trainer_image)],
                               pinned_digest(spec, status))
    metadata = pod["metadata"]
    metadata["name"] = export_pod_name(run.name)
    metadata["labels"] = {**metadata["labels"], **run_labels(run.name, EXPORT_ROLE)}
    # Not blocking the owner's deletion: that would need update on grporuns/finalizers from whoever exports.
    metadata["ownerReferences"] = [{**run.owner_reference(), "controller": False, "blockOwnerDeletion": False}]
    annotations = {key: value for key, value in (metadata.get("annotations") or {}).items()
                   if key != ATTEMPT_ANNOTATION}
    if annotations:
        metadata["annotations"] = annotations
    else:
        metadata.pop("annotations", None)
    pod_spec = pod["spec"]
    pod_spec.pop("hostname", None)
    pod_spec.pop("subdomain", None)
    container = next(c for c in pod_spec["containers"] if c["name"] == "learner")
    container["name"] = EXPORT_ROLE
    container["command"] = export_command(checkpoint)
    container.pop("ports", None)
    container["env"] = [{**variable, "value": EXPORT_ROLE} if variable["name"] == "GRPO_ROLE" else variable
                        for variable in container["env"]]
    return pod


@dataclass(frozen=True)
class Exported:
    report: ExportReport


@dataclass(frozen=True)
class ExportFailed:
    message: str


def export_outcome(pod: PodObservation) -> Exported | ExportFailed | None:
    """What the export pod's end means; None while it has not ended."""
    if pod.phase == "Succeeded":
        try:
            return Exported(ExportReport.model_validate_json(pod.message or ""))
        except (ValidationError, ValueError):
            return ExportFailed(f"pod {pod.name} exited 0 without an export report as its termination message "
                                f"(an image older than the export pod?): {(pod.message or '').strip()[-300:]!r}")
    if pod.phase != "Failed":
        return None
    why = {EXIT_EXPORT_FAILED: "the export failed", EXIT_INVALID_CONFIG: "the run config was refused"}.get(
        pod.exit_code if pod.exit_code is not None else -1,
        f"exit code {pod.exit_code}" if pod.exit_code is not None else (pod.reason or "no exit code"))
    detail = (pod.message or "").strip()
    return ExportFailed(f"pod {pod.name}: {why}" + (f": {detail}" if detail else ""))


def export_progress(pod: PodObservation) -> str:
    """One line on where the export pod is, for the command's progress."""
    if pod.phase == "Pending":
        return f"pod {pod.name}: Pending ({pod.waiting_reason or pod.reason or 'waiting to be scheduled'})" + (
            f": {pod.message}" if pod.message and not pod.waiting_reason else "")
    return f"pod {pod.name}: {pod.phase}"
