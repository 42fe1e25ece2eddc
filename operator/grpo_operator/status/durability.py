"""What a run keeps of its work when a pod goes: checkpoints on a volume that outlives the learner pod or in an
object store, and the trained model somewhere users find it. The same lines are `grporun validate`'s warnings and
the Warning events a run starts with (derive.py), so a run that would lose its work says so where the user looks."""

from __future__ import annotations

from typing import Any

from ..api import GRPORunSpec


def persistent(volume: dict[str, Any] | None) -> bool:
    """A volume source that outlives the pod (an emptyDir is the pod's own)."""
    return volume is not None and "emptyDir" not in volume


def unkept_work(spec: GRPORunSpec) -> list[str]:
    """One line per way the run loses work with its learner pod, naming the field; [] when it keeps it."""
    warnings = []
    # With checkpoint.uri a learner whose volume went with its pod resumes from the object store.
    kept_in_store = spec.checkpoint.uri is not None
    if not kept_in_store and spec.checkpoint.volume is None:
        warnings.append("spec.checkpoint.volume: not set: checkpoints live as long as the learner pod, so a "
                        "restarted learner starts over")
    elif not kept_in_store and not persistent(spec.checkpoint.volume):
        warnings.append("spec.checkpoint.volume: an emptyDir lives as long as the learner pod, so a restarted "
                        "learner starts over")
    if spec.output is None and not kept_in_store and not persistent(spec.checkpoint.volume):
        warnings.append("spec.output: not set, and no checkpoint is on a persistent volume: the trained model is lost "
                        "with the learner pod (set spec.output.volume or spec.output.uri to keep it)")
    elif spec.output is not None and spec.output.uri is None and not persistent(spec.output.volume):
        warnings.append("spec.output.volume: an emptyDir is deleted with the learner pod, and the exported model "
                        "with it")
    return warnings
