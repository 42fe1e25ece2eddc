"""The faults of tests/operator/test_faults.py, made on the real control plane by the server's own machinery rather
than injected answers: the Eviction API, a ResourceQuota (403 exceeded quota from the quota admission plugin), a
ValidatingAdmissionPolicy (422 Invalid from admission), and a pod finalizer standing in for a node that never
confirms a deletion. The garbage collector is kube-controller-manager's; the default control plane runs none, so
collect_garbage() does its job for the kinds a run owns."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.support.controlplane.control_plane_client import Client
from tests.support.emulator.kube_emulator import CONFIGMAPS, GRPORUNS, PODS, SERVICES, ApiError

NODE_FINALIZER = "test.grpo.dev/node-never-confirms"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
# What quota admission needs to enforce a quota: with no quota controller to compute status, it refuses every pod
# of the namespace ("status unknown for quota"), so the status is written as the controller would.
QUOTA = "pods"


class ClusterFaults:
    """Fault makers for one namespace; close() removes what outlives it (cluster-scoped admission policies)."""

    def __init__(self, admin: Client, namespace: str):
        self.admin, self.namespace = admin, namespace
        self.policies: list[str] = []

    def evict(self, pod: str) -> None:
        """POST pods/eviction: the server sets DisruptionTarget and deletes the pod (unbound: at once)."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": self.namespace}}
        self.admin.call("POST", f"/api/v1/namespaces/{self.namespace}/pods/{pod}/eviction", json=body)

    def collect_garbage(self) -> None:
        """Delete the run-owned objects whose owners are all gone, as the garbage collector would."""
        owners = {run["metadata"]["uid"] for run in self.admin.list(GRPORUNS, self.namespace)}
        for rdef in (PODS, CONFIGMAPS, SERVICES):
            for obj in self.admin.list(rdef, self.namespace, "grpo.dev/run"):
                references = obj["metadata"].get("ownerReferences") or []
                if references and not {ref["uid"] for ref in references} & owners:
                    self.admin.delete(rdef, self.namespace, obj["metadata"]["name"])

    def limit_pods(self, hard: int | None) -> None:
        """A ResourceQuota of `hard` pods in the namespace; None raises it out of the way."""
        limit = {"pods": str(1000 if hard is None else hard)}
        path = f"/api/v1/namespaces/{self.namespace}/resourcequotas"
        if hard is not None:
            quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": QUOTA}, "spec": {"hard": limit}}
            self.admin.call("POST", path, json=quota)
        else:
            self._merge_patch(f"{path}/{QUOTA}", {"spec": {"hard": limit}})
        used = self.admin.call("GET", f"{path}/{QUOTA}").get("status", {}).get("used") or {"pods": "0"}
        self._merge_patch(f"{path}/{QUOTA}/status", {"status": {"hard": limit, "used": used}})
        if hard is not None:
            self._wait_refused("probe", "exceeded quota")

    def enforce_restricted_pod_security(self) -> None:
        """Label the namespace pod-security.kubernetes.io/enforce=restricted: the PodSecurity admission plugin then
        refuses (403) every pod that breaks the profile."""
        self._merge_patch(f"/api/v1/namespaces/{self.namespace}",
                          {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
        self._wait_refused("probe", "violates PodSecurity")  # the probe pod sets no securityContext at all

    def refuse_pod(self, pod: str, message: str) -> None:
        """A ValidatingAdmissionPolicy, bound to this namespace, that denies creating a pod named `pod` (422)."""
        name = f"refuse-{self.namespace}-{pod}"
        policy = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {"failurePolicy": "Fail",
                     "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                             "operations": ["CREATE"], "resources": ["pods"]}]},
                     "validations": [{"expression": f"object.metadata.name != '{pod}'", "message": message}]}}
        binding = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"],
                     "matchResources": {"namespaceSelector": {
                         "matchLabels": {"kubernetes.io/metadata.name": self.namespace}}}}}
        self.admin.call("POST", f"{ADMISSION}/validatingadmissionpolicies", json=policy)
        self.policies.append(name)
        self.admin.call("POST", f"{ADMISSION}/validatingadmissionpolicybindings", json=binding)
        self._wait_refused(pod, message)

    def close(self) -> None:
        for name in self.policies:
            for plural in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                try:
                    self.admin.call("DELETE", f"{ADMISSION}/{plural}/{name}")
                except ApiError as error:
                    if error.code != 404:
                        raise

    def _merge_patch(self, path: str, patch: dict[str, Any]) -> None:
        self.admin.call("PATCH", path, json=patch, headers={"Content-Type": "application/merge-patch+json"})

    def _wait_refused(self, pod: str, message: str, timeout: float = 30.0) -> None:
        """Admission reads policies and quotas from informers: wait until a dry-run create of `pod` is refused."""
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"containers": [{"name": "probe", "image": "probe"}]}}
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.admin.call("POST", f"/api/v1/namespaces/{self.namespace}/pods", json=body,
                                params={"dryRun": "All"})
            except ApiError as error:
                if message in json.loads(error.message).get("message", ""):
                    return
                raise
            if time.monotonic() > deadline:
                raise AssertionError(f"the server still admits pod {pod} after {timeout} s")
            time.sleep(0.2)
