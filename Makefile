# Distributed LLM training course. `make help` lists the verbs; each one bootstraps .venv itself.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_FLAGS := --progress-bar off --disable-pip-version-check

.DEFAULT_GOAL := help
.PHONY: help venv test book lab release autograde bench gpu-check lint clean

help: ## List the make targets
	@echo "Distributed LLM training course: make <target>"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -q -r requirements.txt 2>&1 | { grep -v '^WARNING: Location' || true; }
	$(PY) -m pip install $(PIP_FLAGS) -q --no-deps -e . 2>&1 | { grep -v '^WARNING: Location' || true; }
	@# matplotlib's font cache of its own: one written by another Python (same version key, other fonts) makes
	@# every plot log "findfont: ... not found" to stderr under the figure
	$(PY) scripts/venv_matplotlib.py
	$(PY) -c "import torch, nbgrader, course_lib; print('environment ready: torch', torch.__version__)"
	@touch $@

venv: $(STAMP) ## Create .venv with the pinned dependencies and course_lib (editable)

test: $(STAMP) ## Run every test (unit, distributed, notebooks, grading)
	$(PY) -m pytest

book: $(STAMP) ## Execute the notebooks and build the HTML book into _build/html
	$(PY) scripts/build_book.py

lab: $(STAMP) ## Open your workspace (a copy of notebooks/ that release never touches) in JupyterLab
	$(PY) scripts/workspace.py
	$(VENV)/bin/jupyter lab --ServerApp.allow_root=True --notebook-dir=workspace

release: $(STAMP) ## Regenerate notebooks/ (student versions) from solutions/ with nbgrader
	$(PY) scripts/grading.py release

autograde: $(STAMP) ## Grade submitted/<student>/<assignment>/*.ipynb with nbgrader
	$(PY) scripts/grading.py autograde

bench: $(STAMP) ## Print the performance figures: matmul ceiling, training tokens/s, attention, all-reduce GB/s, DDP scaling, sharding memory, DP/TP/PP step time and bytes
	$(PY) scripts/bench.py

gpu-check: $(STAMP) ## On a CUDA node: node check, every notebook on cuda, training CLI, gpu tests, GPT-2 MFU (says so and exits 0 without CUDA)
	$(PY) scripts/gpu_check.py

lint: $(STAMP) ## Check that every notebook is valid and carries correct nbgrader metadata
	$(PY) -m pytest -q tests/course/test_notebook_metadata.py

clean: ## Remove build outputs, logs and runs (keeps .venv)
	rm -rf _build logs runs data autograded feedback submitted gradebook.db .pytest_cache
