"""FlexAttention blocks touched / blocks needed, under sliding windows and chunks, rows 128..131,072.

Usage:
    python benchmarks/block_masks.py [--rows 128 1024 8192 32768 131072] [--json out.json]

For each row length L and each mask (the tree alone, sliding windows 8..4096, chunks), two
workloads planned with ``auto``:

- ``one sequence``: one sequence filling the row (a prompt of 10% of it, the rest trainable);
- ``golden tree``: the golden example divided by 131,072 / L (benchmarks/golden_scaled.py):
  32 sequences in four groups sharing a system prompt, rows of L.

Figures per case: blocks ``block_mask`` lists (partial + full), blocks an exact count needs,
their ratio (goal 1.0; below 1.0 would be a missed visible pair), the full blocks, and the
same ratio for the previous BlockMask (every block the tree touches, none full under a
window or a chunk). Blocks needed: FlexAttention's ``create_block_mask`` evaluating every
(query, key) pair where L <= ``--pairs-max`` (default 8,192); above, an independent count
from the plan's segment table (per query, its ancestor chain's row ranges cut at the
window's or chunk's first position; :func:`needed_blocks`), which the script first checks
against ``create_block_mask`` at the smaller L. Block size: 8 at L = 128, 64 at 1,024, 128
from 2,048 on. Also the time ``block_mask`` takes (median of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.proto.index import ancestor_chains, ragged_arange, row_segments  # noqa: E402
from treepack.service.planner import plan_batch  # noqa: E402
from treepack.trainer import materialize  # noqa: E402
from treepack.trainer.kernels.blocks import _touched, block_mask, naive_block_mask  # noqa: E402

WINDOWS = (8, 64, 512, 4096)
CHUNKS = (256, 8192)


def block_size_for(L: int) -> int:
    return 8 if L <= 128 else 64 if L <= 1024 else 128


def workloads(L: int) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 1000, L).astype(np.uint32)
    one = dict(sequences=[seq], trainable=[max(1, L // 10)], groups=None, seq_len=L, min_shared_len=1)
    return {"one sequence": one, "golden tree": scaled_golden(max(1, 131072 // L))}


def needed_blocks(plan, rows: np.ndarray, bs: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """[K, nb, nb] bool blocks holding a visible pair, from per-query key ranges (no pair loop).

    Query i of segment g sees, of each segment a on g's chain (root first), the rows
    ``[max(start_a, lo_i), min(end_a, i + 1))``, where ``lo_i`` is the row of the chain's
    token at position ``max(pos_i - w + 1, chunk start)`` (the chain holds positions
    0 .. pos_i in row order); padding sees itself. Every range marks its key blocks for the
    query's block (a difference array over key blocks).
    """
    seg, L = plan.segments, plan.seq_len
    K, nb = len(rows), -(-L // bs)
    diff = np.zeros((K, nb, nb + 1), dtype=np.int32)
    segs, local = row_segments(seg.row_ptr, rows)
    n = seg.length[segs]
    tok_seg = np.repeat(np.arange(segs.shape[0]), n)
    i = np.repeat(seg.row_start[segs], n) + ragged_arange(n)  # row index of each real query
    pos = np.repeat(seg.seq_start[segs], n) + ragged_arange(n)
    want = np.zeros_like(pos)
    if window is not None:
        want = np.maximum(want, pos - window + 1)
    if chunk is not None:
        want = np.maximum(want, pos - pos % chunk)
    ptr, chain = ancestor_chains(seg.parent, seg.depth, segs)
    depth = np.diff(ptr)
    q = np.repeat(np.arange(i.shape[0]), depth[tok_seg])  # one entry per (query, chain segment)
    a = chain[np.repeat(ptr[tok_seg], depth[tok_seg]) + ragged_arange(depth[tok_seg])]
    # lo_i: the chain segment holding position want_i, at its offset.
    holds = (seg.seq_start[a] <= want[q]) & (want[q] < seg.seq_start[a] + seg.length[a])
    lo = np.zeros_like(i)
    lo[q[holds]] = seg.row_start[a[holds]] + want[q[holds]] - seg.seq_start[a[holds]]
    lo_k = np.maximum(seg.row_start[a], lo[q])
    hi_k = np.minimum(seg.row_start[a] + seg.length[a], i[q] + 1)
    ok = lo_k < hi_k
    kr, qb = local[tok_seg[q[ok]]], i[q[ok]] // bs
    np.add.at(diff, (kr, qb, lo_k[ok] // bs), 1)
    np.add.at(diff, (kr, qb, (hi_k[ok] - 1) // bs + 1), -1)
    used = np.zeros((K, L), dtype=bool)
    used[local[tok_seg], i] = True
    pk, pi = np.nonzero(~used)  # padding (and empty rows): the diagonal block
    np.add.at(diff, (pk, pi // bs, pi // bs), 1)
    np.add.at(diff, (pk, pi // bs, pi // bs + 1), -1)
    return torch.from_numpy(np.cumsum(diff, axis=2)[:, :, :nb] > 0)


def listed(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(touched [K, nq, nk], full [K, nq, nk]) bool from a BlockMask's lists."""
    K, _, nq, nk = bm.kv_indices.shape
    at = torch.arange(nk)[None, None, None, :]

    def dense(num, idx):
        out = torch.zeros(K, nq, nk + 1, dtype=torch.bool)
        out.scatter_(2, torch.where(at < num[..., None], idx.long(), nk)[:, 0], True)
        return out[..., :nk]

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    return dense(bm.kv_num_blocks, bm.kv_indices) | full, full


def previous_touched(batch, bs: int) -> int:
    """Blocks the previous BlockMask listed: every block the tree touches (windows and chunks ignored)."""
    se = batch.subtree_end
    K, L = se.shape
    nb = -(-L // bs)
    se_max = torch.nn.functional.pad(se, (0, nb * bs - L)).view(K, nb, bs).amax(-1)
    return int(_touched(se_max, None, nb, bs, L).sum())


def run_case(L: int, name: str, case: dict, masks, pairs_max: int) -> list[dict]:
    plan = plan_batch(
        case["sequences"],
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
    )
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)
    bs = block_size_for(L)
    se, pos = batch.subtree_end, batch.position_ids
    out = []
    for window, chunk in masks:
        kw = dict(block_size=bs, sliding_window=window, chunk_size=chunk)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            bm = block_mask(se, pos, **kw)
            times.append(time.perf_counter() - t0)
        touched, full = listed(bm)
        need = needed_blocks(plan, batch.rows, bs, window, chunk)
        method = "segment table"
        if L <= pairs_max:
            ref_touched, ref_full = listed(naive_block_mask(se, pos, **kw))
            assert torch.equal(need, ref_touched), f"needed_blocks disagrees with create_block_mask at L={L}"
            assert torch.equal(full, ref_full), "full blocks differ from create_block_mask"
            method = "every pair"
        assert not (need & ~touched).any(), "a needed block is missing"
        n_need, n_touch = int(need.sum()), int(touched.sum())
        prev = previous_touched(batch, bs)
        out.append(
            dict(
                rows=L,
                workload=name,
                row_count=batch.num_rows,
                block=bs,
                mask="tree" if window is None and chunk is None else f"window {window}" if window else f"chunk {chunk}",
                needed=n_need,
                touched=n_touch,
                ratio=n_touch / n_need,
                full=int(full.sum()),
                previous=prev,
                previous_ratio=prev / n_need,
                needed_by=method,
                build_ms=statistics.median(times) * 1e3,
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 1024, 8192, 32768, 131072])
    p.add_argument("--pairs-max", type=int, default=8192, help="largest L checked with create_block_mask")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    masks = [(None, None)] + [(w, None) for w in WINDOWS] + [(None, c) for c in CHUNKS]
    results = []
    print(f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}")
    print(
        "| rows L | workload | block | mask | needed | touched | touched / needed | full | "
        "previous / needed | build ms |"
    )
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for L in a.rows:
        for name, case in workloads(L).items():
            useful = [(w, c) for w, c in masks if (w or 0) < L and (c or 0) < L]
            for r in run_case(L, name, case, useful, a.pairs_max):
                results.append(r)
                print(
                    f"| {r['rows']:,} | {r['workload']} | {r['block']} | {r['mask']} | {r['needed']:,} | "
                    f"{r['touched']:,} | **{r['ratio']:.3f}** | {r['full']:,} | {r['previous_ratio']:.2f} | "
                    f"{r['build_ms']:.1f} |",
                    flush=True,
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
