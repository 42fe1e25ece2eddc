"""The chart ships the GRPORun CRD byte-identical to crds/grporun.yaml, the single source of the schema.

charts/grpo-operator/crds/grporun.yaml is a symlink to it, so the two cannot drift; Helm follows the link when it
loads and packages the chart (it logs "found symbolic link in path"), and these tests check what Helm really reads
and what a packaged chart really contains.
"""

from __future__ import annotations

import tarfile

import helm_python as helm
import kubernetes_validate
import yaml

from tests.support.chart_render import CHART_DIR, REPO

TOP_LEVEL_CRD = REPO / "crds" / "grporun.yaml"
CHART_CRD = CHART_DIR / "crds" / "grporun.yaml"


def test_chart_crd_is_the_top_level_crd():
    assert CHART_CRD.read_bytes() == TOP_LEVEL_CRD.read_bytes()
    with helm.Chart.load(CHART_DIR) as chart:
        crds = chart.crds
    assert [c["filename"] for c in crds] == ["grpo-operator/crds/grporun.yaml"]
    assert crds[0]["data"] == TOP_LEVEL_CRD.read_text()


def test_packaged_chart_carries_the_crd_file(tmp_path):
    archive = helm.package(str(CHART_DIR), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        member = tar.getmember("grpo-operator/crds/grporun.yaml")
        assert member.isfile()  # the content, not a link that would dangle outside the repository
        assert tar.extractfile(member).read() == TOP_LEVEL_CRD.read_bytes()


def test_crd_is_valid_and_matches_the_rbac_rules():
    crd = yaml.safe_load(TOP_LEVEL_CRD.read_text())
    kubernetes_validate.validate(crd, "1.30.0", strict=True)
    assert crd["metadata"]["name"] == "grporuns.grpo.dev"
    # The RBAC rules grant exactly this group and plural, and the status subresource the operator patches.
    assert crd["spec"]["group"] == "grpo.dev" and crd["spec"]["names"]["plural"] == "grporuns"
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    assert "status" in version["subresources"]
