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
    assert set(res) == {
        "flash unpacked",
        "flex tree (forward only)",
        "flash gather tree",
        "flash copy-free tree",
        "sdpa dense tree",
    }
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


def test_precision_parity_quick():
    from treepack.trainer.hf.admission.tolerance import MULTIPLE

    rows = _load("precision_parity").main(["--quick", "--sequences", "4"])
    assert [(r["precision"], r["mode"]) for r in rows] == [("bf16 autocast", "train"), ("float32", "eval")]
    for r in rows:
        assert r["packed_lp"] <= MULTIPLE and r["packed_grad"] <= MULTIPLE
        # The negative control: a broken mask stays far above what is accepted (22x the bf16
        # floor on these 4 sequences, 51x on the full run's 16).
        assert r["broken_lp"] > 4 * MULTIPLE
    assert rows[0]["compute"] == "bfloat16" and rows[1]["compute"] == "float32"


def test_probe_cost_probe_only_smoke():
    out = _load("probe_cost").main(["--smoke", "--probe-only", "--clock", "cpu"])
    res = {r["setup"]: r for r in out["results"]}
    assert set(res) == {"eval", "train", "train + checkpointing", "train, bf16 autocast"}
    assert all(r["median_ms"] > 0 and not r["refused"] for r in res.values())
