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
the first rank idle; the row is cut into ``CP_ALIGN``-token tiles instead, and split by
attention work into few runs of consecutive tiles (:func:`balance_tiles`): every rank gets
``shard_len / CP_ALIGN`` tiles, and any two ranks' work differs by at most the heaviest
tile's. Few runs matter to the ``flash`` path, where each run of a rank's queries in a
varlen sequence copies that sequence's keys.

The split of a row, ``n = shard_len / CP_ALIGN`` tiles per rank: the first of these that
meets the bound.

1. Zigzag: the row cut into ``2 P`` chunks, rank r holding chunks r and ``2 P - 1 - r``
   (``ceil(n / 2)`` tiles in the first half, ``floor(n / 2)`` in the second): the usual
   load-balanced CP layout, balanced where work grows steadily along the row (one long
   sequence), rarely in trees, whose work rises and falls along the row.
2. Windows: ranks in turn take the window of ``n`` consecutive tiles of what is left, read
   as a cycle (the row's end joins its start, and the tiles around a window taken close
   up), whose work is nearest the work left per rank. The ``m`` windows of a cycle of
   ``m`` tiles hold every tile ``n`` times, so they average exactly that share, and
   neighbouring windows differ by one tile in and one out: the nearest is within half the
   heaviest tile of it. The last rank takes what is left; with two ranks the two are the
   share plus and minus that half, always within the bound. With more, the shares drift
   as windows miss them, and a row may (rarely) end outside.
3. Swaps: the heaviest and lightest ranks swap the tile pair that best halves their gap,
   up to ``P`` times (each adds at most 4 runs).
4. The deal that always meets the bound: tiles heaviest first, in snake order (0, 1, ..,
   P-1, P-1, .., 0, 0, ..), which scatters every rank over the row.

Zigzag and windows cut the row at most ``2 (P - 1)`` places (a window at its two ends), so
a row split by either has at most ``2 P - 1`` runs of one rank's tiles.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from treepack.proto.errors import PayloadTooLargeError
from treepack.proto.index import ragged_arange
from treepack.proto.options import CP_ALIGN, cp_shard_len
from treepack.proto.plan import Ranks, Segments

__all__ = [
    "assign_ranks",
    "row_cost",
    "attention_work",
    "tile_work",
    "naive_tile_work",
    "cp_tiles_of",
    "check_cp_tiles",
    "balance_tiles",
    "naive_balance_tiles",
]


def row_cost(seg: Segments, num_rows: int, pair_weight: float = 1.0 / 1024) -> np.ndarray:
    """[R] float64 estimated cost per row (module docstring)."""
    L = seg.length.astype(np.float64)
    pairs = L * seg.seq_start + L * (L + 1) / 2
    per_seg = L + pair_weight * pairs
    return np.bincount(seg.row, weights=per_seg, minlength=num_rows).astype(np.float64)


def attention_work(seg: Segments, num_rows: int, length: int) -> np.ndarray:
    """[R, length] float64 attention work of each row position: the keys its query sees
    (its sequence position + 1: the ancestor chain and its own segment so far), 1 for
    padding (it sees itself). O(R x length) memory: the picture :func:`tile_work` sums
    without drawing it."""
    work = np.ones((num_rows, length), dtype=np.float64)
    off = ragged_arange(seg.length)
    g = np.repeat(np.arange(seg.length.shape[0]), seg.length)
    work[seg.row[g], seg.row_start[g] + off] = seg.seq_start[g] + off + 1
    return work


def tile_work(seg: Segments, num_rows: int, length: int) -> np.ndarray:
    """[R, length / CP_ALIGN] int64 attention work of each ``CP_ALIGN``-token tile: the sums
    of :func:`attention_work` over each tile, in memory of one int64 per tile plus the
    pieces the segments cut the tiles into (tokens / CP_ALIGN + 2 per segment).

    A tile holds ``CP_ALIGN`` positions of work 1 (padding), and a real token at sequence
    position ``p`` adds ``p`` to that; a segment's positions ``lo..hi-1`` inside one tile
    add an arithmetic series, in closed form (exact integers).

    Args:
        seg: the rows' segments.
        num_rows: R.
        length: the padded row length, a multiple of ``CP_ALIGN``.
    """
    T = length // CP_ALIGN
    L = seg.length.astype(np.int64)
    real = np.flatnonzero(L > 0)
    a, L = seg.row_start[real].astype(np.int64), L[real]
    first, last = a // CP_ALIGN, (a + L - 1) // CP_ALIGN
    pieces = last - first + 1
    g = np.repeat(np.arange(real.shape[0]), pieces)  # the segment (of ``real``) of each piece
    tile = first[g] + ragged_arange(pieces)
    lo = np.maximum(tile * CP_ALIGN, a[g]) - a[g]  # the piece's offsets lo..hi-1 in its segment
    hi = np.minimum((tile + 1) * CP_ALIGN, a[g] + L[g]) - a[g]
    n = hi - lo
    extra = n * seg.seq_start[real][g].astype(np.int64) + (lo + hi - 1) * n // 2
    flat = seg.row[real][g].astype(np.int64) * T + tile
    # Float sums are exact here: every tile's sum is below CP_ALIGN * 2**31 (far below 2**53).
    out = np.bincount(flat, weights=extra, minlength=num_rows * T).astype(np.int64).reshape(num_rows, T)
    out += CP_ALIGN
    return out


def naive_tile_work(seg: Segments, num_rows: int, length: int) -> np.ndarray:
    """:func:`tile_work`, one position at a time (the reference)."""
    T = length // CP_ALIGN
    out = np.full((num_rows, T), CP_ALIGN, dtype=np.int64)
    for g in range(seg.length.shape[0]):
        for i in range(int(seg.length[g])):
            pos = int(seg.row_start[g]) + i
            out[int(seg.row[g]), pos // CP_ALIGN] += int(seg.seq_start[g]) + i
    return out


def cp_tiles_of(rows: int, seq_len: int, cp_size: int) -> int:
    """Tiles of the all-gather split of ``rows`` rows: ``rows x cp_size x shard_len / CP_ALIGN``
    (padding included), the cells of ``ranks.cp_tiles``."""
    return rows * cp_size * cp_shard_len(seq_len, cp_size) // CP_ALIGN


def check_cp_tiles(rows: int, seq_len: int, cp_size: int, limit: int | None) -> None:
    """Refuse an all-gather split of more than ``limit`` tiles (:func:`cp_tiles_of`) before it runs.

    The split holds an int32 per tile in the plan and an int64 per tile while it works:
    memory that grows with ``rows x seq_len``, padding included, not with the tokens.

    Raises:
        PayloadTooLargeError: over the limit (413), naming the figure and ``max_cp_tiles``.
    """
    tiles = cp_tiles_of(rows, seq_len, cp_size)
    if limit is not None and tiles > limit:
        raise PayloadTooLargeError(
            f"an allgather CP split of {rows} row{'s' * (rows != 1)} x {seq_len} positions (cp_size {cp_size}, "
            f"padding included) is {tiles} tiles of {CP_ALIGN} tokens, over the limit of {limit} (max_cp_tiles)",
            path="$.seq_len",
            rule="max_cp_tiles",
        )


def balance_tiles(
    tile_work: np.ndarray, cp_size: int, max_swaps: int | None = None, check: Callable[[], None] | None = None
) -> np.ndarray:
    """[R, T] int32 CP rank of each ``CP_ALIGN``-token tile (module docstring).

    Args:
        tile_work: [R, T] int64 work of each tile (:func:`tile_work`); T a multiple of
            ``cp_size``.
        cp_size: P.
        max_swaps: repair swaps a row may take before it falls back to the snake deal
            (default P).
        check: called inside the loops (per window round and per repaired row); it raises
            to stop the work (the sidecar's deadline and disconnects), or None.
    """
    tile_work = np.asarray(tile_work, dtype=np.int64)
    R, T = tile_work.shape
    heaviest = tile_work.max(1, initial=0)
    tiles = np.array(np.broadcast_to(_zigzag(T, cp_size), (R, T)))
    off = _spread(tile_work, tiles, cp_size) > heaviest
    tiles[off] = _window_split(tile_work[off], cp_size, check)
    for r in np.flatnonzero(_spread(tile_work, tiles, cp_size) > heaviest).tolist():
        if check is not None:
            check()
        tiles[r] = _repair(tile_work[r], tiles[r], cp_size, cp_size if max_swaps is None else max_swaps)
    return tiles


def naive_balance_tiles(tile_work: np.ndarray, cp_size: int, max_swaps: int | None = None) -> np.ndarray:
    """:func:`balance_tiles`, one row and one window at a time (the reference; a row outside
    the bound takes the same repair)."""
    R, T = tile_work.shape
    n = T // cp_size
    out = np.zeros((R, T), dtype=np.int32)
    half = (n + 1) // 2
    for r in range(R):
        tw = [int(tile_work[r, t]) for t in range(T)]
        for t in range(T):  # zigzag
            out[r, t] = t // half if t < cp_size * half else cp_size - 1 - (t - cp_size * half) // (n - half)
        loads = [sum(tw[t] for t in range(T) if out[r, t] == k) for k in range(cp_size)]
        if max(loads) - min(loads) <= max(tw, default=0):
            continue
        left = list(range(T))  # the tiles no rank holds yet, in cycle order
        for k in range(cp_size - 1):
            rest, m = sum(tw[t] for t in left), len(left)
            loads = [sum(tw[left[(s + i) % m]] for i in range(n)) for s in range(m)]
            # Nearest the share rest / (cp_size - k), first on ties (integers: exact).
            best = min(range(m), key=lambda s: (abs(loads[s] * (cp_size - k) - rest), s))
            for i in range(n):
                out[r, left[(best + i) % m]] = k
            left = [left[(best + n + i) % m] for i in range(m - n)]
        for t in left:
            out[r, t] = cp_size - 1
        loads = [sum(tw[t] for t in range(T) if out[r, t] == k) for k in range(cp_size)]
        if max(loads) - min(loads) > max(tw, default=0):
            out[r] = _repair(np.array(tw, dtype=np.int64), out[r], cp_size, cp_size if max_swaps is None else max_swaps)
    return out


def _zigzag(T: int, P: int) -> np.ndarray:
    """[T] int32: chunks r and 2P-1-r of the row to rank r (module docstring)."""
    n = T // P
    half = (n + 1) // 2
    t = np.arange(T)
    return np.where(t < P * half, t // half, P - 1 - (t - P * half) // max(n - half, 1)).astype(np.int32)


def _window_split(tile_work: np.ndarray, P: int, check: Callable[[], None] | None = None) -> np.ndarray:
    """[R, T] int32: the window split of every row at once (module docstring)."""
    R, T = tile_work.shape
    n = T // P
    rows = np.arange(R)
    tiles = np.full((R, T), P - 1, dtype=np.int32)
    left = np.broadcast_to(np.arange(T), (R, T))  # tiles no rank holds yet, in cycle order
    rest = tile_work.sum(1)
    for k in range(P - 1):
        if check is not None:
            check()
        m = left.shape[1]
        w = np.take_along_axis(tile_work, left, axis=1)
        c = np.zeros((R, m + n + 1), dtype=np.int64)
        np.cumsum(np.concatenate([w, w[:, :n]], axis=1), axis=1, out=c[:, 1:])
        win = c[:, n : n + m] - c[:, :m]  # the window starting at each tile of the cycle
        s = np.argmin(np.abs(win * (P - k) - rest[:, None]), axis=1)  # nearest the share (exact integers)
        tiles[rows[:, None], np.take_along_axis(left, (s[:, None] + np.arange(n)) % m, axis=1)] = k
        rest = rest - win[rows, s]
        left = np.take_along_axis(left, (s[:, None] + n + np.arange(m - n)) % m, axis=1)
    return tiles


def _spread(tile_work: np.ndarray, tiles: np.ndarray, P: int) -> np.ndarray:
    """[R] the heaviest rank's work minus the lightest's, per row."""
    R = tiles.shape[0]
    flat = (np.arange(R)[:, None] * P + tiles).ravel()
    load = np.bincount(flat, weights=tile_work.ravel(), minlength=R * P).reshape(R, P)  # integers below 2**53: exact
    return (load.max(1) - load.min(1)).astype(np.int64)


def _repair(tw: np.ndarray, tiles: np.ndarray, P: int, max_swaps: int) -> np.ndarray:
    """One row's split within the bound: swaps between the heaviest and lightest rank, or
    the snake deal (module docstring)."""
    t = tiles.copy()
    for _ in range(max_swaps):
        load = np.bincount(t, weights=tw, minlength=P)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = int(load[hi]) - int(load[lo])
        if gap <= tw.max():
            return t
        a, b = np.flatnonzero(t == hi), np.flatnonzero(t == lo)
        b = b[np.argsort(tw[b], kind="stable")]
        # Swapping a for b moves tw[a] - tw[b] from hi to lo; best: nearest half the gap,
        # tw[b] nearest tw[a] - gap / 2 (doubled: integers).
        want = 2 * tw[a] - gap
        j = np.searchsorted(2 * tw[b], want)
        below, above = np.maximum(j - 1, 0), np.minimum(j, b.shape[0] - 1)
        j = np.where(np.abs(2 * tw[b[below]] - want) <= np.abs(2 * tw[b[above]] - want), below, above)
        i = int(np.argmin(np.abs(gap - 2 * (tw[a] - tw[b[j]]))))
        t[a[i]], t[b[j[i]]] = lo, hi
    load = np.bincount(t, weights=tw, minlength=P)
    if load.max() - load.min() <= tw.max():
        return t
    return _snake(tw[None], P)[0]


def _snake(tile_work: np.ndarray, P: int) -> np.ndarray:
    """[R, T] int32: tiles heaviest first, dealt 0, 1, .., P-1, P-1, .., 0, 0, .. (always
    within the bound, any profile)."""
    R, T = tile_work.shape
    order = np.argsort(-tile_work, axis=1, kind="stable")
    s = np.arange(T)
    rnd, j = s // P, s % P
    snake = np.where(rnd % 2 == 0, j, P - 1 - j).astype(np.int32)
    tiles = np.empty((R, T), dtype=np.int32)
    np.put_along_axis(tiles, order, np.broadcast_to(snake, (R, T)), axis=1)
    return tiles


def assign_ranks(
    seg: Segments,
    num_rows: int,
    num_ranks: int,
    *,
    seq_len: int = 0,
    cp_size: int = 1,
    cp_attention: str = "auto",
    max_cp_tiles: int | None = None,
    check: Callable[[], None] | None = None,
) -> Ranks:
    """Deal rows to the ``num_ranks`` data-parallel ranks (module docstring); each row is
    then split over a CP group of ``cp_size`` ranks in shards of
    :func:`~treepack.proto.options.cp_shard_len` tokens.

    Args:
        seg, num_rows, num_ranks: the rows' segments, R, and the data-parallel ranks.
        seq_len, cp_size, cp_attention: the options of the CP split.
        max_cp_tiles: refuse an all-gather split of more tiles than this
            (:func:`check_cp_tiles`, before it runs); None: no limit.
        check: called inside the split's loops (:func:`balance_tiles`), or None.

    Raises:
        PayloadTooLargeError: the all-gather split is over ``max_cp_tiles``.
    """
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
        check_cp_tiles(num_rows, seq_len, cp_size, max_cp_tiles)
        tiles = balance_tiles(tile_work(seg, num_rows, cp_size * shard), cp_size, check=check)
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
