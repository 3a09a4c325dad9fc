"""The trainer benchmarks run (tiny modes): their numbers are checked, not their speed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_attention_cpu_smoke():
    out = _load("gpu_attention").main(["--cpu-smoke"])
    res = {r["variant"]: r for r in out["results"]}
    assert set(res) == {"flash unpacked", "flex tree (forward only)", "flash gather tree", "sdpa dense tree"}
    for r in res.values():
        assert r["max_abs_diff"] <= 1e-5
    assert res["sdpa dense tree"]["token_ratio"] < 0.5 and math.isfinite(res["flash gather tree"]["time_ms"])


def test_cpu_train_step_smoke():
    out = _load("cpu_train_step").main(["--smoke"])
    base = out["results"][0]
    assert base["variant"] == "unpacked" and len(out["results"]) == 4
    for r in out["results"][1:]:
        assert abs(r["loss"] - base["loss"]) <= 1e-5 * abs(base["loss"]) and r["max_grad_rel"] <= 1e-4


def test_cost_model_smoke():
    (out,) = _load("cost_model").main(["--smoke"])
    assert out["model"] == "qwen3" and out["fit"]["batches"] == 24
    assert {r["batch"] for r in out["results"]} == {"golden", "medium", "none"}
    assert all(r["measured_ms"] > 0 and math.isfinite(r["error"]) for r in out["results"])
    assert [c["batch"] for c in out["choices"]] == ["golden", "medium", "none"]


def test_overhead_smoke():
    out = _load("overhead").main(["--smoke"])
    res = {r["variant"]: r for r in out["results"]}
    assert set(res) == {"tree/varlen", "tree/sdpa"}
    # Each category is found where it exists and nowhere else (the attribution works).
    assert res["tree/varlen"]["layout_ms"] > 0 and res["tree/sdpa"]["layout_ms"] == 0
    assert res["tree/sdpa"]["metadata_ms"] > 0 and all(r["loss_ms"] > 0 and r["dispatch_ms"] > 0 for r in res.values())
    assert all(0 < r["share"] < 1 for r in res.values())
