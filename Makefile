# The README's two commands: `make demo` (set up, then run the main job on a small CPU
# default) and `make test` (set up, then run the test suite). Both are idempotent: the
# set-up steps are file targets, so a second run skips what is done.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OUT    ?= out

.PHONY: demo llama test test-all test-fast lint setup bench clean

setup: $(STAMP) dot

# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. pyproject's torch range admits 2.13.0, so the
# package install afterwards adds nothing to it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $(STAMP)

# graphviz's `dot` renders the schedule graph; Debian's package provides it.
.PHONY: dot
dot:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq graphviz >/dev/null; \
	  else echo "graphviz's 'dot' is missing: run 'sudo apt-get install -y graphviz'" >&2; exit 1; fi; }

demo: setup
	OUT=$(OUT) PY=$(PY) bash examples/demo.sh

# the Llama-style family and a transformers config, profiled, planned and trained on 2 CPU ranks
llama: setup
	OUT=$(OUT)/llama PY=$(PY) bash examples/llama.sh

# ruff first: a lint finding fails the suite before the slow tests start. CI's tier checks
# every property once; the cases marked `full` (more families, optimizers and variants of a
# property checked here, most fuzz cases, the benchmarks' smokes) are left to `make test-all`, which runs
# the whole suite (twice as long: run it before a change to the runtime or the planner lands).
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not full" tests

test-all: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# everyday work: the in-process tests only (no torchrun, no CLI subprocess: those are
# marked e2e, and tests/conftest.py refuses a process started by an unmarked test)
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not e2e" tests

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) benchmarks/planner.py
	$(PY) benchmarks/runtime.py

clean:
	rm -rf $(VENV) $(OUT) *.egg-info
