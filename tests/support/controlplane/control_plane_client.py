"""Talking to the test control plane: a client for one identity (admin, or a ServiceAccount token), the objects the
chart and the tests install, and `kubectl` with a kubeconfig of that identity."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import requests

from tests.support.controlplane.control_plane import ControlPlane
from tests.support.emulator.kube_emulator import ApiError, KubeClient

# kind -> (API path prefix, plural, namespaced) for the objects the fixtures create by kind.
KINDS = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
}


class Client(KubeClient):
    """The emulator tests' client (same methods), over HTTPS with a bearer token and the server's CA."""

    def __init__(self, plane: ControlPlane, token: str):
        super().__init__(plane.url)
        self.plane, self.token = plane, token
        self.session = plane.session(token)

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.session.request(method, self.url + path, timeout=30, **kwargs)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        if response.status_code >= 400:
            body = response.json() if response.headers.get("Content-Type") == "application/json" else {}
            raise ApiError(response.status_code, body.get("reason", ""), response.text)
        return response.json()

    def create_object(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create one object of a kind in KINDS; an existing one is left as it is."""
        prefix, plural, namespaced = KINDS[obj["kind"]]
        namespace = obj["metadata"].get("namespace", namespace)
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
        try:
            return self.call("POST", path, json=obj)
        except ApiError as error:
            if error.code != 409:
                raise
            return self.call("GET", f"{path}/{obj['metadata']['name']}")

    def create_namespace(self, name: str) -> None:
        """A namespace and its "default" ServiceAccount (the controller-manager would add it; there is none)."""
        self.create_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        self.create_object({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}, name)

    def install_crd(self, crd: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        self.create_object(crd)
        name, group = crd["metadata"]["name"], crd["spec"]["group"]
        version = crd["spec"]["versions"][0]["name"]
        plural = crd["spec"]["names"]["plural"]
        deadline = time.monotonic() + timeout
        while True:
            stored = self.call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            established = any(c["type"] == "Established" and c["status"] == "True"
                              for c in (stored.get("status") or {}).get("conditions") or [])
            if established and self.request("GET", f"/apis/{group}/{version}/{plural}").status_code == 200:
                return stored
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {name} not established: {stored.get('status')}")
            time.sleep(0.2)

    def service_account_token(self, namespace: str, name: str, seconds: int = 7200) -> str:
        """A token for the ServiceAccount from the TokenRequest API (what a pod's projected token is)."""
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": seconds}}
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        return self.call("POST", path, json=request)["status"]["token"]

    def can(self, user: str, verb: str, group: str, resource: str, subresource: str | None = None,
            namespace: str | None = None, name: str | None = None) -> bool:
        """The real authorizer's answer (SubjectAccessReview) for `user` (on the object `name`, when given)."""
        attributes = {"verb": verb, "group": group, "resource": resource, "subresource": subresource or "",
                      "namespace": namespace or "", "name": name or ""}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": user, "groups": ["system:serviceaccounts", "system:authenticated"],
                           "resourceAttributes": attributes}}
        answer = self.call("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", json=review)
        return bool(answer["status"].get("allowed"))


def kubectl(plane: ControlPlane, kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
    binary = plane.bin_dir / "kubectl"
    done = subprocess.run([str(binary), f"--kubeconfig={kubeconfig}", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def status_causes(error: ApiError) -> list[str]:
    """The fields an API error names: details.causes[].field, or the field of a strict-decoding error."""
    body = json.loads(error.message)
    causes = [cause.get("field", "") for cause in (body.get("details") or {}).get("causes", [])]
    return [cause for cause in causes if cause]
