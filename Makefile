# treepack — the two newcomer commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test bench venv clean venv-triton test-triton venv-verl test-verl gpu-check

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

# A second env for the Triton kernels run on CPU by the interpreter (tests/triton_interp).
# Never in .venv: transformers picks flash-linear-attention whenever it imports, and its
# kernels fail on CPU there. CPU torch pinned as above; mamba_ssm and causal-conv1d
# without their CUDA builds (their setup.py would otherwise ask nvcc or download a
# CUDA wheel): what they bring here is their Python + Triton code.
TVENV ?= .venv-triton
TBIN := $(TVENV)/bin
TPIP := $(TBIN)/python -m pip -q --disable-pip-version-check
TRITON_PKGS := triton==3.8.0 fla-core==0.6.0 flash-linear-attention==0.6.0 einops

$(TBIN)/python:
	$(PY) -m venv $(TVENV)

venv-triton: $(TBIN)/python
	$(TPIP) install torch==2.13.0
	$(TPIP) install $(TRITON_PKGS) wheel packaging ninja
	$(TPIP) install -e ".[trainer,test]"
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
		$(TPIP) install --no-build-isolation --no-deps causal-conv1d==1.7.0 mamba-ssm==2.3.2.post1
	$(TBIN)/python -c "import torch, sys; sys.exit('.venv-triton must hold the CPU torch, got ' + torch.__version__) if torch.version.cuda else None"

# The project's GPU wrappers on the Triton kernels, run on CPU by the interpreter.
test-triton: venv-triton
	TRITON_INTERPRET=1 $(TBIN)/python -m pytest -q -p no:cacheprovider tests/triton_interp

# A third env for the verl engine (treepack.trainer.verl), its parity tests against stock
# verl on CPU (tests/verl). verl pinned to the release the engine was checked against; no
# TRL extra (verl's own `fsdp` extra pins a TRL that conflicts with treepack's) and no
# extras at all: the tests drive the engine, not the Ray workers (whose module would also
# want uvicorn and fastapi). Measured: about 1.9 GB, 13 min on a loaded 2-core machine.
# Never in .venv: the main run does not collect tests/verl; here (CI=1) a missing verl fails.
VVENV ?= .venv-verl
VBIN := $(VVENV)/bin
VPIP := $(VBIN)/python -m pip -q --disable-pip-version-check
VERL_PKGS := verl==0.9.1

$(VBIN)/python:
	$(PY) -m venv $(VVENV)

venv-verl: $(VBIN)/python
	$(VPIP) install torch==2.13.0
	$(VPIP) install $(VERL_PKGS) torch==2.13.0
	$(VPIP) install -e ".[trainer,test]" torch==2.13.0

test-verl: venv-verl
	CI=1 $(VBIN)/python -m pytest -q -p no:cacheprovider tests/verl

# Every GPU test and benchmark of the trainer on one CUDA device, one JSON report
# (REPORT=path; default $$OUT/gpu_check.json where $$OUT is set, else gpu_check.json).
gpu-check:
	$(PY) benchmarks/gpu_check.py $(if $(REPORT),--json $(REPORT),)

bench: venv
	$(PIP) install -e .
	$(BIN)/treepack bench

clean:
	rm -rf $(VENV) $(TVENV) $(VVENV) build *.egg-info .pytest_cache .hypothesis
