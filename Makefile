# The whole set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
TINY_MODEL := .models/tiny-llama
PORT ?= 8000
PYTEST_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv serve serve-mono test test-fast lint tiny-model clean

-include mk/cluster.mk

# Debian packages the worker links at run time: Mooncake's wheel needs libibverbs but does not ship it.
SYSTEM_PACKAGES := libibverbs1

$(STAMP): pyproject.toml
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[worker,mooncake-cpu,operator,test]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

$(TINY_MODEL)/config.json: $(STAMP) worker/disagg_worker/model/tiny.py
	$(VENV)/bin/disagg model make-tiny --out $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/config.json

# Router + prefill + decode on localhost, on the embedded tiny model (its output is gibberish by design).
serve: tiny-model
	$(VENV)/bin/disagg serve --local --model $(TINY_MODEL) --port $(PORT)

# One monolithic engine instance on the tiny model.
serve-mono: tiny-model
	$(VENV)/bin/disagg serve --model $(TINY_MODEL) --port $(PORT)

# ruff (lint and format check) and mypy, configured in pyproject.toml.
lint: venv
	$(VENV)/bin/ruff check worker operator tests bench
	$(VENV)/bin/ruff format --check worker operator tests bench
	$(VENV)/bin/mypy

# Lint first: a tree that does not pass it is not tested.
test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS) tests

test-fast: venv
	$(VENV)/bin/pytest $(PYTEST_ARGS) tests/unit

clean:
	rm -rf $(VENV) .models .pytest_cache .hypothesis
