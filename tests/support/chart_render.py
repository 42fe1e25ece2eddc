"""Render the Helm chart with the real Helm engine (helm-python-sdk bundles Helm v4's Go SDK as a C library).

Shared by the chart, RBAC, alert and e2e tests so they all look at the same rendered objects.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import yaml

from tests.support.paths import REPO

CHART_DIR = REPO / "charts" / "grpo-operator"
RELEASE = "grpo"
RELEASE_NAMESPACE = "grpo-system"

#: The default values and three non-default sets every chart test renders.
VALUE_SETS = {
    "defaults": {},
    "namespaced": {"watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}},
    "ha": {"replicas": 2},
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "podMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
        "dashboard": {"namespace": "monitoring", "labels": {"grafana_dashboard": "1", "team": "ml"}},
    },
    "custom": {
        "image": {"repository": "registry.example.com/ml/grpo-operator", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        "operator": {"logLevel": "DEBUG", "extraArgs": ["--reconcile-interval=10"]},
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "rbac": {"clusterDiscovery": False},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "dashboard": {"enabled": False},
    },
}


def render_manifests(values: dict[str, Any] | None = None, namespace: str = RELEASE_NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print them (NOTES.txt included)."""
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values or {}, name=RELEASE, namespace=namespace, is_install=True)


def render_objects(values: dict[str, Any] | None = None, namespace: str = RELEASE_NAMESPACE) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart would install, in template order; namespaced ones without a namespace get
    the release namespace, as `helm install` does."""
    objects = []
    for path, text in sorted(render_manifests(values, namespace).items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                objects.append(document)
    return objects


def objects_of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one_of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = objects_of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]
