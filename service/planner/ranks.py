"""Rows to ranks (SPEC section 5): equal row counts, balanced estimated cost.

A row's cost estimate is its tokens plus the query-key pairs its mask allows: a segment of
length L whose chain above it holds P tokens adds ``L * P + L * (L + 1) / 2`` pairs (the
attention work), and every token adds 1 (the MLP/projection work), scaled so that a pair
weighs ``pair_weight`` tokens.

Each rank receives ``ceil(R / num_ranks)`` rows; the gap is filled with empty rows
(``-1`` in ``rank_rows``) that the trainer runs as padding. Rows are dealt longest
processing time first: heaviest row to the least-loaded rank that still has a free slot.

Under context parallelism each row is split over a CP group. With all-gather attention
(``cp_attention="allgather"``) a rank's compute is the keys its queries see, which grows
along the row (a token sees its whole ancestor chain), so contiguous shards would leave
the first rank idle; the row is cut into ``CP_ALIGN``-token tiles instead, and the tiles,
heaviest first, are dealt in snake order (0, 1, .., P-1, P-1, .., 0, 0, ..): every rank
gets ``shard_len / CP_ALIGN`` tiles, and any two ranks' work differs by at most the
heaviest tile's (:func:`balance_tiles`).
"""

from __future__ import annotations

import heapq

import numpy as np

from treepack.proto.index import ragged_arange
from treepack.proto.options import CP_ALIGN, cp_shard_len
from treepack.proto.plan import Ranks, Segments

__all__ = ["assign_ranks", "row_cost", "attention_work", "balance_tiles"]


def row_cost(seg: Segments, num_rows: int, pair_weight: float = 1.0 / 1024) -> np.ndarray:
    """[R] float64 estimated cost per row (module docstring)."""
    L = seg.length.astype(np.float64)
    pairs = L * seg.seq_start + L * (L + 1) / 2
    per_seg = L + pair_weight * pairs
    return np.bincount(seg.row, weights=per_seg, minlength=num_rows).astype(np.float64)


def attention_work(seg: Segments, num_rows: int, length: int) -> np.ndarray:
    """[R, length] float64 attention work of each row position: the keys its query sees
    (its sequence position + 1: the ancestor chain and its own segment so far), 1 for
    padding (it sees itself)."""
    work = np.ones((num_rows, length), dtype=np.float64)
    off = ragged_arange(seg.length)
    g = np.repeat(np.arange(seg.length.shape[0]), seg.length)
    work[seg.row[g], seg.row_start[g] + off] = seg.seq_start[g] + off + 1
    return work


def balance_tiles(work: np.ndarray, cp_size: int) -> np.ndarray:
    """[R, T] int32 CP rank of each ``CP_ALIGN``-token tile (module docstring).

    Args:
        work: [R, T * CP_ALIGN] per-position work (:func:`attention_work`); T a multiple
            of ``cp_size``.
        cp_size: P.
    """
    R = work.shape[0]
    T = work.shape[1] // CP_ALIGN
    tile_work = work.reshape(R, T, CP_ALIGN).sum(-1)
    order = np.argsort(-tile_work, axis=1, kind="stable")
    s = np.arange(T)
    rnd, j = s // cp_size, s % cp_size
    snake = np.where(rnd % 2 == 0, j, cp_size - 1 - j).astype(np.int32)
    tiles = np.empty((R, T), dtype=np.int32)
    np.put_along_axis(tiles, order, np.broadcast_to(snake, (R, T)), axis=1)
    return tiles


def assign_ranks(seg: Segments, num_rows: int, num_ranks: int, *, seq_len: int = 0, cp_size: int = 1, cp_attention: str = "auto") -> Ranks:
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
    tiles = np.zeros((0, 0), dtype=np.int32)
    if cp_size > 1 and cp_attention == "allgather":
        tiles = balance_tiles(attention_work(seg, num_rows, cp_size * shard), cp_size)
    return Ranks(
        num_ranks=num_ranks,
        rank_rows=rank_rows,
        row_cost=cost,
        rank_cost=np.asarray(load),
        cp_size=cp_size,
        shard_len=shard,
        cp_attention=cp_attention,
        cp_tiles=tiles,
    )
