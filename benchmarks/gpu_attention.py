"""GPU benchmark: tree attention forward+backward vs unpacked FlashAttention, golden example.

Usage (on a CUDA machine with flash-attn installed; ``pip install 'treepack[gpu]'``):
    python benchmarks/gpu_attention.py [--scale 1] [--heads 32] [--kv-heads 8] [--head-dim 128]
                                       [--iters 10] [--dense] [--json out.json]
    python benchmarks/gpu_attention.py --cpu-smoke     # tiny, CPU, proves the script runs

Workload: the golden example (SPEC 4) with lengths divided by ``--scale`` (1 = the real
one: 32 sequences, 699,072 tokens; ``auto`` packs them into 2 rows of 131,072 holding
240,220 tokens, ``bfd`` into 2 rows holding 252,219). Random bf16 q/k/v of one attention
layer; one step = forward + backward.

Variants, timed in the same run:
- ``flash unpacked`` (baseline): ``flash_attn_varlen_func`` over the 32 sequences, causal;
- ``flex tree``: compiled ``flex_attention`` on the packed rows with the BlockMask built
  from ``subtree_end``;
- ``flash copy-free tree``: the packed rows, one varlen call per tree level over keys and
  values read in place, merged by log-sum-exp (``copy_free`` says whether flash-attn's split
  forward/backward was found; without it this runs the gathered layout);
- ``flash gather tree``: the packed rows, one varlen sequence per segment whose keys are
  gathered from its ancestor chain (causal, bottom-right), gather included in the time;
- ``sdpa dense tree`` (``--dense``, or automatically when rows are <= 16,384): SDPA with the
  dense [L, L] mask, the reference.

Printed per variant: median time of ``--iters`` steps after warm-up (compilation excluded),
tokens/s (tokens the variant processes), unpacked tokens/s (useful work), peak memory,
time / baseline next to tokens / unpacked tokens and attended pairs / unpacked pairs, and
the max |difference| of every sequence's outputs against the baseline (the oracle at the
attention level: the packed q/k/v are gathered into the unpacked layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch  # noqa: E402
from treepack.trainer import materialize, naive_varlen_attention, tree_attention  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_step(
    step: Callable[[], torch.Tensor], params: list[torch.Tensor], dev: torch.device, warmup: int, iters: int
) -> tuple[float, float, torch.Tensor]:
    """(median seconds per forward+backward, peak GiB, last output)."""
    out = None
    for _ in range(warmup):
        for p in params:
            p.grad = None
        out = step()
        out.backward(torch.ones_like(out))
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(iters):
        for p in params:
            p.grad = None
        _sync(dev)
        t0 = time.perf_counter()
        out = step()
        out.backward(torch.ones_like(out))
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return statistics.median(times), peak, out.detach()


def run(args: argparse.Namespace) -> dict:
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    case = scaled_golden(args.scale)
    plan = plan_batch(
        case["sequences"],
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
        placement=args.placement,
    )
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], device=dev)
    K, L = batch.num_rows, batch.seq_len
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(K, H, L, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(K, Hkv, L, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(K, Hkv, L, D, device=dev, dtype=dtype, generator=g).requires_grad_()

    # Unpacked layout: every sequence's tokens gathered from the packed rows (shared
    # tokens copied into each sharer), so outputs are comparable sequence by sequence.
    flat = batch.seq_flat
    lens = torch.as_tensor([len(s) for s in case["sequences"]])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens, 0).to(dev)
    pick = lambda x: x.detach().transpose(1, 2).reshape(K * L, x.shape[1], D)[flat].contiguous().requires_grad_()  # noqa: E731
    qu, ku, vu = pick(q), pick(k), pick(v)
    unpacked_tokens = int(lens.sum())
    packed_tokens = int(plan.stats.packed_tokens)
    pairs_unpacked = int((lens * (lens + 1) // 2).sum())
    used = torch.zeros(K * L, dtype=torch.bool, device=dev)
    used[flat] = True
    pairs_packed = int((batch.position_ids.reshape(-1)[used] + 1).sum())  # a token sees its position + 1 keys

    if args.cpu_smoke:
        varlen = naive_varlen_attention
    else:
        try:
            from flash_attn import flash_attn_varlen_func as varlen
        except ImportError:
            varlen = None
            print("flash-attn is not installed: the FlashAttention variants are skipped")

    variants: list[tuple[str, Callable[[], torch.Tensor], list[torch.Tensor], bool]] = []
    if varlen is not None:
        variants.append(
            (
                "flash unpacked",
                lambda: varlen(qu, ku, vu, cu, cu, int(lens.max()), int(lens.max()), causal=True),
                [qu, ku, vu],
                False,
            )
        )
    variants.append(
        (
            "flex tree",
            lambda: tree_attention(q, k, v, batch, backend="flex", compile=not args.cpu_smoke),
            [q, k, v],
            True,
        )
    )
    if varlen is not None:
        # The CPU smoke's loop kernel has its own split pair; on CUDA None picks flash-attn's.
        split_fn = varlen if args.cpu_smoke else None
        variants.append(
            (
                "flash copy-free tree",
                lambda: tree_attention(q, k, v, batch, backend="flash", varlen_fn=split_fn),
                [q, k, v],
                True,
            )
        )
        variants.append(
            (
                "flash gather tree",
                lambda: tree_attention(q, k, v, batch, backend="flash", varlen_fn=varlen, gather_keys=True),
                [q, k, v],
                True,
            )
        )
    if args.dense or L <= 16384:
        variants.append(("sdpa dense tree", lambda: tree_attention(q, k, v, batch, backend="sdpa"), [q, k, v], True))

    results, base_time, base_out = [], None, None
    for name, step, params, packed in variants:
        if args.cpu_smoke and name == "flex tree":
            # No CPU backward for FlexAttention: forward only, not timed against the others.
            out = tree_attention(q.detach(), k.detach(), v.detach(), batch, backend="flex", compile=False)
            results.append(dict(variant=name + " (forward only)", max_abs_diff=_diff(out, flat, K, L, base_out)))
            continue
        try:
            t, peak, out = time_step(step, params, dev, args.warmup, args.iters)
        except Exception as e:  # report and go on: one failing kernel must not hide the others
            print(f"{name}: failed: {type(e).__name__}: {e}")
            results.append(dict(variant=name, error=f"{type(e).__name__}: {e}"))
            continue
        toks = packed_tokens if packed else unpacked_tokens
        if base_time is None:
            base_time, base_out = t, out
        extra = {}
        if name == "flash copy-free tree" and dev.type == "cuda":
            from treepack.trainer.kernels.gpu_flash import flash_split

            extra["copy_free"] = flash_split() is not None
        results.append(
            dict(
                variant=name,
                **extra,
                time_ms=1e3 * t,
                tokens=toks,
                tokens_per_s=toks / t,
                unpacked_tokens_per_s=unpacked_tokens / t,
                peak_gib=peak,
                time_ratio=t / base_time,
                token_ratio=toks / unpacked_tokens,
                pair_ratio=(pairs_packed if packed else pairs_unpacked) / pairs_unpacked,
                max_abs_diff=_diff(out, flat, K, L, base_out) if packed else 0.0,
            )
        )
    return dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch=torch.__version__,
        scale=args.scale,
        rows=K,
        seq_len=L,
        shape=dict(heads=H, kv_heads=Hkv, head_dim=D, dtype=str(dtype)),
        unpacked_tokens=unpacked_tokens,
        packed_tokens=packed_tokens,
        results=results,
    )


def _diff(out: torch.Tensor, flat: torch.Tensor, K: int, L: int, base: torch.Tensor | None) -> float:
    """Max |packed output at each sequence's tokens - unpacked output| ([T, H, D] layout)."""
    if base is None:
        return float("nan")
    per_seq = out.detach().transpose(1, 2).reshape(K * L, out.shape[1], out.shape[-1])[flat]
    return float((per_seq - base).abs().max())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--placement", default="auto")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dense", action="store_true", help="also run SDPA with the dense mask at any size")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run (sdpa, pure-torch varlen, flex forward)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.scale, args.heads, args.kv_heads, args.head_dim, args.warmup, args.iters = 512, 2, 1, 16, 1, 2
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke on CPU")
    out = run(args)
    print(
        f"# {out['device']}, torch {out['torch']}; golden / {out['scale']}: {out['rows']} rows of {out['seq_len']}, "
        f"{out['packed_tokens']:,} packed of {out['unpacked_tokens']:,} tokens; "
        f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, {out['shape']['dtype']}"
    )
    print(
        "| variant | ms fwd+bwd | tokens/s | unpacked tokens/s | peak GiB | "
        "time / baseline | tokens / unpacked | pairs / unpacked | max abs diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["results"]:
        if "time_ms" not in r:
            print(f"| {r['variant']} | {r.get('error', '-')} | | | | | | | {r.get('max_abs_diff', float('nan')):.2e} |")
            continue
        print(
            f"| {r['variant']} | {r['time_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['unpacked_tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | "
            f"{r['time_ratio']:.3f} | {r['token_ratio']:.3f} | {r['pair_ratio']:.3f} | {r['max_abs_diff']:.2e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
