"""Before `grporun operator` hands over to kopf: are there credentials, does the API server answer, is the CRD
installed? Each failure is one line saying what was looked for, instead of kopf's traceback (`LoginError: Ran out
of valid credentials`) or a silent wait on a resource that does not exist.

It uses the same sources kopf logs in with: the in-cluster service account, then $KUBECONFIG or ~/.kube/config.
"""

from __future__ import annotations

import os

from ..api import GROUP, PLURAL

CRD_NAME = f"{PLURAL}.{GROUP}"
INSTALL_CRD = "kubectl apply --server-side -f crds/grporun.yaml (or install the Helm chart)"
REQUEST_TIMEOUT_SECONDS = 10


def cluster_problem() -> str | None:
    """None when the operator can start; else one line naming what is missing or unreachable."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        config.load_incluster_config()
        source = "the in-cluster service account"
    except ConfigException:
        kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        try:
            config.load_kube_config(config_file=kubeconfig.split(os.pathsep)[0])
        except (ConfigException, OSError, TypeError, ValueError):
            return ("no Kubernetes credentials found: looked for an in-cluster service account "
                    "(KUBERNETES_SERVICE_HOST and its token), $KUBECONFIG and ~/.kube/config")
        source = f"kubeconfig {kubeconfig}"
    api = client.ApiextensionsV1Api()
    host = api.api_client.configuration.host
    try:
        found = api.list_custom_resource_definition(field_selector=f"metadata.name={CRD_NAME}",
                                                    _request_timeout=REQUEST_TIMEOUT_SECONDS)
    except ApiException as error:
        return f"the API server at {host} ({source}) refused to list CRDs: HTTP {error.status} {error.reason}"
    except (HTTPError, OSError) as error:
        return f"cannot reach the API server at {host} ({source}): {type(error).__name__}"
    if not found.items:
        return f"the GRPORun CRD ({CRD_NAME}) is not installed in the cluster at {host}: {INSTALL_CRD}"
    return None
