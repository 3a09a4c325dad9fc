"""GDN layer benchmark: tree-packed rows vs every sequence unpacked, forward + backward.

Usage:
    python benchmarks/gpu_gdn.py                 # CUDA, bf16, flash-linear-attention kernels
    python benchmarks/gpu_gdn.py --cpu-smoke     # tiny, fp32, the pure-torch reference (CPU)
    python benchmarks/gpu_gdn.py --json out.json --scale 2 --iters 10

The workload is a tree-search rollout batch (documented in :func:`rollout_tree`): one
system prompt, several task prompts under it, branching turns three levels deep and many
short leaves; no length is a multiple of 64 by construction (lengths are drawn, then bumped
off multiples of 64). It is planned twice:

- **tree**: ``plan_batch`` (``min_shared_len`` 64) -> rows holding each shared run once;
  one GDN layer runs per depth level (``tree_gated_delta_rule``: one varlen kernel call per
  level, states forked from parents);
- **unpacked**: ``placement="no_share"`` -> every sequence whole, depth 0 only, i.e. one
  varlen kernel call over all sequences (the baseline a packer without trees runs).

Both sides use the same code path (gather conv + per-level delta rule) with Qwen3-Next-80B
layer shapes (16 q/k heads, 32 v heads, head dim 128, conv width 4). Each timed step is
conv -> delta rule -> a loss, then ``backward()`` to the layer inputs and the conv weight.
Times are CUDA events, median of ``--iters`` after ``--warmup``; peak memory from
``torch.cuda.max_memory_allocated``. Before timing, the tree output of every sequence is
checked against its unpacked output (bf16 tolerance), and the fla kernel against the
torch reference on a small varlen input with forked initial states.

On an offline GPU machine without fla (bring its wheels: benchmarks/gpu_wheels.sh):
``pip install --no-deps --no-build-isolation -e . && python benchmarks/gpu_gdn.py --json $OUT/gdn.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from treepack.service.planner import plan_batch
from treepack.trainer.kernels.gdn import select_kernel, tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.kernels.gdn_ref import torch_chunk_gated_delta_rule
from treepack.trainer.kernels.tree_scan import tree_schedule

SHAPES = {
    "gpu": dict(Hk=16, Hv=32, K=128, V=128, W=4),
    "cpu": dict(Hk=2, Hv=4, K=16, V=16, W=4),
}


def _len(rng: np.random.Generator, lo: int, hi: int) -> int:
    n = int(rng.integers(lo, hi))
    return n + 1 if n % 64 == 0 else n


def rollout_tree(
    seed: int,
    *,
    tasks: int,
    system: int,
    prompt: tuple[int, int],
    fan: tuple[int, ...],
    turn: tuple[int, int],
    leaf: tuple[int, int],
) -> list[np.ndarray]:
    """Tree-search rollouts: system -> task prompt -> ``len(fan)`` levels of branching turns.

    Level i of a task branches ``fan[i]`` ways with turns of ``turn`` tokens (the last level's
    are leaves of ``leaf`` tokens). Every root-to-leaf path is a sequence.
    """
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(0, 150_000, n, dtype=np.int64).astype(np.uint32)  # noqa: E731
    sys_prompt = tok(_len(rng, system, system + 64))
    seqs: list[np.ndarray] = []

    def grow(prefix: np.ndarray, depth: int) -> None:
        if depth == len(fan):
            seqs.append(prefix)
            return
        for _ in range(fan[depth]):
            lo, hi = leaf if depth == len(fan) - 1 else turn
            grow(np.concatenate([prefix, tok(_len(rng, lo, hi))]), depth + 1)

    for _ in range(tasks):
        grow(np.concatenate([sys_prompt, tok(_len(rng, *prompt))]), 0)
    return seqs


def _inputs(n: int, s: dict, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    conv_dim = 2 * s["Hk"] * s["K"] + s["Hv"] * s["V"]
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = mk(n, conv_dim)
    a = mk(n, s["Hv"])
    b = mk(n, s["Hv"])
    w = (torch.randn(conv_dim, s["W"], generator=g) * 0.5).to(device=device, dtype=dtype)
    return x, a, b, w


def _layer(x, a, b, w, sched, s, kernel):
    """Conv over the tree, split into q/k/v, gates as Qwen3-Next, the tree delta rule."""
    n = x.shape[0]
    y = tree_causal_conv1d(x, w, None, sched, "silu").to(x.dtype)
    kd = s["Hk"] * s["K"]
    q, k, v = torch.split(y, [kd, kd, s["Hv"] * s["V"]], dim=-1)
    g = -0.1 * F.softplus(a.float())  # long memory: the state matters far down the chain
    beta = b.sigmoid()
    return tree_gated_delta_rule(
        q.reshape(n, s["Hk"], s["K"]),
        k.reshape(n, s["Hk"], s["K"]),
        v.reshape(n, s["Hv"], s["V"]),
        g,
        beta,
        sched,
        use_qk_l2norm_in_kernel=True,
        kernel=kernel,
    )


def _pick(plan, flat_x: torch.Tensor) -> list[torch.Tensor]:
    ptr, flat = plan.token_index()
    idx = torch.from_numpy(flat).to(flat_x.device)
    return [flat_x[idx[ptr[i] : ptr[i + 1]]] for i in range(plan.num_sequences)]


def _gather_rows(src_plan, dst_plan, x: torch.Tensor) -> torch.Tensor:
    """Lay per-token inputs of ``src_plan``'s rows out in ``dst_plan``'s rows (same sequences).

    Shared tokens take the value of their source sequence's copy; tokens of one sequence
    are identical wherever they sit, so both sides see the same inputs.
    """
    sp, sf = src_plan.token_index()
    dp, df = dst_plan.token_index()
    out = torch.zeros(dst_plan.num_rows * dst_plan.seq_len, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[torch.from_numpy(df).to(x.device)] = x[torch.from_numpy(sf).to(x.device)]
    return out


def _check_kernel(kernel, device: str, dtype: torch.dtype) -> float:
    """Max abs diff of ``kernel`` vs the torch reference on a varlen input with initial states."""
    g = torch.Generator().manual_seed(7)
    lens = [5, 64, 130, 1, 77]
    T, H, K = sum(lens), 4, 64
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    q, k = (torch.randn(1, T, 2, K, generator=g) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=g)
    gg = -0.2 * torch.rand(1, T, H, generator=g)
    beta = torch.rand(1, T, H, generator=g)
    h0 = torch.randn(len(lens), H, K, K, generator=g) * 0.1
    ref, ref_h = torch_chunk_gated_delta_rule(
        q, k, v, gg, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )
    dev = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    out, ht = kernel(
        dev(q),
        dev(k),
        dev(v),
        gg.to(device),
        dev(beta),
        initial_state=h0.to(device),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu.to(device),
    )
    return max(float((out.float().cpu() - ref).abs().max()), float((ht.float().cpu() - ref_h).abs().max()))


def _time(fn, iters: int, warmup: int, device: str) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run(args: argparse.Namespace) -> dict:
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU reference")
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    s = SHAPES["cpu" if smoke else "gpu"]
    if smoke:
        seqs = rollout_tree(0, tasks=2, system=150, prompt=(70, 140), fan=(2, 2, 3), turn=(20, 90), leaf=(3, 40))
        seq_len = 2048
    else:
        sc = args.scale
        seqs = rollout_tree(
            0, tasks=4 * sc, system=2000, prompt=(400, 1200), fan=(3, 3, 4), turn=(60, 500), leaf=(8, 200)
        )
        seq_len = 65536
    t0 = time.perf_counter()
    tree_plan = plan_batch(seqs, seq_len=seq_len, min_shared_len=64, conv_width=s["W"])
    flat_plan = plan_batch(seqs, seq_len=seq_len, placement="no_share", conv_width=s["W"])
    tree_sched, flat_sched = tree_schedule(tree_plan, device=device), tree_schedule(flat_plan, device=device)
    plan_ms = (time.perf_counter() - t0) * 1e3
    seg = tree_plan.segments
    info = dict(
        sequences=len(seqs),
        unpacked_tokens=int(flat_plan.stats.packed_tokens),
        tree_tokens=int(tree_plan.stats.packed_tokens),
        tree_rows=tree_plan.num_rows,
        flat_rows=flat_plan.num_rows,
        levels=len(tree_sched.levels),
        segments=seg.num_segments,
        short_segments=int((seg.length < 64).sum()),
        plan_and_schedule_ms=round(plan_ms, 1),
    )

    kernel = torch_chunk_gated_delta_rule if smoke else select_kernel(torch.zeros(1, device=device, dtype=dtype))
    if not smoke and kernel is torch_chunk_gated_delta_rule:
        sys.exit("flash-linear-attention is not importable: install it (or carry its wheels) for the GPU benchmark")
    info["kernel_max_abs_diff_vs_reference"] = _check_kernel(kernel, device, dtype)

    x_t, a_t, b_t, w = _inputs(tree_plan.num_rows * seq_len, s, dtype, device, seed=1)
    x_f, a_f, b_f = (_gather_rows(tree_plan, flat_plan, t) for t in (x_t, a_t, b_t))
    with torch.no_grad():
        o_t = _layer(x_t, a_t, b_t, w, tree_sched, s, kernel)
        o_f = _layer(x_f, a_f, b_f, w, flat_sched, s, kernel)
    diffs = [float((p.float() - q.float()).abs().max()) for p, q in zip(_pick(tree_plan, o_t), _pick(flat_plan, o_f))]
    scale = float(torch.cat(_pick(flat_plan, o_f)).float().abs().max())
    info["tree_vs_unpacked_max_abs_diff"] = max(diffs)
    info["output_max_abs"] = scale
    tol = 1e-4 if smoke else 0.05 * max(scale, 1.0)
    if max(diffs) > tol:
        sys.exit(f"tree output differs from unpacked: {max(diffs):.3g} > {tol:.3g}")
    del o_t, o_f

    def step(x, a, b, sched):
        xs = [t.detach().requires_grad_(True) for t in (x, a, b)]
        ww = w.detach().requires_grad_(True)
        out = _layer(*xs, ww, sched, s, kernel)
        out.float().square().mean().backward()

    res = {}
    for name, ins, sched in (("tree", (x_t, a_t, b_t), tree_sched), ("unpacked", (x_f, a_f, b_f), flat_sched)):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = _time(lambda: step(*ins, sched), args.iters, args.warmup, device)
        res[name] = dict(fwd_bwd_ms=round(ms, 3))
        if device == "cuda":
            res[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    info.update(res)
    info["speedup_unpacked_over_tree"] = round(res["unpacked"]["fwd_bwd_ms"] / res["tree"]["fwd_bwd_ms"], 2)
    info["token_ratio_unpacked_over_tree"] = round(info["unpacked_tokens"] / info["tree_tokens"], 2)
    info["machine"] = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    info["torch"] = torch.__version__
    info["dtype"] = str(dtype)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, fp32, torch reference kernel on CPU")
    ap.add_argument("--scale", type=int, default=1, help="GPU workload size: tasks = 4 * scale")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    info = run(args)
    print("| what | value |\n|---|---:|")
    for k, v in info.items():
        print(f"| {k} | {v} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
