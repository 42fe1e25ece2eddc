# syntax=docker/dockerfile:1
# The operator image: `grporun operator` (kopf) and the torch-free half of the project, nothing else.
# Build from the repository root: docker build -t grpo-operator:dev .
# The base is pinned by tag (the Python the project is developed and tested on); pin a digest too where your registry
# policy requires it: --build-arg PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml ./
COPY operator/grpo_operator/ operator/grpo_operator/
COPY trainer_image/grpo_trainer/ trainer_image/grpo_trainer/
# Only the project's base dependencies: no `learner` extra, so no torch, transformers, trl or vllm.
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# HF_HUB_DISABLE_TELEMETRY: the fit check fetches a hub model's config.json, and nothing else goes to the hub.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    GRPO_CRD_PATH=/opt/grpo/crds/grporun.yaml
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --disable-pip-version-check /wheels/*.whl \
 && groupadd --gid 10001 grpo \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin grpo
# `grporun validate` and the operator check runs against the CRD's own schema and CEL rules.
COPY crds/grporun.yaml /opt/grpo/crds/grporun.yaml
# Numeric, so Kubernetes' runAsNonRoot can verify it (the chart runs as 10001 too).
USER 10001:10001
ENTRYPOINT ["grporun"]
CMD ["operator", "--all-namespaces"]
