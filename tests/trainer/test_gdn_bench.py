"""benchmarks/gpu_gdn.py keeps running: its --cpu-smoke mode (tree == unpacked checked inside)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def test_gpu_gdn_cpu_smoke_runs():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_gdn.py"
    spec = importlib.util.spec_from_file_location("gpu_gdn", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    info = mod.run(argparse.Namespace(cpu_smoke=True, scale=1, iters=1, warmup=0, json=None))
    assert info["levels"] >= 4 and info["short_segments"] > 0
    assert info["tree_vs_unpacked_max_abs_diff"] <= 1e-4
    assert info["unpacked_tokens"] > 3 * info["tree_tokens"]
    assert info["tree"]["fwd_bwd_ms"] > 0 and info["unpacked"]["fwd_bwd_ms"] > 0
