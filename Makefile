# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
JOBS ?= 2

.PHONY: demo test lint install clean system-deps

# Real components for the tests: Graphviz renders drawn graphs (Debian package graphviz).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v dot >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q graphviz; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: nothing else may pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aotkit demo

test: $(STAMP) system-deps
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(PY) -m pytest -q -n $(JOBS) tests
	$(PY) -m pytest -q --doctest-modules src/aotkit

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
