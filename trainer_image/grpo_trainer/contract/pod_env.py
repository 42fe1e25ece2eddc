"""The environment variables the operator renders onto the pods and the pods read: the inputs' and trackers'
credentials (from Secrets of the run's namespace) and the environment servers' URLs. The object store's own
variables are with its URI grammar (`grpo_trainer.contract.store_uri`)."""

from __future__ import annotations

#: The learner's and the rollout server's names for the inputs' object-store credentials (spec.inputs
#: .credentialsSecret's keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, with this prefix): apart from
#: the plain names, which learner rank 0 may hold for spec.output's store.
INPUT_CREDENTIALS_ENV_PREFIX = "GRPO_INPUTS_"
#: The hub token huggingface_hub reads (spec.inputs.hubTokenSecret's key of the same name).
HUB_TOKEN_ENV = "HF_TOKEN"


def environment_url_variable(name: str) -> str:
    """The variable that holds an environment server's URL on the learner's pods, so that an environment factory
    reads it without our code: GRPO_ENVIRONMENT_<NAME>_URL, the name upper-cased with '-' as '_'."""
    return f"GRPO_ENVIRONMENT_{name.upper().replace('-', '_')}_URL"


#: What separates an environment's server URLs where it has several addresses of its own (`grporun local`: one
#: loopback port per server); on a cluster the value is one URL, its headless Service's, whose name resolves to the
#: ready servers. The learner's client (grpo_trainer.agentic.servers) reads both.
ENVIRONMENT_URL_SEPARATOR = ","


# Experiment tracking (spec.tracking): credentials come from Secrets of the run's namespace, as env vars of the learner
# pods (the operator renders them, optional, so that a missing Secret is the learner's one-line exit 78 naming the
# field rather than a pod that never starts).
#: Key of the MLflow credentials Secret -> the env var MLflow's client reads it from.
MLFLOW_CREDENTIAL_ENV = {
    "username": "MLFLOW_TRACKING_USERNAME",
    "password": "MLFLOW_TRACKING_PASSWORD",
    "token": "MLFLOW_TRACKING_TOKEN",
}
WANDB_API_KEY_ENV = "WANDB_API_KEY"


#: The digest an `s3://` model, or a path model with an export manifest, was pinned to when the run started
#: (status.model.revision: `manifest:SHA256`, or `objects:`/`object:` for a store prefix without a manifest): a pod
#: given it refuses (exit 78) a model whose content differs.
MODEL_DIGEST_ENV = "GRPO_MODEL_DIGEST"

#: The learner pod's terminationGracePeriodSeconds, which the learner reads to bound what it still does after a
#: SIGTERM (the checkpoint's upload to checkpoint.uri); Kubernetes' default, 30, without it.
TERMINATION_GRACE_ENV = "GRPO_TERMINATION_GRACE_SECONDS"
DEFAULT_TERMINATION_GRACE_S = 30
