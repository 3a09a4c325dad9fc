"""Vectorized index helpers shared by the planner, the wire codecs and the trainer.

Ragged arrays (CSR), parent-pointer forests and segment-to-row-position maps; numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ragged_arange", "forest_depth", "accumulate_up", "segment_tokens"]


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


def segment_tokens(seg, seq_len: int, segs: np.ndarray) -> np.ndarray:
    """Flat row positions (``row * seq_len + index``) of the tokens of ``segs``, in order.

    Args:
        seg: a :class:`~treepack.proto.plan.Segments` table.
        seq_len: row capacity C.
        segs: [n] int64 segment indices.

    Returns:
        [sum of their lengths] int64.
    """
    lens = seg.length[segs]
    return np.repeat(seg.row[segs] * seq_len + seg.row_start[segs], lens) + ragged_arange(lens)
