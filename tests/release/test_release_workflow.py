"""The release (.github/workflows/release.yml), which cannot run here: actionlint over the workflow, and the
commands of its steps run as the runner runs them, against what this machine has in place of the registry (an OCI
layout folder for the images; the chart's package read back with helm). What a user pulls is what these check: the
images under the names the chart's defaults give, the chart's version and appVersion the tag's."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.paths import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
BUILD_SCRIPT = REPO / "hack" / "images" / "build.sh"
VERSION, OWNER = "0.2.0-rc.1", "Acme-ML"
REGISTRY = "ghcr.io/acme-ml"


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def step(job: str, name: str) -> dict:
    return next(step for step in workflow()["jobs"][job]["steps"] if step.get("name") == name)


def run_step(job: str, name: str, env: dict[str, str], tmp_path: Path,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The step's `run` script as the runner runs it (bash -e -o pipefail, in the checkout: here a folder whose
    `hack` is the repository's, so what the step writes stays in `tmp_path`), with `env` in place of the `${{ }}`
    values the runner would fill in, and `sudo` a no-op (the tests run as root)."""
    checkout, shims = tmp_path / "checkout", tmp_path / "shims"
    for folder in (checkout, shims):
        folder.mkdir(exist_ok=True)
    if not (checkout / "hack").exists():
        (checkout / "hack").symlink_to(REPO / "hack")
    (shims / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (shims / "sudo").chmod(0o755)
    full_env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step(job, name)["run"]],
                          cwd=checkout, env=full_env, capture_output=True, text=True, timeout=timeout)


def outputs(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_actionlint_finds_nothing_in_the_workflows_and_finds_a_planted_mistake(actionlint_binary, tmp_path):
    # shellcheck and pyflakes are left out (not on these machines), so the outcome does not depend on what is.
    lint = [str(actionlint_binary), "-shellcheck=", "-pyflakes=", "-no-color"]
    done = subprocess.run([*lint, *sorted(map(str, WORKFLOW.parent.glob("*.y*ml")))], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "release.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs.names.outputs.version", "needs.names.outputs.versoin"))
    done = subprocess.run([*lint, str(broken)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and 'property "versoin" is not defined' in done.stdout, done.stdout


def test_the_tag_gives_the_version_and_the_owner_the_registry(tmp_path):
    github_output = tmp_path / "output"
    env = {"GITHUB_REF_NAME": f"v{VERSION}", "GITHUB_REPOSITORY_OWNER": OWNER, "GITHUB_OUTPUT": str(github_output)}
    done = run_step("names", "Version and registry", env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert outputs(github_output) == {"version": VERSION, "registry": REGISTRY}
    # A tag that is no version ends the release before anything is built, saying why.
    github_output.unlink()
    done = run_step("names", "Version and registry", {**env, "GITHUB_REF_NAME": "v2"}, tmp_path)
    assert done.returncode == 2 and "'2' is not a release version" in done.stderr
    assert not github_output.exists()


def test_the_workflow_builds_every_image_the_build_script_knows_and_the_helm_it_is_tested_with():
    images = workflow()["jobs"]["images"]["strategy"]["matrix"]["image"]
    usage = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True).stderr
    assert images == re.search(r"IMAGE: ([\w| -]+)\)", usage)[1].split(" | ")
    helm = next(step for step in workflow()["jobs"]["chart"]["steps"]
                if step.get("uses", "").startswith("azure/setup-helm"))
    go_mod = (REPO / "hack" / "k8s" / "go.mod").read_text()
    assert re.search(r"^\s*helm\.sh/helm/v4 (\S+)$", go_mod, re.M)[1] == helm["with"]["version"]
    assert step("images", "Build and push")["env"]["DESTINATION"] == "docker://${{ needs.names.outputs.registry }}"


def _oci_image(layout: Path, tag: str) -> dict:
    """The config of the image tagged `tag` in the OCI layout `layout` (index.json -> manifest -> config)."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag]

    def blob(digest: str) -> dict:
        return json.loads((layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_text())

    return blob(blob(entry["digest"])["config"]["digest"])


def test_the_images_step_pushes_the_built_image_under_its_release_name(operator_image, tmp_path):
    """The step's own command, with an OCI layout folder as the destination in place of ghcr.io: the operator image
    of this run's build, under the name and tag the chart's defaults give it."""
    destination = tmp_path / "registry"
    destination.mkdir()
    done = run_step("images", "Build and push", {"DESTINATION": f"oci:{destination}", "VERSION": VERSION,
                                                 "IMAGE": "operator"}, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [operator_image.reference, f"oci:{destination}/grpo-operator:{VERSION}"]
    config = _oci_image(destination / "grpo-operator", VERSION)
    assert config["config"]["Entrypoint"] == ["grporun"] and config["config"]["User"] == "10001:10001"


def test_the_chart_step_packages_the_chart_naming_the_pushed_images(helm_binary, tmp_path):
    """hack/release/chart.sh as the step runs it: the package's version and appVersion are the tag's, and its
    defaults render the operator and trainer images the images step pushed (build.sh's dry run names them)."""
    github_output = tmp_path / "output"
    done = run_step("chart", "Package the chart", {"VERSION": VERSION, "REGISTRY": REGISTRY,
                                                   "GITHUB_OUTPUT": str(github_output), "HELM": str(helm_binary)},
                    tmp_path)
    assert done.returncode == 0, done.stderr
    package = Path(outputs(github_output)["package"])
    assert package == tmp_path / "checkout" / "dist" / f"grpo-operator-{VERSION}.tgz" and package.is_file()
    chart = yaml.safe_load(subprocess.run([str(helm_binary), "show", "chart", str(package)], capture_output=True,
                                          text=True, check=True).stdout)
    rendered = subprocess.run([str(helm_binary), "template", "grpo", str(package), "-n", "grpo-system"],
                              capture_output=True, text=True, check=True).stdout
    assert chart["version"] == chart["appVersion"] == VERSION
    crds = subprocess.run([str(helm_binary), "show", "crds", str(package)], capture_output=True, text=True, check=True)
    assert yaml.safe_load(crds.stdout) == yaml.safe_load((REPO / "crds" / "grporun.yaml").read_text())
    deployment = next(doc for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    trainer = next(arg.split("=", 1)[1] for arg in container["args"] if arg.startswith("--trainer-image="))

    pushes = subprocess.run([str(BUILD_SCRIPT), "--push", f"docker://{REGISTRY}", VERSION, "--dry-run", "operator",
                             "trainer-cuda"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [container["image"], trainer] == [line.split()[-1].removeprefix("docker://") for line in pushes]


@pytest.mark.parametrize(("args", "message"), [
    (("v0.2.0", REGISTRY), "'v0.2.0' is not a release version"),
    (("0.2.0", f"docker://{REGISTRY}"), "without a transport"),
])
def test_the_chart_script_refuses_a_bad_version_or_registry(tmp_path, args, message):
    done = subprocess.run([str(REPO / "hack" / "release" / "chart.sh"), *args, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "HELM": "false"})
    assert done.returncode == 2 and message in done.stderr, done.stderr
