# Distributed LLM training course. `make help` lists the verbs; each one bootstraps .venv itself.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_FLAGS := --progress-bar off --disable-pip-version-check

# The Python that creates .venv: PYTHON if you set it (make venv PYTHON=/path/to/python3.12), otherwise the first
# of these that is 3.10 or newer. Each candidate is asked for its version; none found stops make with one line.
PYTHON ?=
PYTHON_CANDIDATES := $(or $(PYTHON),python3.13 python3.12 python3.11 python3.10 python3)
find_python = for p in $(PYTHON_CANDIDATES); do \
    IFS=. read -r major minor _ <<< "$$("$$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; \
    if [[ $$major =~ ^[0-9]+$$ && $$minor =~ ^[0-9]+$$ ]] && (( major > 3 || (major == 3 && minor >= 10) )); then \
        echo "$$p"; break; fi; done
NO_PYTHON = no Python 3.10 or newer found (tried: $(PYTHON_CANDIDATES)). Install Python 3.12: the installer from https://www.python.org/downloads/, or `brew install python@3.12`, or `uv python install 3.12`; then make again (PYTHON=/path/to/python3.12 if it is not on PATH)
base_python = $(or $(shell $(find_python)),$(error $(NO_PYTHON)))

# Optional extras on top of requirements.txt: `make venv EXTRAS=deepspeed` installs requirements-deepspeed.txt.
EXTRAS ?=
EXTRA_STAMPS := $(foreach extra,$(EXTRAS),$(VENV)/.installed-$(extra))
# Offline: `make venv WHEELHOUSE=<folder>` installs from a folder that `make wheelhouse` filled, and from nothing else.
WHEELHOUSE ?=
INSTALL_FROM := $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE)))
QUIET_PIP := 2>&1 | { grep -v '^WARNING: Location' || true; }

.DEFAULT_GOAL := help
.PHONY: help venv test book slides lab release autograde bench gpu-check doctor wheelhouse lint clean

help: ## List the make targets
	@echo "Distributed LLM training course: make <target>"
	@awk -F ':.*## ' '/^[a-z-]+:.*## /{printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): requirements.txt pyproject.toml
	$(if $(wildcard $(PY)),@:,$(base_python) -m venv $(VENV))
	set -o pipefail; $(PY) -m pip install $(PIP_FLAGS) $(INSTALL_FROM) -q -r requirements.txt $(QUIET_PIP)
	set -o pipefail; $(PY) -m pip install $(PIP_FLAGS) $(INSTALL_FROM) -q --no-deps -e . $(QUIET_PIP)
	@# matplotlib's font cache of its own: one written by another Python (same version key, other fonts) makes
	@# every plot log "findfont: ... not found" to stderr under the figure
	$(PY) scripts/venv_matplotlib.py
	$(PY) -c "import torch, nbgrader, course_lib; print('environment ready: torch', torch.__version__)"
	@touch $@

# An extra, installed against requirements.txt's pins (-c) so that it cannot move them.
$(VENV)/.installed-%: requirements-%.txt $(STAMP)
	set -o pipefail; $(PY) -m pip install $(PIP_FLAGS) $(INSTALL_FROM) -q -r $< -c requirements.txt $(QUIET_PIP)
	@touch $@

venv: $(STAMP) $(EXTRA_STAMPS) ## Create .venv with the pinned dependencies and course_lib (editable); EXTRAS=deepspeed adds DeepSpeed

TEST_WORKERS ?= 2
test: $(STAMP) ## Run every test (unit, distributed, notebooks, grading) on TEST_WORKERS processes (default 2)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

book: $(STAMP) ## Execute the notebooks and build the HTML book, session slides included, into _build/html
	$(PY) scripts/build_book.py

slides: $(STAMP) ## Build the slide deck of every session (reveal.js, offline) into _build/html/slides
	$(PY) scripts/build_slides.py

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

# No $(STAMP): the doctor also runs before anything is installed, with the Python that would create .venv
# (or python3, so that it can say why that one is too old).
doctor: ## Print this machine's platform, Python, torch, devices and the course's choices, with what is wrong
	@$(or $(wildcard $(PY)),$(shell $(find_python)),python3) scripts/doctor.py

# ------------------------------------------------------------------------------------------- offline installs
# `make wheelhouse WHEELHOUSE=<folder>` on a machine with network puts every pinned wheel into the folder: torch
# from TORCH_INDEX_URL (its CUDA build; empty: pip's own indexes), requirements.txt, each extra of EXTRAS, and
# setuptools (pip needs it to install course_lib offline). PLATFORM and PYTHON_VERSION describe the machine that
# will install them (default: this one), e.g. an x86_64 cluster node, from a Mac:
#   make wheelhouse WHEELHOUSE=wheels PLATFORM=manylinux_2_28_x86_64 PYTHON_VERSION=3.11 EXTRAS=deepspeed
# Carry the folder over, then `make venv WHEELHOUSE=wheels` there. REQUIREMENTS=<file> replaces requirements.txt.
REQUIREMENTS ?= requirements.txt
PLATFORM ?=
PYTHON_VERSION ?=
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cu128
BUILD_REQUIREMENTS ?= setuptools>=64
TORCH_PIN = $(shell sed -n 's/^torch==\([0-9A-Za-z.+!]*\).*/\1/p' $(REQUIREMENTS))
WHEEL_PIP = $(or $(wildcard $(PY)),$(base_python)) -m pip
# pip download --platform accepts exactly the tags it is given, and most Linux wheels are built for an older glibc
# than the target's: manylinux_2_28_x86_64 stands for itself and every older manylinux tag of x86_64.
platform_flags = $(shell for p in $(PLATFORM); do case $$p in \
    (manylinux_2_*) glibc=$$(echo "$$p" | cut -d_ -f3); arch=$$(echo "$$p" | cut -d_ -f4-); \
        for k in $$(seq "$$glibc" -1 5); do printf -- '--platform manylinux_2_%s_%s ' "$$k" "$$arch"; done; \
        printf -- '--platform manylinux2014_%s --platform manylinux2010_%s --platform manylinux1_%s ' \
            "$$arch" "$$arch" "$$arch";; \
    (*) printf -- '--platform %s ' "$$p";; esac; done)
DOWNLOAD = $(WHEEL_PIP) download $(PIP_FLAGS) --only-binary=:all: --dest $(WHEELHOUSE) $(platform_flags) \
    $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION))
DOWNLOAD_TORCH = $(DOWNLOAD) "torch==$(TORCH_PIN)" \
    $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL) --extra-index-url https://pypi.org/simple)
BUILD_EXTRAS = $(foreach extra,$(EXTRAS),$(WHEEL_PIP) wheel $(PIP_FLAGS) --no-deps --wheel-dir $(WHEELHOUSE) \
    -r requirements-$(extra).txt &&) true

wheelhouse: ## Download every pinned wheel into WHEELHOUSE=<folder>, for `make venv WHEELHOUSE=<folder>` offline
	$(if $(WHEELHOUSE),,$(error say where the wheels go: make wheelhouse WHEELHOUSE=<folder>))
	@mkdir -p $(WHEELHOUSE)
	$(if $(TORCH_PIN),$(DOWNLOAD_TORCH),@echo "$(REQUIREMENTS) pins no torch")
	@# DeepSpeed is published as source only: pip builds it here into a pure-Python wheel (its kernels compile on
	@# the GPU node when first used), which any platform can install
	$(if $(EXTRAS),$(BUILD_EXTRAS),@:)
	$(DOWNLOAD) --find-links $(abspath $(WHEELHOUSE)) -r $(REQUIREMENTS) \
	    $(foreach extra,$(EXTRAS),-r requirements-$(extra).txt) $(if $(BUILD_REQUIREMENTS),"$(BUILD_REQUIREMENTS)")
	@echo "wheelhouse $(WHEELHOUSE): $$(ls $(WHEELHOUSE) | wc -l | tr -d ' ') files, $$(du -sh $(WHEELHOUSE) | cut -f1)." \
	      "Offline: make venv WHEELHOUSE=$(WHEELHOUSE)$(if $(EXTRAS), EXTRAS=\"$(EXTRAS)\")"

lint: $(STAMP) ## Check that every notebook is valid and carries correct nbgrader metadata
	$(PY) -m pytest -q tests/course/test_notebook_metadata.py

clean: ## Remove build outputs, logs and runs (keeps .venv)
	rm -rf _build logs runs data autograded feedback submitted gradebook.db .pytest_cache
