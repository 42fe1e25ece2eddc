"""MLflow: transformers' MLflowCallback, pointed at `spec.tracking.mlflow`'s tracking server; the run's spec as its
parameters, its run's page on /progress, and the recorded run continued by the learner's next start while the server
still has it."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from ...contract.config import RunConfig
from ...contract.pod_env import MLFLOW_CREDENTIAL_ENV
from ...contract.report import ExportReport, TrackedRunReport
from .base import Integrations, RecordedMlflowRun, RecordedRuns, TrackerUnavailable, TrackingConfigError, tracked_run
from .guard import ThreadHooks

logger = logging.getLogger(__name__)

#: MLflow refuses a parameter value longer than this.
MLFLOW_PARAM_MAX_CHARS = 6000
MLFLOW_PARAMS_PER_BATCH = 100
#: The tags the model's export leaves on the run's MLflow run: its URI, its manifest's sha256, the step.
EXPORT_URI_TAG = "grpo.output.uri"
EXPORT_SHA256_TAG = "grpo.output.sha256"
EXPORT_STEP_TAG = "grpo.output.step"
#: How long the start-up probe waits for the tracking server's answer. MLflow's own client retries a server that does
#: not answer for about 5 minutes, inside the training loop, and then the learner crashed.
PROBE_TIMEOUT_S = 5.0
#: MLflow's HTTP client, told to give up within about a minute (3 tries of 20 s; its defaults, 8 tries of 120 s with
#: backoffs up to 2 minutes, hold a call for up to 20 minutes). 20 s leaves a busy server time to answer. Its calls
#: run on the tracker's own thread (grpo_trainer.learner.tracking.guard): one that fails drops MLflow for the rest of
#: the run.
MLFLOW_HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def mlflow_experiment(config: RunConfig) -> str:
    """The MLflow experiment the run's runs go to: the spec's, else the run's namespace."""
    return config.tracking.mlflow.experiment or config.namespace


def mlflow_run_uri(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where a user opens an MLflow run: its page in the tracking server's UI; for a tracking URI that is no web
    server (a file store, a database), the URI and the run id."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{tracking_uri}#{run_id}"


def continued_mlflow_run(config: RunConfig, recorded: RecordedMlflowRun) -> str | None:
    """The recorded MLflow run's id when the tracking server still has it, active, in the run's experiment; else
    None with a warning (MLflow refuses to continue such a run, and the learner would fail each start)."""
    mlflow = config.tracking.mlflow
    experiment = mlflow_experiment(config)
    if recorded.tracking_uri != mlflow.tracking_uri or recorded.experiment != experiment:
        logger.warning(f"tracking: MLflow run {recorded.run_id} was on {recorded.tracking_uri!r} in experiment "
                       f"{recorded.experiment!r}; spec.tracking.mlflow now names another: starting a new run")
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow.tracking_uri)
    try:
        run = client.get_run(recorded.run_id)
        run_experiment = client.get_experiment(run.info.experiment_id)
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            logger.warning(f"tracking: MLflow run {recorded.run_id} is not on {mlflow.tracking_uri} any more: "
                           "starting a new run")
            return None
        # The tracking server cannot say now; starting the run will meet the same trouble and report it.
        logger.warning(f"tracking: cannot check MLflow run {recorded.run_id} ({str(error).splitlines()[0]}): "
                       "continuing it")
        return recorded.run_id
    if run.info.lifecycle_stage != "active" or run_experiment.name != experiment:
        logger.warning(f"tracking: MLflow run {recorded.run_id} was deleted or moved out of experiment "
                       f"{experiment!r}: starting a new run")
        return None
    return recorded.run_id


class MlflowTracker:
    name = "mlflow"
    package = "mlflow"

    def check(self, config: RunConfig, environ: Mapping[str, str]) -> None:
        mlflow = config.tracking.mlflow
        credentials_given = any(environ.get(variable) for variable in MLFLOW_CREDENTIAL_ENV.values())
        if mlflow.credentials_secret and not credentials_given:
            raise TrackingConfigError(
                f"spec.tracking.mlflow.credentialsSecret: Secret {mlflow.credentials_secret!r} is missing or has "
                f"none of the keys {', '.join(MLFLOW_CREDENTIAL_ENV)}")

    def probe(self, config: RunConfig) -> None:
        """A tracking server (http, https) answers its `/health`; any answer will do (one behind a login answers
        401). A file store or a database is the integration's to open."""
        import requests

        uri = config.tracking.mlflow.tracking_uri
        if not uri.startswith(("http://", "https://")):
            return
        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S)
        except requests.RequestException as error:
            raise TrackerUnavailable(f"spec.tracking.mlflow.trackingUri: nothing answers at {uri} within "
                                     f"{PROBE_TIMEOUT_S:.0f}s ({type(error).__name__})") from None

    def env(self, config: RunConfig) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_URI": config.tracking.mlflow.tracking_uri,
            "MLFLOW_EXPERIMENT_NAME": mlflow_experiment(config),
            "MLFLOW_TAGS": json.dumps({"grpo.dev/namespace": config.namespace, "grpo.dev/run": config.run_name}),
            **MLFLOW_HTTP_ENV,
        }

    def location(self, config: RunConfig) -> str:
        return config.tracking.mlflow.tracking_uri

    def thread_hooks(self, integration: Any) -> ThreadHooks:
        """The integration logs synchronously on its thread: there a slow server holds no training step, and a
        failed call raises where the guard sees it (asynchronous logging's failures stay in MLflow's queue). MLflow
        keeps the active run per thread: the tracker's thread shares this thread's, so the run the integration
        starts there is the one `log_parameters` and `started_run` read here, and its end ends it here too. Once
        MLflow is dropped, its run leaves that stack: MLflow would end it at exit, retrying the lost server."""
        from mlflow.tracking import fluent

        # transformers' setup() turns asynchronous logging back on (for MLflow 2.8 and later): off again after it.
        integration._async_log = False
        setup = integration.setup

        def synchronous_setup(*args: Any, **kwargs: Any) -> Any:
            started = setup(*args, **kwargs)
            integration._async_log = False
            return started

        integration.setup = synchronous_setup
        active_runs = fluent._active_run_stack.get()
        return ThreadHooks(setup=lambda: fluent._active_run_stack.set(active_runs), release=active_runs.clear,
                           refused=refused_by_server)

    def directory(self, config: RunConfig) -> str | None:
        return None  # the tracking server keeps the run

    def continued_env(self, config: RunConfig, recorded: RecordedRuns) -> dict[str, str]:
        if recorded.mlflow is None or not (run_id := continued_mlflow_run(config, recorded.mlflow)):
            return {}
        # The run holds transformers' TrainingArguments parameters from its first start; logging them again would
        # have MLflow refuse each one whose value changed (a moved rollout server) with an error in the log.
        logger.info(f"tracking: continuing the MLflow run {run_id} of this learner's last start")
        return {"MLFLOW_RUN_ID": run_id, "MLFLOW_MAX_LOG_PARAMS": "0"}

    def log_parameters(self, parameters: dict[str, str], integrations: Integrations) -> None:
        import mlflow

        if (active := mlflow.active_run()) is None:
            return
        fitting = {k: v for k, v in parameters.items() if len(v) <= MLFLOW_PARAM_MAX_CHARS}
        for key in sorted(set(parameters) - set(fitting)):
            logger.warning(f"mlflow: parameter {key} is over {MLFLOW_PARAM_MAX_CHARS} characters: not logged")
        # A continued run holds the parameters of its first start; MLflow refuses to change a parameter's value.
        logged = mlflow.get_run(active.info.run_id).data.params
        changed = sorted(key for key, value in fitting.items() if key in logged and logged[key] != value)
        if changed:
            more = " ..." if len(changed) > 5 else ""
            logger.warning(f"mlflow: run {active.info.run_id} keeps its first value of {len(changed)} "
                           f"parameter(s) changed since: {', '.join(changed[:5])}{more}")
        items = sorted((key, value) for key, value in fitting.items() if key not in logged)
        for start in range(0, len(items), MLFLOW_PARAMS_PER_BATCH):
            mlflow.log_params(dict(items[start:start + MLFLOW_PARAMS_PER_BATCH]))

    def started_run(self, run_name: str, integrations: Integrations) -> TrackedRunReport | None:
        import mlflow

        if (active := mlflow.active_run()) is None:
            return None
        info = active.info
        return tracked_run("mlflow", info.run_id, mlflow_run_uri(mlflow.get_tracking_uri(), info.experiment_id,
                                                                 info.run_id))

    def recorded(self, config: RunConfig, run_id: str) -> RecordedMlflowRun:
        return RecordedMlflowRun(runId=run_id, trackingUri=config.tracking.mlflow.tracking_uri,
                                 experiment=mlflow_experiment(config))


def refused_by_server(error: BaseException) -> bool:
    """The tracking server answered 400: it will not take this call's values (a parameter whose value changed, a
    name or value it does not accept). Its other answers (401, 403, 404, 5xx) and transport errors are not."""
    from mlflow.exceptions import MlflowException

    return isinstance(error, MlflowException) and error.get_http_status_code() == HTTPStatus.BAD_REQUEST


def tag_export(tracking_uri: str, run_id: str, exported: ExportReport) -> None:
    """Where the run's model went, as tags of its MLflow run (one request): a registry or a reader of the run finds
    the model, and its manifest's digest, from the run."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    tags = {EXPORT_URI_TAG: exported.uri, EXPORT_SHA256_TAG: exported.sha256, EXPORT_STEP_TAG: str(exported.step)}
    MlflowClient(tracking_uri).log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])

