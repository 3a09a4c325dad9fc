#!/usr/bin/env bash
# Wheels the GPU check needs on a GPU machine that cannot reach a package index
# (its image has CUDA torch, triton, transformers, numpy, msgpack; not these). Run here,
# in the repository root; it fills .whl/ (ignored by git) for Python 3.12 on x86-64:
#   treepack itself, pydantic (+ its needs), fla-core + flash-linear-attention 0.6.0,
#   and mamba_ssm's Python + Triton code (built here without its CUDA extensions:
#   mamba_chunk_scan_combined runs, selective_scan_fn does not).
# flash-attn and causal-conv1d have no prebuilt wheels for that torch and take longer to
# compile than a device lease lasts: the check reports those kernels as unavailable.
# Then, on the device (one command, see BENCHMARKS.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
#   PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    fla-core==0.6.0 flash-linear-attention==0.6.0
$PY -m pip wheel -q --no-deps -w .whl .
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl mamba-ssm==2.3.2.post1
ls -la .whl
