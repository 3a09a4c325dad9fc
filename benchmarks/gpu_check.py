"""One GPU check: every GPU test and benchmark of the trainer, one JSON report.

Usage:
    make gpu-check [REPORT=path]           # = python benchmarks/gpu_check.py [--json path]
    python benchmarks/gpu_check.py --cpu-smoke --json /tmp/smoke.json   # tiny, CPU

Sections, in order (each is checked against its CPU / torch reference, then timed; a
failing section is recorded and the others still run; one past ``--budget-s`` is recorded
as not run):

- ``probe``: device, torch, triton, and which GPU kernels import (``gpu.available()``);
- ``kernels``: per mixer kernel (GDN, KDA, Mamba2, Mamba1, short conv via fla and via
  causal-conv1d) x dtype (``--dtypes``, default bf16 and fp16; fp32 runs under the
  interpreter in CI): the project's GPU wrapper over a depth-3 tree plan against the fp64
  token-loop reference (outputs and input/parameter gradients, relative to the
  reference's max), then, for ``--time-dtypes`` (bf16), fwd+bwd time of the wrapper on a
  rollout tree at layer shapes, tree-packed vs every sequence unpacked (same kernel);
- ``gdn``: ``benchmarks/gpu_gdn.py`` (the GDN layer, tree vs unpacked, fla vs reference);
- ``sparse``: top-k indexer selection and sparse attention on packed rows against the
  naive references, then timed;
- ``attention``: ``benchmarks/gpu_attention.py``: flex / flash-gather tree (and unpacked
  FlashAttention when flash-attn imports) checked against the dense-mask SDPA reference
  at golden / 8, then timed on the golden example (FlexAttention compiles longest);
- ``windows``: ``benchmarks/gpu_windows.py``: sliding-window (4,096) and chunked (8,192) tree attention
  (FlexAttention with the BlockMask pruned by the window or chunk, and under the previous
  unpruned one) and the copy-free varlen path, bf16 at rows of 8,192 and 32,768, checked and
  timed against the unpacked sequences in the same run;
- ``cp``: ``benchmarks/gpu_check_cp.py``: context parallelism (Ulysses and all-gather) on
  up to 4 GPUs against one, then timed; with at most one GPU the section says so (``ok``
  None, ``skipped`` naming the GPU count) instead of running;
- ``megatron``: ``benchmarks/gpu_check_megatron.py``: the Megatron-Core backend
  (``treepack.trainer.megatron``) on one GPU in bf16, sdpa and flex, against HF alone, the
  mask types checked ``arbitrary``, then timed; without megatron-core and megatron-bridge
  installed the section says so instead of running.

The report goes to ``--json``, else ``$OUT/gpu_check.json`` when ``OUT`` is set, else
``gpu_check.json``. Exit status 1 when any check failed, 2 without a CUDA device (unless
``--cpu-smoke``: the same code paths at tiny sizes on CPU, the token-loop references in
place of the kernels, so CI keeps this script from rotting).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "tests" / "triton_interp")]

from cases import KERNELS, make_inputs, run_case  # noqa: E402

from treepack.service.planner import plan_batch  # noqa: E402
from treepack.trainer.kernels import gpu  # noqa: E402
from treepack.trainer.kernels.tree_scan import tree_schedule  # noqa: E402

from helpers.trees import tree_plan  # noqa: E402

#: relative tolerance per dtype (outputs and gradients vs the fp64 reference)
TOL = {"bfloat16": 5e-2, "float16": 2e-2, "float32": 2e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device: str, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def probe(args) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"not importable: {e}"
    # The probe only reports (the kernels section fails for a kernel that does not import),
    # so it is ok once it ran; every section says ok explicitly.
    return dict(
        ok=True,
        device=torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine()),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton_version,
        kernels={k: v or "ok" for k, v in gpu.available().items()},
    )


def _check_case(kernel: str, dtype: str, args, tree) -> dict:
    """Wrapper vs fp64 loop reference on the small tree: relative errors, pass/fail."""
    plan, sched = tree
    gen = torch.Generator().manual_seed(7)
    toks, params = make_inputs(kernel, sched.num_positions, DTYPES[dtype], gen, device=args.device)
    leaves = list(toks.values()) + list(params.values())
    real = torch.from_numpy(plan.segment_ids().reshape(-1) >= 0).to(args.device)
    out = run_case(kernel, plan, sched, toks, params, mode=args.mode)
    weight = torch.randn(out[real].shape, generator=gen, dtype=torch.float64).to(args.device)
    grads = torch.autograd.grad((out[real].double() * weight).sum(), leaves, allow_unused=True)
    ref = run_case(kernel, plan, sched, toks, params, mode="reference")
    ref_grads = torch.autograd.grad((ref[real] * weight).sum(), leaves, allow_unused=True)
    errs = {
        name: (float("inf") if g is None else _rel(g, r))
        for name, g, r in zip(list(toks) + list(params), grads, ref_grads)
    }
    res = dict(out_rel_err=_rel(out[real], ref[real]), grad_rel_err=max(errs.values()), grad_rel_err_by_input=errs)
    res["nan_at_real"] = bool(torch.isnan(out[real]).any())
    res["ok"] = res["out_rel_err"] <= TOL[dtype] and res["grad_rel_err"] <= TOL[dtype] and not res["nan_at_real"]
    return res


def _time_case(kernel: str, dtype: str, args, big) -> dict:
    """fwd+bwd ms of the wrapper at layer shapes: tree-packed vs unpacked (same kernel)."""
    out = {}
    for name, (plan, sched) in big.items():
        gen = torch.Generator().manual_seed(1)
        toks, params = make_inputs(
            kernel, sched.num_positions, DTYPES[dtype], gen, shape=args.shape, device=args.device
        )

        def step(toks=toks, params=params):
            y = run_case(kernel, plan, sched, toks, params, mode=args.mode, shape=args.shape)
            torch.autograd.grad(
                y.float().nan_to_num().square().mean(), list(toks.values()) + list(params.values()), allow_unused=True
            )

        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out[name] = dict(
            fwd_bwd_ms=round(_time_ms(step, args.device, args.iters, args.warmup), 3),
            tokens=int(plan.stats.packed_tokens),
        )
        if args.device == "cuda":
            out[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        del toks, params
    out["time_unpacked_over_tree"] = round(out["unpacked"]["fwd_bwd_ms"] / out["tree"]["fwd_bwd_ms"], 3)
    out["tokens_unpacked_over_tree"] = round(out["unpacked"]["tokens"] / out["tree"]["tokens"], 3)
    return out


def kernels(args) -> dict:
    from gpu_gdn import rollout_tree

    seqs, _, plan = tree_plan(0, trees=2, depth=3, max_len=140)
    tree = (plan, tree_schedule(plan, device=args.device))
    if args.cpu_smoke:
        roll = rollout_tree(0, tasks=1, system=20, prompt=(5, 15), fan=(2, 2), turn=(3, 10), leaf=(2, 8))
        seq_len = 256
    else:
        roll = rollout_tree(0, tasks=2, system=1500, prompt=(300, 900), fan=(3, 3, 4), turn=(60, 400), leaf=(8, 200))
        seq_len = 32768
    big = {}
    for name, kw in (("tree", dict(min_shared_len=64)), ("unpacked", dict(placement="no_share"))):
        p = plan_batch(roll, seq_len=seq_len, conv_width=4, **kw)
        big[name] = (p, tree_schedule(p, device=args.device))
    avail = gpu.available()
    res: dict = {}
    for kernel, kname in KERNELS.items():
        res[kernel] = {}
        for dtype in args.dtypes:
            if not args.cpu_smoke and avail[kname]:
                res[kernel][dtype] = dict(ok=None, skipped=f"{kname} unavailable: {avail[kname]}")
                continue
            if time.perf_counter() > args.deadline:
                res[kernel][dtype] = dict(ok=None, skipped="time budget")
                continue
            try:
                r = _check_case(kernel, dtype, args, tree)
                if r["ok"] and dtype in args.time_dtypes:
                    r["timing"] = _time_case(kernel, dtype, args, big)
            except Exception as e:  # one broken kernel must not hide the others
                r = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=4))
            res[kernel][dtype] = r
            print(
                f"  {kernel:16s} {dtype:9s} ok={r.get('ok')} out={r.get('out_rel_err', float('nan')):.2e} "
                f"grad={r.get('grad_rel_err', float('nan')):.2e} {r.get('timing', r.get('error', ''))}",
                flush=True,
            )
    res["ok"] = all(r.get("ok") is not False for per in res.values() if isinstance(per, dict) for r in per.values())
    return res


def attention(args) -> dict:
    """Checked at a size where the dense SDPA reference fits (golden / 8, rows of 16,384),
    then timed on the real golden example (rows of 131,072)."""
    import gpu_attention

    if args.cpu_smoke:
        runs = {"check": ["--cpu-smoke"]}
    else:
        common = ["--iters", str(args.iters), "--warmup", str(args.warmup)]
        runs = {"check": ["--scale", "8", "--dense", *common], "timed": ["--scale", str(args.attention_scale), *common]}
    out = {name: gpu_attention.main(argv) for name, argv in runs.items()}
    tol = 1e-4 if args.cpu_smoke else 5e-2
    res = out["check"]["results"]
    diffs = [r["max_abs_diff"] for r in res if "error" not in r and r.get("max_abs_diff") == r.get("max_abs_diff")]
    errors = [r for o in out.values() for r in o["results"] if "error" in r]
    out["ok"] = not errors and len(diffs) >= 1 and max(diffs) <= tol
    return out


def windows(args) -> dict:
    """``benchmarks/gpu_windows.py``: window / chunk tree attention (pruned BlockMask) and the
    copy-free varlen path at 8k-32k rows, bf16, against the unpacked baseline in the same run."""
    import gpu_windows

    argv = ["--cpu-smoke"] if args.cpu_smoke else ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    out = gpu_windows.main(argv)
    tol = 1e-4 if args.cpu_smoke else 5e-2
    rows = out["results"]
    errors = [r for r in rows if "error" in r]
    worst = max((r["max_abs_diff"] for r in rows if "max_abs_diff" in r), default=float("nan"))
    out["ok"] = not errors and worst <= tol
    return out


def gdn(args) -> dict:
    import gpu_gdn

    ns = argparse.Namespace(
        cpu_smoke=args.cpu_smoke,
        scale=args.gdn_scale,
        iters=min(args.iters, 3) if args.cpu_smoke else args.iters,
        warmup=args.warmup,
        json=None,
    )
    try:
        info = gpu_gdn.run(ns)
    except SystemExit as e:  # the benchmark exits with a message when a check fails
        return dict(ok=False, error=str(e))
    info["ok"] = True
    return info


def sparse(args) -> dict:
    from treepack.trainer import materialize
    from treepack.trainer.kernels.sparse import (
        indexer_scores,
        naive_sparse_attention,
        naive_tree_topk,
        sparse_attention,
        tree_topk,
    )

    dt = torch.float32 if args.cpu_smoke else torch.bfloat16
    res = {}
    for label, kw in (("check", dict(trees=2, depth=3, max_len=140)), ("timed", dict(trees=6, depth=4, max_len=900))):
        if label == "timed" and args.cpu_smoke:
            kw = dict(trees=3, depth=3, max_len=200)
        seqs, _, plan = tree_plan(3, seq_len=256 if label == "check" else 1024, **kw)
        b = materialize(plan, seqs, device=args.device, allow_empty_loss=True)  # attention only: no loss here
        g = torch.Generator().manual_seed(0)
        R, T, H, D, k = b.num_rows, b.seq_len, 4, 32, 64
        r = lambda *s: torch.randn(*s, generator=g).to(args.device)  # noqa: E731
        qi, ki, w = r(R, T, H, D), r(R, T, D), r(R, T, H)
        q, kk, v = (r(R, H, T, D).to(dt) for _ in range(3))
        se, pos = b.subtree_end.to(args.device), b.position_ids.to(args.device)

        def step():
            idx, valid = tree_topk(indexer_scores(qi, ki, w, D**-0.5), se, pos, k)
            return sparse_attention(q, kk, v, idx, valid, D**-0.5), idx, valid

        o, idx, valid = step()
        if label == "check":
            scores = indexer_scores(qi, ki, w, D**-0.5)
            nidx, nvalid = naive_tree_topk(scores.cpu(), se.cpu(), pos.cpu(), k)
            same = bool(
                torch.equal(valid.cpu(), nvalid)
                and torch.equal(torch.where(nvalid, idx.cpu(), -1), torch.where(nvalid, nidx, -1))
            )
            ref = naive_sparse_attention(q.float(), kk.float(), v.float(), idx, valid, D**-0.5)
            res[label] = dict(topk_equal=same, attn_rel_err=_rel(o, ref), rows=R, seq_len=T)
        else:
            res[label] = dict(
                ms=round(_time_ms(step, args.device, args.iters, args.warmup), 3), rows=R, seq_len=T, topk=k
            )
    res["ok"] = res["check"]["topk_equal"] and res["check"]["attn_rel_err"] <= TOL[str(dt).split(".")[-1]]
    return res


def cp(args) -> dict:
    import gpu_check_cp

    return gpu_check_cp.section(args.cpu_smoke)


def megatron(args) -> dict:
    import gpu_check_megatron

    return gpu_check_megatron.section(args.cpu_smoke)


SECTIONS = {
    "probe": probe,
    "kernels": kernels,
    "gdn": gdn,
    "sparse": sparse,
    "windows": windows,
    "attention": attention,
    "cp": cp,
    "megatron": megatron,
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny, CPU, token-loop references in place of the GPU kernels"
    )
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument(
        "--dtypes", default="bfloat16,float16", help="checked dtypes (fp32 runs under the interpreter in CI)"
    )
    ap.add_argument("--time-dtypes", default="bfloat16", help="dtypes also timed at layer shapes")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attention-scale", type=int, default=1)
    ap.add_argument("--gdn-scale", type=int, default=1)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="sections and kernel cases starting after this many seconds are not run",
    )
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here. Run it on a machine with a GPU (make gpu-check), "
            "or --cpu-smoke for the CPU code paths.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    args.device, args.mode, args.shape = ("cpu", "smoke", "tiny") if args.cpu_smoke else ("cuda", "gpu", "layer")
    args.dtypes = ["float32"] if args.cpu_smoke else args.dtypes.split(",")
    args.time_dtypes = ["float32"] if args.cpu_smoke else args.time_dtypes.split(",")
    if args.cpu_smoke:
        args.iters, args.warmup = 1, 0
    report = dict(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), cpu_smoke=args.cpu_smoke, sections={})
    t_start = time.perf_counter()
    args.deadline = t_start + args.budget_s
    for name in args.sections.split(","):
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            report["sections"][name] = dict(ok=None, skipped=f"time budget: {elapsed:.0f} s > {args.budget_s:.0f} s")
            continue
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            out = SECTIONS[name](args)
        except Exception as e:
            out = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
        out["seconds"] = round(time.perf_counter() - t0, 2)
        report["sections"][name] = out
    report["seconds"] = round(time.perf_counter() - t_start, 2)
    report["ok"] = all(s.get("ok") is not False for s in report["sections"].values())
    path = args.json or (
        os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    )
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'} in {report['seconds']} s; report: {path}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
