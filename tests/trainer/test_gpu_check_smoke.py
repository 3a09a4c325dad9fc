"""benchmarks/gpu_check.py keeps running: its --cpu-smoke mode, and its refusal without CUDA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_gpu_check", BENCH / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_cpu_smoke_report(tmp_path):
    path = tmp_path / "report.json"
    report = _load().main(["--cpu-smoke", "--json", str(path)])
    assert json.loads(path.read_text())["ok"] is report["ok"] is True
    sections = report["sections"]
    assert set(sections) == {"probe", "kernels", "attention", "windows", "gdn", "sparse", "cp", "megatron"}
    # The CP section needs several GPUs and says so, the Megatron one megatron and a GPU; every
    # other section says ok, none is silent.
    assert sections["cp"]["ok"] is None and "needs more than one GPU" in sections["cp"]["skipped"]
    assert sections["megatron"]["ok"] is None and "megatron" in sections["megatron"]["skipped"]
    rest = {name: s.get("ok") for name, s in sections.items() if name not in ("cp", "megatron")}
    assert rest == dict.fromkeys(rest, True)
    kernels = sections["kernels"]
    for name in ("gdn", "kda", "mamba2", "mamba1", "short_conv_fla", "short_conv_cuda"):
        r = kernels[name]["float32"]
        # scan_tree (levels, forked states) against the segment walk, both token loops
        assert r["ok"] and r["out_rel_err"] < 1e-6 and r["grad_rel_err"] < 1e-6, (name, r)
        assert r["timing"]["tokens_unpacked_over_tree"] > 1.5 and r["timing"]["tree"]["fwd_bwd_ms"] > 0
    assert sections["sparse"]["check"]["topk_equal"]
    # Window / chunk tree attention and the copy-free varlen path, each checked against the
    # sequences alone; the pruned BlockMask never lists fewer blocks than the previous one.
    win = {(r["mask"], r["variant"]): r for r in sections["windows"]["results"]}
    assert {m for m, _ in win} == {"window 32", "chunk 64", "full"}
    assert ("full", "flash tree copy-free") in win and ("window 32", "flash tree gathered") in win
    assert all(r["max_abs_diff"] < 1e-4 for r in win.values())
    for m in ("window 32", "chunk 64"):
        assert win[(m, "flex tree, every tree block")]["blocks"] >= win[(m, "flex tree")]["blocks"] > 0
    assert set(sections["probe"]["kernels"]) == {
        "fla.chunk_gated_delta_rule",
        "fla.chunk_kda",
        "fla.causal_conv1d",
        "mamba_ssm.mamba_chunk_scan_combined",
        "mamba_ssm.selective_scan_fn",
        "causal_conv1d.causal_conv1d_fn",
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the refusal path does not apply")
def test_gpu_check_refuses_without_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        _load().main([])
    assert e.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err
