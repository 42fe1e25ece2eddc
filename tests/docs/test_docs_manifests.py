"""Every GRPORun the docs show (a YAML block of kind GRPORun in docs/ or the README) is one the real kube-apiserver
admits as kubectl sends it, and `grporun render` renders it into objects the server admits too (a dry run)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_operator.cli.render import render
from tests.controlplane.test_api import STRICT, _create
from tests.support.paths import REPO

pytestmark = pytest.mark.controlplane

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: Where the rendered objects of the core API group are sent (a PodGroup or Workload needs its CRD installed).
CORE_PATHS = {"ConfigMap": "configmaps", "Service": "services", "Pod": "pods"}


def grporuns_shown(pages: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(page:line, manifest) for each GRPORun in a YAML block of the pages."""
    shown = []
    for page in pages:
        text = page.read_text()
        for block in YAML_BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            for document in yaml.safe_load_all(block.group(1)):
                if isinstance(document, dict) and document.get("kind") == "GRPORun":
                    shown.append((f"{page.relative_to(REPO)}:{line}", document))
    return shown


SHOWN = grporuns_shown(PAGES)


def test_the_docs_show_grporuns():
    assert {where.split(":")[0] for where, _ in SHOWN} >= {"README.md", "docs/cluster.md"}


@pytest.mark.parametrize("manifest", [manifest for _, manifest in SHOWN], ids=[where for where, _ in SHOWN])
def test_a_grporun_the_docs_show_is_admitted_and_renders_into_objects_the_server_admits(admin, namespace, manifest,
                                                                                         tmp_path):
    stored = _create(admin, namespace, manifest)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    objects = list(yaml.safe_load_all(render(str(path), namespace=namespace, trainer_image="grpo-trainer:test",
                                             uid=stored["metadata"]["uid"])))
    assert {"ConfigMap", "Service", "Pod"} <= {obj["kind"] for obj in objects}
    for obj in objects:
        if obj["kind"] in CORE_PATHS:
            admin.call("POST", f"/api/v1/namespaces/{namespace}/{CORE_PATHS[obj['kind']]}", json=obj,
                       params={**STRICT, "dryRun": "All"})
