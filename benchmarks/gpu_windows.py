"""GPU benchmark: sliding-window and chunked tree attention, and the copy-free varlen path, against unpacked.

Usage (a CUDA machine set up as in docs/gpu.md):
    python benchmarks/gpu_windows.py [--rows 8192 32768] [--iters 5] [--json out.json]
    python benchmarks/gpu_windows.py --cpu-smoke    # tiny, CPU, forward only for FlexAttention

Workload per row length L: one GRPO group, a prompt of L / 4 tokens shared by 8 completions
of equal length (the tree fills one row of L, with the join tokens), random bf16 q/k/v of
one attention layer (32 / 8 heads x 128). One step = forward + backward.

Masks: a sliding window of 4,096, a chunk of 8,192 (Llama 4), and full causal attention
(``--cpu-smoke``: rows of 256, a window of 32, a chunk of 64). Variants, all in the same run:

- ``unpacked flex`` (the baseline): the 8 sequences alone as a [8, H, S, D] batch, compiled
  FlexAttention with the causal + window (or chunk) mask of ``create_block_mask``;
- ``unpacked flash``: flash-attn over the same batch (windows and full; when it imports);
- ``flex tree``: the packed row, the BlockMask pruned by the window or chunk (only blocks
  with a visible pair, fully visible ones marked full);
- ``flex tree, every tree block``: the same row under the previous BlockMask (every block
  the tree touches, none full), to show what the pruning saves;
- ``flash tree copy-free`` (full attention): one varlen call per tree level over keys read in
  place (``copy_free`` in the row says whether flash-attn's split pair was found);
- ``flash tree gathered``: each segment over its gathered ancestor keys (windows via
  flash-attn's ``window_size``).

Each packed variant's outputs, read back per sequence, are compared with the baseline's
(``max_abs_diff``), and the report gives time / baseline next to tokens / unpacked and
blocks touched / blocks needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import time_step  # noqa: E402

from treepack.service.planner import plan_batch  # noqa: E402
from treepack.trainer import materialize, naive_varlen_attention, tree_attention  # noqa: E402
from treepack.trainer.kernels.blocks import _touched, block_mask, tree_mask_mod  # noqa: E402


def group(L: int, seed: int = 0) -> dict[str, Any]:
    """A prompt of L // 4 and 8 equal completions filling one row of L (join tokens included)."""
    rng = np.random.default_rng(seed)
    P = L // 4
    C = (L - P + 1) // 8 - 1
    prompt = rng.integers(0, 32000, P)
    seqs = [np.concatenate([prompt, rng.integers(0, 32000, C)]) for _ in range(8)]
    return dict(sequences=seqs, trainable=[P] * 8, groups=[0] * 8, seq_len=L, min_shared_len=16)


def previous_block_mask(batch, block_size: int, window: int | None, chunk: int | None):
    """The BlockMask before window/chunk pruning: every block the tree touches, none full."""
    from torch.nn.attention.flex_attention import BlockMask

    se, pos = batch.subtree_end, batch.position_ids
    K, L = se.shape
    nb = -(-L // block_size)
    pad = lambda x, f: torch.nn.functional.pad(x, (0, nb * block_size - L), value=f)  # noqa: E731
    touched = _touched(pad(se, 0).view(K, nb, block_size).amax(-1), None, nb, block_size, L)
    idx = torch.argsort((~touched).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
    none = torch.zeros_like(touched)
    return BlockMask.from_kv_blocks(
        touched.sum(-1, dtype=torch.int32)[:, None],
        idx,
        none.sum(-1, dtype=torch.int32)[:, None],
        idx,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(pad(se, 0), pad(pos, 0), window, chunk),
        seq_lengths=(L, L),
    )


def _flex_fn(compile_: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention


def run_row(L: int, masks: list[tuple[str, int | None, int | None]], args) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask

    dev = torch.device(args.device)
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    case = group(L)
    plan = plan_batch(case["sequences"], seq_len=L, trainable=case["trainable"], groups=case["groups"])
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], device=dev, advise=False)
    K, H, Hkv, D = batch.num_rows, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(K, h, L, D, device=dev, dtype=dtype, generator=g) for h in (H, Hkv, Hkv))
    S = len(case["sequences"][0])
    flat = batch.seq_flat  # [8 * S] flat row positions, sequence by sequence
    unpack = lambda x: x.transpose(1, 2).reshape(K * L, x.shape[1], D)[flat].view(8, S, x.shape[1], D).transpose(1, 2)  # noqa: E731
    qu, ku, vu = (unpack(t).contiguous() for t in (q, k, v))
    flex = _flex_fn(not args.cpu_smoke)
    fwd_only = args.cpu_smoke  # FlexAttention has no CPU backward
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        flash_attn_func = flash_attn_varlen_func = None
    if args.cpu_smoke:
        flash_attn_varlen_func = naive_varlen_attention
    out = []
    for label, window, chunk in masks:
        pos = torch.arange(S, device=dev)

        def unpacked_mod(b, h, qi, ki, window=window, chunk=chunk):
            ok = ki <= qi
            if window is not None:
                ok = ok & (qi - ki < window)
            if chunk is not None:
                ok = ok & (qi // chunk == ki // chunk)
            return ok

        ubm = create_block_mask(unpacked_mod, None, None, S, S, device=dev)
        tree_bm = block_mask(batch.subtree_end, batch.position_ids, sliding_window=window, chunk_size=chunk)
        prev_bm = previous_block_mask(batch, 128, window, chunk)
        del pos
        variants = [
            ("unpacked flex", lambda: flex(qu, ku, vu, block_mask=ubm, enable_gqa=True), False),
            ("flex tree", lambda bm=tree_bm: flex(q, k, v, block_mask=bm, enable_gqa=True), True),
            ("flex tree, every tree block", lambda bm=prev_bm: flex(q, k, v, block_mask=bm, enable_gqa=True), True),
        ]
        if flash_attn_func is not None and chunk is None:
            win = (-1, -1) if window is None else (window - 1, 0)
            variants.insert(
                1,
                (
                    "unpacked flash",
                    lambda win=win: flash_attn_func(
                        qu.transpose(1, 2), ku.transpose(1, 2), vu.transpose(1, 2), causal=True, window_size=win
                    ).transpose(1, 2),
                    False,
                ),
            )
        if flash_attn_varlen_func is not None:
            kw = dict(backend="flash", sliding_window=window, chunk_size=chunk)
            if window is None and chunk is None:
                fn = naive_varlen_attention if args.cpu_smoke else None
                variants.append(
                    ("flash tree copy-free", lambda fn=fn: tree_attention(q, k, v, batch, varlen_fn=fn, **kw), True)
                )
            gathered = lambda kw=kw: tree_attention(
                q, k, v, batch, varlen_fn=flash_attn_varlen_func, gather_keys=True, **kw
            )  # noqa: E731
            variants.append(("flash tree gathered", gathered, True))
        needed, touched = _blocks(tree_bm), _blocks(prev_bm)
        base_ms = base_out = None
        for name, step, packed in variants:
            forward_only = fwd_only and "flex" in name
            params = [t.requires_grad_(not forward_only) for t in ((q, k, v) if packed else (qu, ku, vu))]
            row = dict(rows=L, mask=label, variant=name, tokens=int(plan.stats.packed_tokens) if packed else 8 * S)
            if name == "flash tree copy-free" and not args.cpu_smoke:
                from treepack.trainer.kernels.gpu_flash import flash_split

                row["copy_free"] = flash_split() is not None
            try:
                if forward_only:
                    with torch.no_grad():
                        o = step()
                    ms = float("nan")
                else:
                    sec, peak, o = time_step(step, params, dev, args.warmup, args.iters)
                    ms = sec * 1e3
                    row["peak_gib"] = peak
            except Exception as e:  # one failing kernel must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
                out.append(row)
                continue
            o = o.detach()
            per_seq = unpack(o) if packed else o
            if base_out is None:
                base_out, base_ms = per_seq, ms
            row.update(
                ms=ms,
                time_ratio=ms / base_ms if base_ms == base_ms and ms == ms else float("nan"),
                token_ratio=row["tokens"] / (8 * S),
                max_abs_diff=float((per_seq.float() - base_out.float()).abs().max()),
            )
            if "flex tree" in name:
                row["blocks"] = needed if name == "flex tree" else touched
                row["blocks_over_needed"] = row["blocks"] / needed
            out.append(row)
            for p in params:
                p.grad = None
                p.requires_grad_(False)
    return out


def _blocks(bm) -> int:
    return int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run (FlexAttention forward only)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.rows, args.heads, args.kv_heads, args.head_dim, args.warmup, args.iters = [256], 2, 1, 16, 0, 1
        masks = [("window 32", 32, None), ("chunk 64", None, 64), ("full", None, None)]
        args.device = "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-smoke on CPU")
        masks = [("window 4096", 4096, None), ("chunk 8192", None, 8192), ("full", None, None)]
        args.device = "cuda"
        # One compiled FlexAttention per mask and row length (a window or chunk is a constant of its graph).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    results = []
    for L in args.rows:
        results += run_row(L, [m for m in masks if (m[1] or 0) < L and (m[2] or 0) < L], args)
    print(
        "| rows | mask | variant | ms fwd+bwd | time / baseline | tokens / unpacked | blocks / needed | max abs diff |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['rows']:,} | {r['mask']} | {r['variant']} | {r.get('ms', float('nan')):.2f} | "
            f"{r.get('time_ratio', float('nan')):.3f} | {r.get('token_ratio', float('nan')):.3f} | "
            f"{r.get('blocks_over_needed', float('nan')):.2f} | {r.get('max_abs_diff', float('nan')):.2e} "
            f"{r.get('error', '')}|"
        )
    out = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim),
        results=results,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
