"""`grporun render`: the operator's own objects for a manifest, as YAML; user mistakes are one line, no traceback."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import yaml

from grpo_operator.cli.render import PLACEHOLDER_UID, render
from grpo_operator.exit_codes import ExitCode
from tests.support.paths import REPO


def test_render_prints_valid_objects_for_the_tiny_example():
    objects = list(yaml.safe_load_all(render(str(REPO / "examples" / "tiny.yaml"), namespace="ml",
                                             trainer_image="grpo-trainer:cpu", uid=PLACEHOLDER_UID)))
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "tiny-config"), ("Service", "tiny-rollout"), ("Service", "tiny-learner"),
        ("Pod", "tiny-rollout-0"), ("Pod", "tiny-learner-0")]
    for obj in objects:
        assert obj["metadata"]["namespace"] == "ml"
        kubernetes_validate.validate(obj, "1.33", strict=True)
    assert objects[-1]["spec"]["containers"][0]["image"] == "grpo-trainer:cpu"


def test_render_of_a_bad_manifest_prints_nothing_on_stdout_and_names_the_field_on_stderr(tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun",
                                        "metadata": {"name": "bad"},
                                        "spec": {"model": "m", "dataset": {"path": "p"}, "rewards": [],
                                                 "training": {"epochs": 0}}}))
    result = subprocess.run([sys.executable, "-m", "grpo_operator.cli", "render", str(manifest)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.INVALID
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout == ""  # `grporun render bad.yaml > objects.yaml` leaves the problems on the terminal
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith(f"{manifest}: spec.") for line in lines)
    assert any("spec.training.epochs" in line for line in lines)
