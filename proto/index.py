"""Vectorized index helpers shared by the planner, the wire codecs and the trainer.

Ragged arrays (CSR), parent-pointer forests and segment-to-row-position maps; numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "csr_index",
    "csr_gather",
    "ancestor_chains",
    "segment_rows",
    "segment_tokens",
    "ragged_arange",
    "forest_depth",
    "accumulate_up",
]


def csr_index(ptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions of the entries of ``rows`` in a CSR array, row after row.

    Args:
        ptr: [R+1] int64 offsets (row r is ``ptr[r]:ptr[r+1]``).
        rows: [n] int64 rows to take, in order (repeats allowed).

    Returns:
        [sum of their counts] int64, ``concat(arange(ptr[r], ptr[r+1]) for r in rows)``.
    """
    rows = np.asarray(rows, dtype=np.int64)
    counts = ptr[rows + 1] - ptr[rows]
    return np.repeat(ptr[rows], counts) + ragged_arange(counts)


def csr_gather(ptr: np.ndarray, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``values`` of the CSR rows ``rows``, concatenated: ``values[csr_index(ptr, rows)]``."""
    return values[csr_index(ptr, rows)]


def ancestor_chains(parent: np.ndarray, depth: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each node's chain in a parent-pointer forest, root first, the node itself last (CSR).

    One vectorized pass per level, all chains at once.

    Args:
        parent: [N] int64 parent of each node, -1 for roots.
        depth: [N] int64 depth (roots 0), as from :func:`forest_depth`.
        nodes: [n] int64 nodes whose chains to list; -1 gives an empty chain.

    Returns:
        (ptr [n+1] int64, chain [sum(depth[nodes] + 1)] int64).
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    live = nodes >= 0
    count = np.zeros(nodes.shape[0], dtype=np.int64)
    count[live] = depth[nodes[live]] + 1
    ptr = np.zeros(nodes.shape[0] + 1, dtype=np.int64)
    np.cumsum(count, out=ptr[1:])
    chain = np.empty(int(ptr[-1]), dtype=np.int64)
    pos = ptr[1:] - 1
    cur = nodes.copy()
    while live.any():
        chain[pos[live]] = cur[live]
        cur = np.where(live, parent[np.maximum(cur, 0)], -1)
        pos = pos - 1
        live = cur >= 0
    return ptr, chain


def segment_rows(seg, segs: np.ndarray) -> np.ndarray:
    """Row-local indices (``0 .. C-1``) of the tokens of segments ``segs``, in order.

    Args:
        seg: a :class:`~treepack.proto.plan.Segments` table.
        segs: [n] int64 segment indices.

    Returns:
        [sum of their lengths] int64.
    """
    lens = seg.length[segs]
    return np.repeat(seg.row_start[segs], lens) + ragged_arange(lens)


def segment_tokens(seg, seq_len: int, segs: np.ndarray) -> np.ndarray:
    """Flat row positions (``row * seq_len + index``) of the tokens of ``segs``, in order.

    Args:
        seg: a :class:`~treepack.proto.plan.Segments` table.
        seq_len: row capacity C.
        segs: [n] int64 segment indices.

    Returns:
        [sum of their lengths] int64.
    """
    return np.repeat(seg.row[segs] * seq_len, seg.length[segs]) + segment_rows(seg, segs)


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(c)`` for each c in ``counts`` ([sum(counts)] int64)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def forest_depth(parent: np.ndarray) -> np.ndarray:
    """[n] int64 depth of each entry of a parent-pointer forest (roots have parent -1).

    One vectorized pass per level, O(n * max depth).
    """
    depth = np.zeros(parent.shape[0], dtype=np.int64)
    cur = parent.copy()
    while True:
        live = cur >= 0
        if not live.any():
            return depth
        depth += live
        cur = np.where(live, parent[np.maximum(cur, 0)], -1)


def accumulate_up(values: np.ndarray, parent: np.ndarray, depth: np.ndarray, ufunc: np.ufunc = np.add) -> np.ndarray:
    """Fold every subtree into its root: ``out[v] = ufunc(values[v], out[children of v]...)``.

    Args:
        values: [n] per-entry values (copied, not modified).
        parent: [n] parent index, -1 for roots.
        depth: [n] depth (roots 0), as from :func:`forest_depth`.
        ufunc: ``np.add`` for subtree sums, ``np.maximum`` for subtree maxima.

    Returns:
        [n] the folded values.
    """
    out = values.copy()
    for d in range(int(depth.max(initial=0)), 0, -1):
        at = np.flatnonzero(depth == d)
        ufunc.at(out, parent[at], out[at])
    return out


__all__ += ["local_row_index", "localize_flat", "row_segments"]


def local_row_index(rows: np.ndarray, num_rows: int) -> np.ndarray:
    """[num_rows] int64 position of each global row in ``rows``, -1 where it is absent.

    Args:
        rows: [K] int64 global rows held locally (a rank's rows), -1 for an empty padding row.
        num_rows: R, the plan's rows.
    """
    rows = np.asarray(rows, dtype=np.int64)
    out = np.full(num_rows, -1, dtype=np.int64)
    real = np.flatnonzero(rows >= 0)
    out[rows[real]] = real
    return out


def localize_flat(flat: np.ndarray, local_of_row: np.ndarray, seq_len: int) -> np.ndarray:
    """Plan-wide flat positions (``row * seq_len + index``) -> local ones (``local_row * seq_len + index``).

    Args:
        flat: int64 positions, any shape; -1 means none.
        local_of_row: [R] from :func:`local_row_index`.
        seq_len: row capacity C.

    Returns:
        Same shape; -1 stays -1 and a position in a row not held locally becomes -1.
    """
    flat = np.asarray(flat, dtype=np.int64)
    at = np.maximum(flat, 0)
    local = local_of_row[at // seq_len]
    return np.where((flat >= 0) & (local >= 0), local * seq_len + at % seq_len, -1)


def row_segments(row_ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments of the locally held rows, in row order (pre-order inside each row).

    Args:
        row_ptr: [R+1] int64 each row's segment range (``Segments.row_ptr``).
        rows: [K] int64 global rows held locally, -1 for an empty padding row.

    Returns:
        (segment ids [G_local], their local rows [G_local]).
    """
    rows = np.asarray(rows, dtype=np.int64)
    real = np.flatnonzero(rows >= 0)
    n = row_ptr[rows[real] + 1] - row_ptr[rows[real]]
    return np.repeat(row_ptr[rows[real]], n) + ragged_arange(n), np.repeat(real, n)
