# treepack — the two newcomer commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test bench venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

venv: $(BIN)/python

# Set up (planner only: numpy, pydantic, msgpack) and run the main job.
demo: venv
	$(PIP) install -e .
	$(BIN)/treepack demo

# Set up everything the tests need (CPU torch pinned: never a multi-GB CUDA build) and run them.
test: venv
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[service,client,trainer,trl,plot,test]" torch==2.13.0
	$(BIN)/python -m pytest -q

bench: venv
	$(PIP) install -e .
	$(BIN)/treepack bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
