"""The chart renders and lints with the real Helm engine, and every object it renders is a valid Kubernetes object.

Four value sets: the defaults, namespaced watching, every monitoring object on, and a custom image/resources one.
"""

from __future__ import annotations

import contextlib
import io

import helm_python as helm
import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator_v1

from grpo_operator import metric_names
from grpo_trainer.contract.codes import LEARNER_HTTP_PORT, METRICS_PATH, ROLLOUT_HTTP_PORT
from tests.support.chart_render import (
    CHART_DIR,
    RELEASE_NAMESPACE,
    VALUE_SETS,
    objects_of_kind,
    one_of_kind,
    render_manifests,
    render_objects,
)

KUBE_VERSION = "1.30.0"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}



@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def value_set(request):
    return request.param, VALUE_SETS[request.param]


def test_lint_passes_for_every_value_set(value_set):
    name, values = value_set
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=RELEASE_NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    assert report["total_charts_linted"] == 1
    assert not problems, f"helm lint ({name}): {problems}"


def _validate_monitoring(obj: dict) -> None:
    """Against pydantic models generated from the Prometheus Operator's CRDs. The models ignore unknown fields, so
    the object must also survive a round trip unchanged: a misspelt field would be dropped and show up here."""
    model = getattr(prometheus_operator_v1, obj["kind"]).model_validate(obj)
    round_trip = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert round_trip == obj, f"{obj['kind']}: fields the Prometheus Operator does not know were dropped"


def test_every_rendered_object_validates_against_kubernetes_schemas(value_set):
    name, values = value_set
    objects = render_objects(values)
    assert objects, "the chart rendered nothing"
    for obj in objects:
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in MONITORING_KINDS:
            # kubernetes-validate ships only the built-in API schemas.
            print(f"{where}: no schema for {obj['apiVersion']} in kubernetes-validate; checked with the Prometheus "
                  "Operator's CRD models instead")
            _validate_monitoring(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{where}: {error.message} at {'/'.join(map(str, error.path))}")


def test_validation_catches_a_broken_object():
    # Guards the test above against passing vacuously: a misspelt or mistyped field must be rejected.
    objects = render_objects(VALUE_SETS["monitoring"])
    deployment = one_of_kind(objects, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    pod_monitor = one_of_kind(objects, "PodMonitor")
    pod_monitor["spec"]["podMetricsEndpoints"][0]["targetPrt"] = 9400
    with pytest.raises(AssertionError, match="does not know"):
        _validate_monitoring(pod_monitor)
    monitor = one_of_kind(objects, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(pydantic.ValidationError):
        _validate_monitoring(monitor)


def test_notes_render_for_every_value_set(value_set):
    name, values = value_set
    notes = render_manifests(values)["grpo-operator/templates/NOTES.txt"]
    assert "kubectl get grporuns" in notes, name


def _operator_container(objects):
    return one_of_kind(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_deployment_runs_one_hardened_replica():
    objects = render_objects()
    deployment = one_of_kind(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert not objects_of_kind(objects, "PodDisruptionBudget")
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["command"] == ["grporun"]
    assert container["args"][0] == "operator"


def test_more_replicas_elect_a_leader_roll_one_at_a_time_and_keep_one_through_a_drain():
    objects = render_objects(VALUE_SETS["ha"])
    deployment = one_of_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    budget = one_of_kind(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    container = _operator_container(objects)
    assert "--leader-elect" in container["args"]
    assert f"--lease-name={deployment['metadata']['name']}" in container["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"


def test_replicas_must_be_positive():
    with pytest.raises(Exception, match="replicas"):
        render_objects({"replicas": 0})


def test_ports_and_probe_match_the_operator():
    objects = render_objects()
    container = _operator_container(objects)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": metric_names.OPERATOR_METRICS_PORT, "liveness": metric_names.OPERATOR_LIVENESS_PORT}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and ports[probe["port"]] == metric_names.OPERATOR_LIVENESS_PORT
    assert f"--liveness=http://0.0.0.0:{metric_names.OPERATOR_LIVENESS_PORT}/healthz" in container["args"]
    service = one_of_kind(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": metric_names.OPERATOR_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]
    selector = service["spec"]["selector"]
    pod_labels = one_of_kind(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()


def test_watch_mode_decides_the_operator_flags():
    cluster_args = _operator_container(render_objects())["args"]
    assert "--all-namespaces" in cluster_args and not any(a.startswith("--namespace") for a in cluster_args)
    namespaced_args = _operator_container(render_objects(VALUE_SETS["namespaced"]))["args"]
    assert "--all-namespaces" not in namespaced_args
    assert [a for a in namespaced_args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]
    # No namespaces listed: the release namespace.
    own_args = _operator_container(render_objects({"watch": {"allNamespaces": False}}))["args"]
    assert [a for a in own_args if a.startswith("--namespace=")] == [f"--namespace={RELEASE_NAMESPACE}"]


def test_operator_accepts_the_rendered_flags():
    """The chart's args parse with the operator's own argument parser, so a renamed flag fails here, not in a pod."""
    from grpo_operator import cli

    for name in ("defaults", "namespaced", "custom", "ha"):
        args = _operator_container(render_objects(VALUE_SETS[name]))["args"]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                cli.build_parser(args).parse_args(args)
        except SystemExit:
            pytest.fail(f"`grporun {' '.join(args)}` ({name} values) is refused: {stderr.getvalue().strip()}")


def test_custom_values_reach_the_objects():
    objects = render_objects(VALUE_SETS["custom"])
    container = _operator_container(objects)
    pod = one_of_kind(objects, "Deployment")["spec"]["template"]["spec"]
    assert container["image"] == "registry.example.com/ml/grpo-operator:0.1.0-rc1"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == VALUE_SETS["custom"]["resources"]
    assert "--log-level=DEBUG" in container["args"] and container["args"][-1] == "--reconcile-interval=10"
    assert pod["serviceAccountName"] == "existing-sa" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert not objects_of_kind(objects, "ServiceAccount")
    assert not objects_of_kind(objects, "ConfigMap")
    # The default image tags follow the chart's appVersion: the operator's is it, the trainer's its CUDA variant (the
    # tags a release pushes: hack/lib/release.sh).
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    defaults = _operator_container(render_objects())
    assert defaults["image"] == f"grpo-operator:{app_version}"
    assert f"--trainer-image=grpo-trainer:{app_version}-cuda" in defaults["args"]
    chosen = _operator_container(render_objects({"trainerImage": {"repository": "r/grpo-trainer", "tag": "cpu"}}))
    assert "--trainer-image=r/grpo-trainer:cpu" in chosen["args"]


def test_monitoring_objects_are_opt_in():
    kinds = {obj["kind"] for obj in render_objects()}
    assert not kinds & MONITORING_KINDS
    kinds = {obj["kind"] for obj in render_objects(VALUE_SETS["monitoring"])}
    assert kinds >= MONITORING_KINDS


def test_monitoring_objects():
    objects = render_objects(VALUE_SETS["monitoring"])
    service = one_of_kind(objects, "Service")
    monitor = one_of_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The operator's series carry the run's `namespace`; without honorLabels Prometheus would rename it to
    # exported_namespace and put the operator's own namespace there, and every alert would join on the wrong one.
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    # The operator's scrape job is named after this Service: GRPOOperatorDown matches job=~".*grpo-operator.*".
    assert "grpo-operator" in service["metadata"]["name"]

    pod_monitor = one_of_kind(objects, "PodMonitor")
    expression = pod_monitor["spec"]["selector"]["matchExpressions"][0]
    assert expression["key"] == "grpo.dev/role" and "learner" in expression["values"]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    endpoints = {e["relabelings"][0]["regex"]: e for e in pod_monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["learner"]["targetPort"] == LEARNER_HTTP_PORT
    assert endpoints["rollout"]["targetPort"] == ROLLOUT_HTTP_PORT
    learner = endpoints["learner"]
    assert learner["path"] == METRICS_PATH
    relabel = {r.get("targetLabel"): r["sourceLabels"] for r in learner["relabelings"] if r.get("targetLabel")}
    assert relabel["run"] == ["__meta_kubernetes_pod_label_grpo_dev_run"]
    assert relabel["namespace"] == ["__meta_kubernetes_namespace"]

    namespaced = render_objects({**VALUE_SETS["namespaced"], **VALUE_SETS["monitoring"]})
    assert one_of_kind(namespaced, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}

    rule = one_of_kind(objects, "PrometheusRule")
    alerts = yaml.safe_load((CHART_DIR / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == alerts  # the shipped rules are exactly the file promtool tests

    dashboard = one_of_kind(objects, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_ports_in_values_are_the_shared_constants():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["ports"] == {
        "metrics": metric_names.OPERATOR_METRICS_PORT,
        "liveness": metric_names.OPERATOR_LIVENESS_PORT,
    }
    assert values["metrics"]["podMonitor"]["learnerPort"] == LEARNER_HTTP_PORT
    assert values["metrics"]["podMonitor"]["rollout"]["port"] == ROLLOUT_HTTP_PORT
