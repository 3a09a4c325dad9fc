"""Rows to ranks (SPEC section 5): equal row counts, balanced estimated cost.

A row's cost estimate is its tokens plus the query-key pairs its mask allows: a segment of
length L whose chain above it holds P tokens adds ``L * P + L * (L + 1) / 2`` pairs (the
attention work), and every token adds 1 (the MLP/projection work), scaled so that a pair
weighs ``pair_weight`` tokens.

Each rank receives ``ceil(R / num_ranks)`` rows; the gap is filled with empty rows
(``-1`` in ``rank_rows``) that the trainer runs as padding. Rows are dealt longest
processing time first: heaviest row to the least-loaded rank that still has a free slot.
"""

from __future__ import annotations

import heapq

import numpy as np

from treepack.proto.options import cp_shard_len
from treepack.proto.plan import Ranks, Segments

__all__ = ["assign_ranks", "row_cost"]


def row_cost(seg: Segments, num_rows: int, pair_weight: float = 1.0 / 1024) -> np.ndarray:
    """[R] float64 estimated cost per row (module docstring)."""
    L = seg.length.astype(np.float64)
    pairs = L * seg.seq_start + L * (L + 1) / 2
    per_seg = L + pair_weight * pairs
    return np.bincount(seg.row, weights=per_seg, minlength=num_rows).astype(np.float64)


def assign_ranks(seg: Segments, num_rows: int, num_ranks: int, *, seq_len: int = 0, cp_size: int = 1) -> Ranks:
    """Deal rows to the ``num_ranks`` data-parallel ranks (module docstring); each row is
    then split over a CP group of ``cp_size`` ranks in shards of
    :func:`~treepack.proto.options.cp_shard_len` tokens."""
    cost = row_cost(seg, num_rows)
    per = -(-num_rows // num_ranks) if num_rows else 0
    rank_rows = np.full((num_ranks, per), -1, dtype=np.int64)
    fill = [0] * num_ranks
    load = [0.0] * num_ranks
    heap = [(0.0, p) for p in range(num_ranks)]
    for r in np.argsort(-cost, kind="stable").tolist():
        ld, p = heapq.heappop(heap)
        rank_rows[p, fill[p]] = r
        fill[p] += 1
        load[p] = ld + float(cost[r])
        if fill[p] < per:
            heapq.heappush(heap, (load[p], p))
    # Keep each rank's rows in increasing row order (deterministic, cache friendly).
    for p in range(num_ranks):
        k = fill[p]
        rank_rows[p, :k] = np.sort(rank_rows[p, :k])
    shard = cp_shard_len(seq_len, cp_size)
    return Ranks(num_ranks=num_ranks, rank_rows=rank_rows, row_cost=cost, rank_cost=np.asarray(load), cp_size=cp_size, shard_len=shard)
