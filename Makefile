# Two commands on a fresh machine:  `make demo` (set up + CPU demo)  and  `make test` (set up + tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and on its own so that no dependency pulls a multi-GB CUDA build.
# On these machines `torch==2.13.0` is a CPU wheel on local disk; elsewhere point TORCH_INDEX at a CPU wheel index.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
RUN ?= runs/demo
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DEBIAN_FRONTEND := noninteractive
export HF_HUB_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: setup venv host harnesses test-deps demo test unit check lint typecheck bench gpu-check clean-demo

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || \
	  $(VENV)/bin/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

# podman + runc + a containers.conf for this host + the offline base image (idempotent).
host: venv
	$(VENV)/bin/legorl setup

setup: venv host

# What the test suite needs beyond `setup`: the five harnesses (cached) and a browser for the dashboard test.
test-deps: setup
	$(VENV)/bin/legorl harness install all
	$(VENV)/bin/legorl vllm install
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }

demo: setup
	$(MAKE) -C examples/cpu-demo demo RUN=$(abspath $(RUN))

test: test-deps
	$(VENV)/bin/nox -s tests

# The inner loop's lane (no containers, harnesses, model loads, CLI subprocesses, long runs or robustness suites): 752 tests, 2 min on 2 idle cores.
unit: venv
	$(VENV)/bin/nox -s unit

check: venv
	$(VENV)/bin/nox -s lint typecheck

lint: venv
	$(VENV)/bin/nox -s lint

typecheck: venv
	$(VENV)/bin/nox -s typecheck

bench: setup
	$(VENV)/bin/nox -s bench

# Issue #28's GPU checks, one table (docs/gpu-check.md). With a GPU (nvidia-smi) it installs its own CUDA venvs
# under .cache/gpu-check/ and needs no `make setup`; without one it runs in $(VENV), installs nothing and skips
# the CUDA rows. GPU_CHECK_ARGS, e.g. `--budget 600 --only vllm,train`.
gpu-check:
	$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON)) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean-demo:
	rm -rf $(RUN)
