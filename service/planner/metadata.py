"""Kernel metadata derived from the segment tables (SPEC section 5).

- Attention: each segment's ancestor chain (root first, itself last). For a varlen kernel
  the segment is the query block and its chain the keys, causal aligned bottom-right: the
  chain holds exactly the positions ``0 .. seq_start + length - 1`` of its sequence.
- Gated DeltaNet: segments grouped by depth across all rows. Level d runs as one varlen
  call (``cu_seqlens`` int32 from 0); a segment's initial recurrent state is its parent's
  final state (``parent_slot`` indexes the previous level), roots start from zero. The
  short causal conv of width W needs, at a segment's start, the last W-1 inputs along its
  ancestor chain, which may span several short ancestors: ``conv_context`` holds their
  flat row positions (``row * seq_len + index``), oldest first, -1 where the chain is
  shorter (zero padding, as at a sequence start).
"""

from __future__ import annotations

import numpy as np

from treepack.proto.index import ancestor_chains
from treepack.proto.plan import AttentionMeta, GdnLevel, GdnMeta, Segments

__all__ = ["attention_meta", "gdn_meta", "naive_conv_context"]


def attention_meta(seg: Segments) -> AttentionMeta:
    """Ancestor chains of every segment, vectorized (one pass per depth level)."""
    ptr, out = ancestor_chains(seg.parent, seg.depth, np.arange(seg.num_segments, dtype=np.int64))
    return AttentionMeta(anc_ptr=ptr, anc_segs=out, key_lens=seg.seq_start + seg.length)


def _conv_context(seg: Segments, seq_len: int, width: int) -> np.ndarray:
    """[G, W-1] flat row positions of the W-1 inputs before each segment on its chain."""
    g = seg.num_segments
    k = width - 1
    out = np.full((g, max(k, 0)), -1, dtype=np.int64)
    if k <= 0 or g == 0:
        return out
    base = seg.row * seq_len + seg.row_start  # flat position of each segment's first token
    for back in range(1, k + 1):
        # The `back`-th input before segment i's start: walk up while the ancestor is
        # shorter than what remains.
        cur = seg.parent.copy()
        rem = np.full(g, back, dtype=np.int64)
        live = cur >= 0
        while True:
            c = np.maximum(cur, 0)
            deeper = live & (rem > seg.length[c])
            if not deeper.any():
                break
            rem = np.where(deeper, rem - seg.length[c], rem)
            cur = np.where(deeper, seg.parent[c], cur)
            live = live & (cur >= 0)
        c = np.maximum(cur, 0)
        val = base[c] + seg.length[c] - rem
        out[:, k - back] = np.where(live, val, -1)
    return out


def naive_conv_context(seg: Segments, seq_len: int, width: int) -> np.ndarray:
    """Reference for ``conv_context``: concatenate each chain's flat positions, take the tail."""
    g = seg.num_segments
    k = width - 1
    out = np.full((g, max(k, 0)), -1, dtype=np.int64)
    parent, row, row_start, length = (a.tolist() for a in (seg.parent, seg.row, seg.row_start, seg.length))
    for i in range(g):
        # The ancestors nearest first, then concatenated root first (once: prepending each
        # would cost depth squared per segment on a deep tree).
        parts: list[range] = []
        p = parent[i]
        while p >= 0:
            b = row[p] * seq_len + row_start[p]
            parts.append(range(b, b + length[p]))
            p = parent[p]
        chain = [v for part in reversed(parts) for v in part]
        tail = chain[-k:] if k > 0 else []
        for j, v in enumerate(tail):
            out[i, k - len(tail) + j] = v
    return out


def gdn_meta(seg: Segments, seq_len: int, conv_width: int = 4) -> GdnMeta:
    """GDN levels and conv context for every segment (module docstring)."""
    ctx = _conv_context(seg, seq_len, conv_width)
    levels = []
    slot = np.full(seg.num_segments, -1, dtype=np.int64)
    for d in range(int(seg.depth.max(initial=-1)) + 1):
        segs = np.flatnonzero(seg.depth == d)
        slot[segs] = np.arange(segs.shape[0])
        cu = np.zeros(segs.shape[0] + 1, dtype=np.int32)
        np.cumsum(seg.length[segs], out=cu[1:])
        par = seg.parent[segs]
        levels.append(
            GdnLevel(
                depth=d,
                segs=segs,
                cu_seqlens=cu,
                parent=par,
                parent_slot=np.where(par >= 0, slot[np.maximum(par, 0)], -1),
                conv_context=ctx[segs],
            )
        )
    return GdnMeta(conv_width=conv_width, levels=tuple(levels))
