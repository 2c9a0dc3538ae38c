# The two commands at the top of the README. Each sets up .venv (Python 3.12) on first use.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test setup plan-quality
.DEFAULT_GOAL := run

# --no-cache-dir: torch's CUDA wheels are ~3.5 GB; caching them would need that much disk again.
$(STAMP): pyproject.toml
	@if [ -x $(PY) ] && ! $(PY) -m pip --version >/dev/null 2>&1; then echo "$(VENV) has no pip (made without ensurepip): making it anew"; rm -rf $(VENV); fi
	@if [ ! -x $(PY) ]; then py=$$(tools/find-python.sh) || exit 1; echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV) || { echo "error: $$py -m venv failed (Debian: apt install python3.12-venv)"; rm -rf $(VENV); exit 1; }; fi
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check --no-cache-dir -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

# Main job on its embedded default: the CPU quickstart (4 gloo processes as 2 virtual NVLink domains,
# tiny MoE model, offline corpus, W&B offline). GPUs: launch/single_node.sh model=qwen3 trainer=default.
run: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 train.py model=tiny trainer=cpu eplb=topoep

# The plan-quality benchmark (paper Fig. 10 / 16): results/plan_quality.{md,json,png}.
plan-quality: $(STAMP)
	$(PY) bench/plan_quality.py

# Whole test suite (CPU; GPU tests skip without CUDA).
test: $(STAMP)
	$(PY) -m pytest tests
