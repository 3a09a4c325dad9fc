"""The Mamba2-hybrid CPU benchmark runs (smoke size) and checks its own oracle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_cpu_mixers_smoke():
    spec = importlib.util.spec_from_file_location("_bench_cpu_mixers", BENCH / "cpu_mixers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--smoke"])
    base, tree = out["results"]
    assert tree["token_ratio"] < 0.6 and out["levels"] >= 3
    assert abs(tree["loss"] - base["loss"]) <= 1e-5 * abs(base["loss"])
    assert tree["max_grad_rel"] <= 1e-4
