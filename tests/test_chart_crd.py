"""The chart ships the GRPORun CRD byte-identical to crds/grporun.yaml, the single source of the schema."""

from __future__ import annotations

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from chart_render import CHART_DIR, REPO

TOP_LEVEL_CRD = REPO / "crds" / "grporun.yaml"
CHART_CRD = CHART_DIR / "crds" / "grporun.yaml"


def test_chart_crd_is_a_copy_of_the_top_level_crd():
    if not TOP_LEVEL_CRD.exists():
        pytest.skip("crds/grporun.yaml is not written yet: nothing to compare the chart's copy with")
    assert CHART_CRD.read_bytes() == TOP_LEVEL_CRD.read_bytes(), (
        "charts/grpo-operator/crds/grporun.yaml differs from crds/grporun.yaml: "
        "cp crds/grporun.yaml charts/grpo-operator/crds/grporun.yaml"
    )


def test_helm_installs_the_crd_from_the_chart():
    with helm.Chart.load(CHART_DIR) as chart:
        crds = chart.crds
    assert [c["filename"] for c in crds] == ["grpo-operator/crds/grporun.yaml"]
    crd = yaml.safe_load(crds[0]["data"])
    kubernetes_validate.validate(crd, "1.30.0", strict=True)
    assert crd["metadata"]["name"] == "grporuns.grpo.dev"
    assert crd["spec"]["names"]["plural"] == "grporuns"
    # The RBAC rules grant exactly this group and plural, and the status subresource the operator patches.
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    assert crd["spec"]["group"] == "grpo.dev" and "status" in version["subresources"]
