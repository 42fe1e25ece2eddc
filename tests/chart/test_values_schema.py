"""values.schema.json: accepts the shipped and documented value sets, rejects bad values with a one-line message
that names the key, through the real Helm engine (the same check `helm install` runs)."""

from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.support.chart_render import CHART_DIR, VALUE_SETS, render_objects

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


def test_schema_is_draft_07_and_accepts_the_defaults():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(yaml.safe_load((CHART_DIR / "values.yaml").read_text()))


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_schema_accepts_the_tested_value_sets(name):
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values(VALUE_SETS[name]))


BAD_VALUES = [
    ({"watch": {"allNamespaces": "yes"}}, "/watch/allNamespaces", "got string, want boolean"),
    ({"watch": {"allNamespaces": False, "namespaces": ["Team_A"]}}, "/watch/namespaces/0", "'Team_A' does not match"),
    ({"replicaCount": 2}, "at ''", "additional properties 'replicaCount' not allowed"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "value must be one of"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory", "'lots' does not match"),
    ({"ports": {"metrics": 70000}}, "/ports/metrics", "want 65,535"),
    ({"metrics": {"serviceMonitor": {"enabled": True, "interval": "30 seconds"}}}, "/metrics/serviceMonitor/interval",
     "'30 seconds'"),
    ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, "/dashboard/labels/grafana_dashboard",
     "got number, want string"),
    ({"operator": {"logLevel": "info"}}, "/operator/logLevel", "value must be one of"),
    ({"admissionPolicy": {"enabled": "no"}}, "/admissionPolicy/enabled", "got string, want boolean"),
    ({"admissionPolicy": {"failurePolicy": "Ignore"}}, "/admissionPolicy",
     "additional properties 'failurePolicy' not allowed"),
    ({"admissionPolicy": {"tenancy": {"enabled": "no"}}}, "/admissionPolicy/tenancy/enabled",
     "got string, want boolean"),
    ({"admissionPolicy": {"tenancy": True}}, "/admissionPolicy/tenancy", "got boolean, want object"),
]


@pytest.mark.parametrize(("values", "where", "what"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_bad_values_are_rejected_with_a_readable_message(values, where, what):
    with pytest.raises(helm.HelmValuesError) as caught:
        render_objects(values)
    message = str(caught.value)
    print(message)
    assert where in message and what in message
    assert "Traceback" not in message and len(message.splitlines()) <= 4
