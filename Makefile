# The two commands at the top of the README. Each sets up .venv (Python 3.12) on first use.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test setup
.DEFAULT_GOAL := run

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then py=$$(tools/find-python.sh) || exit 1; echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV) || exit 1; fi
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

# Main job on its embedded default.
run: $(STAMP)
	$(PY) bench/plan_quality.py

# Whole test suite (CPU; GPU tests skip without CUDA).
test: $(STAMP)
	$(PY) -m pytest tests
