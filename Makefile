# treepack — the two newcomer commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

# The tests' torch. `pip install torch==2.13.0` installs whatever the configured indexes
# serve for it: from PyPI on Linux x86-64 that is the CUDA build (several GB with its
# nvidia-* wheels), on macOS and Windows the CPU build; a machine whose pip is set up with
# local wheels (find-links) gets those. The tests need only CPU: pick the CPU build with
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (or a CUDA one, e.g. .../whl/cu128; any torch 2.13.0 already in the venv is kept).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_PIP := $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple,)
# The transformers the tests were checked against: the model-support table (docs/models.md) and
# the family sweep cover every architecture of one release, so a newer release (new families)
# is a change to check and record, not something a fresh install should pick up by itself.
TRANSFORMERS ?= transformers==5.24.0

.PHONY: help demo deps test fuzz lint bench venv clean venv-triton test-triton venv-verl test-verl venv-megatron \
	test-megatron gpu-check dist wheel-check

# `make` alone prints the commands (every target with a `##` description).
.DEFAULT_GOAL := help
help:  ## list these commands (also `make` alone)
	@echo "treepack: make <command> (docs/development.md)"
	@grep -E '^[a-z-]+:.*  ## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*  ## (.*)$$/\1|\2/' | awk -F'|' '{ printf "  %-13s  %s\n", $$1, $$2 }'

$(BIN)/python:
	$(PY) -m venv $(VENV)

venv: $(BIN)/python

# Set up (planner only: numpy, pydantic, msgpack) and run the main job.
demo: venv  ## set up .venv (planner only) and run the embedded planner on realistic batches
	$(PIP) install -e .
	$(BIN)/treepack demo
	@echo
	@echo "The treepack command is in $(BIN)/ (or: source $(BIN)/activate). Next:"
	@echo "  $(BIN)/pip install matplotlib                       # for --png (the plot extra)"
	@echo "  $(BIN)/treepack demo --groups 96 --png rows.png     # draws the rows"
	@echo "  $(BIN)/treepack plan examples/batch.jsonl --seq-len 512"

# Everything the tests and the type checker need (torch 2.13.0: see TORCH above); make test runs
# the tests on it.
# --no-compile: byte-compiling every module of torch and transformers at install costs about
# half a minute of CPU; the tests import a small part of them, compiled on first import.
deps: venv
	$(PIP) install --no-compile $(TORCH_PIP)
	$(PIP) install --no-compile -e ".[service,client,trainer,trl,plot,test]" $(TORCH) $(TRANSFORMERS)

test: deps  ## set up .venv with everything the tests need and run them (TORCH_INDEX=.../whl/cpu: the CPU torch)
	$(BIN)/python -m pytest -q

# The shape fuzz's large profile, nightly-style (tests/planner/test_shape_fuzz.py; `make test`
# runs its fast profile): 300 fresh batch shapes of up to 100,000 sequences and 4M tokens,
# every plan validated. TREEPACK_FUZZ_EXAMPLES=30 make fuzz for a shorter run.
fuzz: deps  ## the planner's shape fuzz at its large profile
	TREEPACK_FUZZ=large $(BIN)/python -m pytest -q -p no:cacheprovider -s tests/planner/test_shape_fuzz.py

# The house's habits: ruff's lint and format check over the tree (pyproject.toml [tool.ruff]).
# mypy reads the source through build/typecheck/treepack/, links laid out as the installed
# package is (pyproject's package-dir), so cross-module imports of treepack.* resolve to our
# own files; the checked scope is TYPECHECK: the contract, the service and the client, and the
# trainer's kernels, data, planning, losses and TRL floors (the HF integration, treepack.trainer.hf,
# is not yet: HF's modules are untyped where its layers are patched).
TYPECHECK ?= treepack.proto treepack.client treepack.service treepack.trainer.kernels treepack.trainer.data \
	treepack.trainer.planning treepack.trainer.losses treepack.trainer.trl
TYPECHECK_MODULES ?= treepack.trainer.distributed treepack.trainer.cost \
	treepack.trainer.megatron.vocab_parallel treepack.trainer.megatron.context
# The type checker reads torch, transformers and TRL for their types: the tests' packages first.
lint: deps  ## ruff check, ruff format --check and mypy
	$(PIP) install --no-compile ruff==0.17.6 mypy==2.4.1
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/treepack && touch build/typecheck/treepack/__init__.py
	for d in proto service client; do ln -s ../../../$$d build/typecheck/treepack/$$d; done
	ln -s ../../../trainer_plugin build/typecheck/treepack/trainer
	MYPYPATH=build/typecheck $(BIN)/mypy $(addprefix -p ,$(TYPECHECK)) $(addprefix -m ,$(TYPECHECK_MODULES))

# A second env for the Triton kernels run on CPU by the interpreter (tests/triton_interp).
# Never in .venv: transformers picks flash-linear-attention whenever it imports, and its
# kernels fail on CPU there. torch as above, and checked to be a CPU build; mamba_ssm and causal-conv1d
# without their CUDA builds (their setup.py would otherwise ask nvcc or download a
# CUDA wheel): what they bring here is their Python + Triton code.
TVENV ?= .venv-triton
TBIN := $(TVENV)/bin
TPIP := $(TBIN)/python -m pip -q --disable-pip-version-check
TRITON_PKGS := triton==3.8.0 fla-core==0.6.0 flash-linear-attention==0.6.0 einops

$(TBIN)/python:
	$(PY) -m venv $(TVENV)

# Built once: the stamp $(TVENV)/.built marks a finished install (redone when the Makefile or
# pyproject.toml is newer), so .ci/run builds this env in the background while `make test`
# runs and `make test-triton` then only runs the tests. --no-compile: Python compiles what
# the tests import on first import instead of every module of every package at install.
venv-triton: $(TVENV)/.built
$(TVENV)/.built: Makefile pyproject.toml | $(TBIN)/python
	$(TPIP) install --no-compile $(TORCH_PIP)
	$(TPIP) install --no-compile $(TRITON_PKGS) wheel packaging ninja
	$(TPIP) install --no-compile -e ".[trainer,test]"
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
		$(TPIP) install --no-compile --no-build-isolation --no-deps causal-conv1d==1.7.0 mamba-ssm==2.3.2.post1
	$(TBIN)/python -c "import torch, sys; sys.exit('.venv-triton must hold the CPU torch, got ' + torch.__version__) if torch.version.cuda else None"
	touch $@

# The project's GPU wrappers on the Triton kernels, run on CPU by the interpreter.
test-triton: venv-triton  ## the GPU wrappers under Triton's interpreter, on CPU (.venv-triton)
	TRITON_INTERPRET=1 $(TBIN)/python -m pytest -q -p no:cacheprovider tests/triton_interp

# A third env for the verl engine (treepack.trainer.verl), its parity tests against stock
# verl on CPU (tests/verl_engine). verl pinned to the release the engine was checked against; no
# TRL extra (verl's own `fsdp` extra pins a TRL that conflicts with treepack's) and no verl
# extras: only uvicorn and fastapi, which verl's worker module (TrainingWorker, driven
# in-process by the tests, no Ray) imports. No flash-linear-attention, mamba or
# causal-conv1d kernels: stock verl runs the hybrid models on transformers' torch paths.
# Measured: about 1.9 GB, 13.5 min on a 2-core machine under load (load average 12).
# Built once, as venv-triton (a stamp, --no-compile).
# Never in .venv: the main run does not collect tests/verl_engine; here (CI=1) a missing verl fails.
VVENV ?= .venv-verl
VBIN := $(VVENV)/bin
VPIP := $(VBIN)/python -m pip -q --disable-pip-version-check
VERL_PKGS := verl==0.9.1 uvicorn fastapi

$(VBIN)/python:
	$(PY) -m venv $(VVENV)

venv-verl: $(VVENV)/.built
$(VVENV)/.built: Makefile pyproject.toml | $(VBIN)/python
	$(VPIP) install --no-compile $(TORCH_PIP)
	$(VPIP) install --no-compile $(VERL_PKGS) $(TORCH)
	$(VPIP) install --no-compile -e ".[trainer,test]" $(TORCH)
	touch $@

test-verl: venv-verl  ## the verl engine against stock verl, on CPU (.venv-verl)
	CI=1 $(VBIN)/python -m pytest -q -p no:cacheprovider tests/verl_engine

# A fourth env for the Megatron-Core backend (treepack.trainer.megatron), its tests on CPU over
# gloo (tests/megatron). Pinned to the releases it was checked against: megatron-core 0.19.2
# and megatron-bridge 0.6.2 (Bridge 0.6.2 needs megatron-core >= 0.17, which declares Python
# >= 3.12). On Python 3.11 megatron-core's wheel (tagged cp312 for one optional compiled
# dataset helper the backend never imports) is fetched for 3.12 and unpacked into the venv;
# Bridge is installed without its dependencies (it pins transformers <= 5.12.1 and brings
# training, logging and vision stacks the backend does not use), plus the few modules it
# imports. The CPU stand-ins the tests need live in tests/megatron (docs/megatron.md).
# Built once, as venv-verl (a stamp, --no-compile).
# Never in .venv: the main run does not collect tests/megatron; here (CI=1) a missing megatron fails.
MVENV ?= .venv-megatron
MBIN := $(MVENV)/bin
MPIP := $(MBIN)/python -m pip -q --disable-pip-version-check
MEGATRON_CORE := megatron-core==0.19.2
MEGATRON_BRIDGE := megatron-bridge==0.6.2
MEGATRON_PKGS := transformers==5.12.1 omegaconf einops

$(MBIN)/python:
	$(PY) -m venv $(MVENV)

venv-megatron: $(MVENV)/.built
$(MVENV)/.built: Makefile pyproject.toml | $(MBIN)/python
	$(MPIP) install --no-compile $(TORCH_PIP)
	$(MPIP) install --no-compile -e ".[trainer,test]" $(TORCH) $(MEGATRON_PKGS)
	if $(MBIN)/python -c "import sys; sys.exit(sys.version_info < (3, 12))"; then \
		$(MPIP) install --no-compile --no-deps $(MEGATRON_CORE); \
	else \
		$(MPIP) install --no-compile --no-deps --ignore-requires-python --upgrade --python-version 3.12 \
			--only-binary=:all: --target "$$($(MBIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
			$(MEGATRON_CORE); \
	fi
	$(MPIP) install --no-compile --no-deps --ignore-requires-python --force-reinstall $(MEGATRON_BRIDGE)
	$(MBIN)/python -c "import torch, sys; sys.exit('.venv-megatron must hold the CPU torch, got ' + torch.__version__) if torch.version.cuda else None"
	touch $@

test-megatron: venv-megatron  ## the Megatron-Core backend on CPU over gloo (.venv-megatron)
	CI=1 $(MBIN)/python -m pytest -q -p no:cacheprovider tests/megatron

# Every GPU test and benchmark of the trainer on one CUDA device, one JSON report
# (REPORT=path; default $$OUT/gpu_check.json where $$OUT is set, else gpu_check.json).
# GPU_PY: an interpreter whose torch has CUDA and which has treepack installed (docs/gpu.md);
# default: $(BIN)/python when that exists, else python3. It is checked before anything runs.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:  ## on a CUDA machine: every GPU kernel checked and timed, one JSON report
	@$(GPU_PY) -c "import torch, treepack.trainer" 2>/dev/null || { echo "make gpu-check: $(GPU_PY) cannot import torch and treepack.trainer: set GPU_PY to the python of a CUDA environment with treepack installed (docs/gpu.md)" >&2; exit 2; }
	$(GPU_PY) benchmarks/gpu_check.py $(if $(REPORT),--json $(REPORT),)

# The distributions (sdist and wheel, in dist/), as `pip install .` would build them.
dist: venv  ## build the sdist and wheel into dist/
	$(PIP) install build
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# The wheel in a fresh venv of its own, with the trainer extra and torch as above: the demo
# and a plan run from the wheel's own files and the trainer imports (what `pip install ".[trainer]"` gives a training environment).
WVENV ?= .venv-wheel
wheel-check: dist  ## install the wheel with the trainer extra in a fresh venv and run it
	rm -rf $(WVENV) && $(PY) -m venv $(WVENV)
	$(WVENV)/bin/python -m pip -q --disable-pip-version-check install --no-compile $(TORCH_PIP)
	$(WVENV)/bin/python -m pip -q --disable-pip-version-check install --no-compile "$$(ls dist/treepack-*.whl)[trainer]" $(TORCH)
	cd $(WVENV) && bin/treepack demo --groups 96
	cd $(WVENV) && bin/treepack plan $(CURDIR)/examples/batch.jsonl --seq-len 512 --json | grep -q '"rows": 2'
	cd $(WVENV) && bin/python -c "import sys, treepack.service; f = treepack.service.__file__; sys.exit(None if f.startswith(sys.prefix) else 'treepack imports from ' + f + ', not the wheel')"
	cd $(WVENV) && bin/python -c "import treepack.trainer, torch; print('treepack.trainer imports with torch', torch.__version__)"

bench: venv  ## the planner's benchmark (treepack bench)
	$(PIP) install -e .
	$(BIN)/treepack bench

clean:  ## remove the venvs and build outputs
	rm -rf $(VENV) $(TVENV) $(VVENV) $(MVENV) $(WVENV) build dist *.egg-info .pytest_cache .hypothesis
