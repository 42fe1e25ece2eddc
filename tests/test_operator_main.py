"""`grporun operator`: its flags accept what the Helm chart passes, and the liveness probe answers through kopf."""

from __future__ import annotations

import argparse
import socket

import pytest
import requests
from chart_render import objects_of_kind, render_objects
from operator_fixtures import cluster, progress_urls  # noqa: F401 (fixtures)

from grpo_operator import main


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("values", [{"watch": {"allNamespaces": True}},
                                    {"watch": {"allNamespaces": False, "namespaces": ["a", "b"]}}])
def test_the_charts_container_args_parse(values):
    deployment = objects_of_kind(render_objects(values), "Deployment")[0]
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    assert operator["command"] == ["grporun"] and operator["args"][0] == "operator"
    args = parse(operator["args"][1:])
    assert args.standalone is True
    if values["watch"]["allNamespaces"]:
        assert args.all_namespaces is True and args.namespace == []
    else:
        assert args.namespace == ["a", "b"] and not args.all_namespaces
    assert args.liveness.endswith("/healthz") and args.metrics_port > 0


def test_a_namespace_scope_is_required():
    assert main.main(parse([])) == 2
    with pytest.raises(SystemExit):
        parse(["--namespace", "a", "--all-namespaces"])


@pytest.mark.slow
def test_the_liveness_probe_answers_through_kopf(cluster):
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    cluster.stop_operator()
    cluster.start_operator(liveness_endpoint=f"http://127.0.0.1:{port}/healthz")
    response = cluster.wait_for(lambda: _get(f"http://127.0.0.1:{port}/healthz"), what="the liveness endpoint")
    assert response.status_code == 200 and response.json() == {"runs": 0}


def _get(url: str) -> requests.Response | None:
    try:
        return requests.get(url, timeout=2)
    except requests.ConnectionError:
        return None
