#!/usr/bin/env bash
# The GPU check on an offline GPU machine (no package index), in one call: install the wheels that
# benchmarks/gpu_wheels.sh put in .whl/ (carry it), then run benchmarks/gpu_check.py
# with its report in $OUT (the folder that comes back). See BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L || true
timeout 540 python3 benchmarks/gpu_check.py --json "${OUT:-.}/gpu_check.json" "$@"
