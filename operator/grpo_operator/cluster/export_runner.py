"""`grporun export --cluster`'s I/O: read the run, start its export pod (export_pod.py builds it), follow it to its
end, and record the exported model on the run's status.output.

The command line records the result, not the operator: it is there, waiting on the pod anyway, while the operator
gives a finished run no more passes (nothing of it changes by itself). Its write is a merge patch of
`status.output` alone, and the operator writes only the status fields its own pass changed, so neither undoes the
other. It speaks to the API server with the `kubernetes` client and the credentials `grporun operator` would use
(cli/preflight.py loads them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..api import GROUP, KIND, PLURAL, VERSION, SpecError, parse_stored_spec
from ..builders import config_map_name, learner_pod_name
from ..export_pod import (
    EXPORT_ROLE,
    Exported,
    ExportFailed,
    build_export_pod,
    export_outcome,
    export_progress,
    export_refusal,
)
from ..run_ref import RunRef
from ..run_status import parse_status
from ..status.derive import output_status
from .pods import observe_pod

#: Seconds between two reads of the export pod.
POLL_SECONDS = 2.0
#: How long a finished export pod of an earlier export may take to go once deleted.
DELETE_WAIT_SECONDS = 60.0


class ExportProblem(Exception):
    """Why the export could not be done, in one line naming what failed."""


@dataclass(frozen=True)
class ExportRequest:
    namespace: str
    run: str
    trainer_image: str  # for a run whose spec.learner.image is unset and whose learner pod is gone
    checkpoint: str | None = None
    timeout_s: float = 3600.0


def _status_code(error: BaseException) -> int | None:
    return getattr(error, "status", None)


class ClusterExport:
    """The export of one run against the API server (`core`: a CoreV1Api, `custom`: a CustomObjectsApi)."""

    def __init__(self, core: Any, custom: Any, say: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        self.core, self.custom, self.say, self.sleep, self.clock = core, custom, say, sleep, clock

    def export(self, request: ExportRequest) -> Exported:
        """Start the export pod, wait for it and record its report; ExportProblem naming what failed."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        namespace = request.namespace
        try:
            run, pod = self._export_pod(request)
            self._clear_earlier(namespace, pod["metadata"]["name"])
            self.core.create_namespaced_pod(namespace, pod)
            self.say(f"pod {pod['metadata']['name']} created: exporting the model of GRPORun {namespace}/{run.name} "
                     "from its newest complete checkpoint")
            outcome = self._wait(namespace, pod["metadata"]["name"], request.timeout_s)
            if isinstance(outcome, ExportFailed):
                raise ExportProblem(outcome.message)
            output = output_status(outcome.report).model_dump(mode="json", by_alias=True, exclude_none=True)
            patch = {"status": {"output": output}}
            self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, run.name, patch)
        except ApiException as error:
            raise ExportProblem(f"the API server refused: HTTP {error.status} {error.reason}: "
                                f"{_api_message(error)}") from None
        except (HTTPError, OSError) as error:
            raise ExportProblem(f"the API server could not be reached: {type(error).__name__}: {error}") from None
        return outcome

    def _export_pod(self, request: ExportRequest) -> tuple[RunRef, dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        namespace, name = request.namespace, request.run
        try:
            body = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as error:
            if _status_code(error) == 404:
                raise ExportProblem(f"no {KIND} {name!r} in namespace {namespace!r}") from None
            raise
        run = RunRef.of(body["metadata"])
        try:
            spec, _ = parse_stored_spec(dict(body.get("spec") or {}))
        except SpecError as error:
            raise ExportProblem(f"{KIND} {namespace}/{name}: {error}") from None
        status = parse_status(body.get("status"))
        refusal = export_refusal(spec, status)
        if refusal is not None:
            raise ExportProblem(f"{KIND} {namespace}/{name}: {refusal}")
        try:
            self.core.read_namespaced_config_map(config_map_name(name), namespace)
        except ApiException as error:
            if _status_code(error) == 404:
                raise ExportProblem(f"{KIND} {namespace}/{name}: its run config, ConfigMap "
                                    f"{config_map_name(name)!r}, is gone: the operator makes it while the run "
                                    "exists, so the run is being deleted") from None
            raise
        return run, build_export_pod(run, spec, status, trainer_image=self._learner_image(namespace, name) or
                                     request.trainer_image, checkpoint=request.checkpoint)

    def _learner_image(self, namespace: str, run: str) -> str | None:
        """The image learner rank 0 ran, while its pod is still there: the operator's --trainer-image then."""
        from kubernetes.client.exceptions import ApiException

        try:
            pod = self.core.read_namespaced_pod(learner_pod_name(run, 0), namespace)
        except ApiException as error:
            if _status_code(error) == 404:
                return None
            raise
        return next((c.image for c in pod.spec.containers if c.name == "learner"), None)

    def _clear_earlier(self, namespace: str, name: str) -> None:
        """Delete the export pod an earlier export left (finished), and wait for it to go; refuse one running."""
        from kubernetes.client.exceptions import ApiException

        try:
            earlier = self._read(namespace, name)
        except ApiException as error:
            if _status_code(error) == 404:
                return
            raise
        if export_outcome(earlier) is None:
            raise ExportProblem(f"pod {name} of an earlier export is {earlier.phase}: wait for it, or delete it")
        self.core.delete_namespaced_pod(name, namespace)
        deadline = self.clock() + DELETE_WAIT_SECONDS
        while self.clock() < deadline:
            try:
                self._read(namespace, name)
            except ApiException as error:
                if _status_code(error) == 404:
                    return
                raise
            self.sleep(POLL_SECONDS)
        raise ExportProblem(f"pod {name} of an earlier export was deleted but is still there after "
                            f"{DELETE_WAIT_SECONDS:.0f}s")

    def _read(self, namespace: str, name: str) -> Any:
        from kubernetes.client import ApiClient

        pod = self.core.read_namespaced_pod(name, namespace)
        return observe_pod(ApiClient().sanitize_for_serialization(pod))

    def _wait(self, namespace: str, name: str, timeout_s: float) -> Exported | ExportFailed:
        deadline, shown = self.clock() + timeout_s, None
        while True:
            pod = self._read(namespace, name)
            line = export_progress(pod)
            if line != shown:
                self.say(line)
                shown = line
            outcome = export_outcome(pod)
            if outcome is not None:
                return outcome
            if self.clock() >= deadline:
                raise ExportProblem(f"pod {name} has not ended after {timeout_s:.0f}s ({line}); it is left running "
                                    f"(kubectl -n {namespace} logs {name} -c {EXPORT_ROLE})")
            self.sleep(POLL_SECONDS)


def _api_message(error: Any) -> str:
    import json

    try:
        return json.loads(error.body).get("message") or str(error.body)
    except (TypeError, ValueError, AttributeError):
        return str(error.body or error.reason)
