"""The tree mask in the three forms attention kernels take (SPEC 3 and 7).

Mask contract: query i may attend key j iff ``j <= i and i < subtree_end[j]``; padding
attends only itself. With a sliding window w (HF semantics) additionally
``position_ids[i] - position_ids[j] < w``; with chunked attention of chunk size c (Llama4)
additionally ``position_ids[i] // c == position_ids[j] // c``: the same chunk of the
sequence's own positions (on a tree row both are positions of i's sequence, since j is
on i's ancestor chain).

- :func:`dense_mask`: [K, 1, L, L] bool, the reference (SDPA on CPU).
- :func:`block_mask`: a FlexAttention ``BlockMask`` holding exactly the blocks with a
  visible pair, windows and chunks included (defined in
  :mod:`~treepack.trainer.kernels.blocks`, with :func:`key_floor`, :func:`tree_mask_mod`
  and :func:`naive_block_mask`; named here too, beside the other forms).
- :func:`varlen_meta`: per segment, its queries and the gathered keys of its ancestor chain,
  for FlashAttention's varlen kernel with bottom-right causal alignment; with a chunk
  size, per (segment, chunk) piece, its chain cut to the chunk. The ``flash`` backend runs
  this gathered layout for windowed and chunked layers and as the reference; full
  attention reads the rows in place instead
  (:mod:`~treepack.trainer.kernels.varlen_levels`).

Each has a slow reference beside it (``naive_*``) that tests compare against. All are built
from arrays (``subtree_end``, ``position_ids``, the plan's segment table and ancestor
chains), never from the packed batch; :class:`~treepack.trainer.data.PackedBatch` calls
them and caches the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.index import csr_gather, local_row_index, localize_flat, ragged_arange, row_segments, segment_tokens
from treepack.proto.plan import Plan
from treepack.trainer.kernels.blocks import block_mask, check_chunk, key_floor, naive_block_mask, tree_mask_mod
from treepack.trainer.kernels.index import index_tensor

__all__ = [
    "dense_mask",
    "naive_dense_mask",
    "block_mask",
    "naive_block_mask",
    "key_floor",
    "tree_mask_mod",
    "VarlenMeta",
    "varlen_meta",
    "naive_varlen_meta",
]


def dense_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[K, 1, L, L] bool tree mask from the interval contract (vectorized).

    Args:
        subtree_end: [K, L] int64 the rows' subtree ends.
        position_ids: [K, L] int64, needed with a sliding window or a chunk size.
        sliding_window: optional window w: keys at most w-1 positions back.
        chunk_size: optional chunk size c: keys in the query's chunk of positions only.
    """
    check_chunk(chunk_size)
    L = subtree_end.shape[1]
    idx = torch.arange(L, device=subtree_end.device)
    m = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, :, None] < subtree_end[:, None, :])
    if sliding_window is not None:
        assert position_ids is not None, "a sliding window or a chunk size needs position_ids"
        m &= (position_ids[:, :, None] - position_ids[:, None, :]) < sliding_window
    if chunk_size is not None:
        assert position_ids is not None, "a sliding window or a chunk size needs position_ids"
        c = position_ids // chunk_size
        m &= c[:, :, None] == c[:, None, :]
    return m[:, None]


def _naive_row_mask(plan: Plan, r: int, L: int) -> np.ndarray:
    """[L, L] bool mask of global row r from the ancestor relation, padding seeing itself."""
    seg = plan.segments
    m = np.zeros((L, L), dtype=bool)
    n = 0 if r < 0 else int(seg.row_len[r])
    for g in range(0 if r < 0 else int(seg.row_ptr[r]), 0 if r < 0 else int(seg.row_ptr[r + 1])):
        a, k = int(seg.row_start[g]), int(seg.length[g])
        for i in range(k):
            m[a + i, a : a + i + 1] = True
        p = int(seg.parent[g])
        while p >= 0:
            m[a : a + k, int(seg.row_start[p]) : int(seg.row_start[p] + seg.length[p])] = True
            p = int(seg.parent[p])
    for i in range(n, L):
        m[i, i] = True
    return m


def naive_dense_mask(
    plan: Plan,
    rows: np.ndarray,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    device: Any = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Reference for :func:`dense_mask`: the ancestor relation of the segment table, row by row.

    Uses no interval arithmetic: each token sees its segment's earlier tokens and every
    token of its ancestor segments (walking parent pointers); padding and empty rows
    (``rows == -1``) see only themselves.

    Args:
        plan: the plan. rows: [K] its global rows, -1 for an empty row.
        position_ids, sliding_window, chunk_size: as :func:`dense_mask`.
        device: where the mask goes.
    """
    L = plan.seq_len
    out = np.stack([_naive_row_mask(plan, int(r), L) for r in rows]) if len(rows) else np.zeros((0, L, L), bool)
    if sliding_window is not None or chunk_size is not None:
        assert position_ids is not None, "a sliding window or a chunk size needs position_ids"
        pos = position_ids.cpu().numpy()
    if sliding_window is not None:
        for k in range(out.shape[0]):
            for i in range(L):
                for j in range(L):
                    if pos[k, i] - pos[k, j] >= sliding_window:
                        out[k, i, j] = False
    if chunk_size is not None:
        for k in range(out.shape[0]):
            for i in range(L):
                for j in range(L):
                    if pos[k, i] // chunk_size != pos[k, j] // chunk_size:
                        out[k, i, j] = False
    return torch.from_numpy(out)[:, None].to(device)


@dataclass(frozen=True, slots=True, kw_only=True)
class VarlenMeta:
    """Varlen attention over gathered ancestor keys: one varlen sequence per segment.

    Flat positions index the rows flattened to [K * L]. Segment g's queries are its own
    tokens; its keys are the tokens of its ancestor chain, root first, then its own: the
    positions 0 .. seq_start + length - 1 of its sequence, so causal attention aligned
    bottom-right (FlashAttention >= 2.1 when seqlen_q != seqlen_k) is exactly the tree mask.

    Attributes:
        segments: [G] int64 global segment ids, in row order.
        q_index: [Tq] int64 flat positions of the queries (all non-padding tokens).
        k_index: [Tk] int64 flat positions of the gathered keys.
        cu_seqlens_q: [G+1] int32 from 0.
        cu_seqlens_k: [G+1] int32 from 0.
        max_seqlen_q: longest segment.
        max_seqlen_k: longest chain.
        pad_index: [P] int64 flat positions of padding (they attend only themselves).
    """

    segments: np.ndarray
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    pad_index: torch.Tensor


def _meta(
    size: int, device: Any, segs: np.ndarray, q: np.ndarray, k: np.ndarray, qlen: np.ndarray, klen: np.ndarray
) -> VarlenMeta:
    used = np.zeros(size, dtype=bool)
    used[q] = True
    cu_q = np.zeros(segs.shape[0] + 1, dtype=np.int32)
    cu_k = np.zeros(segs.shape[0] + 1, dtype=np.int32)
    np.cumsum(qlen, out=cu_q[1:])
    np.cumsum(klen, out=cu_k[1:])
    return VarlenMeta(
        segments=segs,
        q_index=index_tensor(q, device),
        k_index=index_tensor(k, device),
        cu_seqlens_q=index_tensor(cu_q, device, torch.int32),
        cu_seqlens_k=index_tensor(cu_k, device, torch.int32),
        max_seqlen_q=int(qlen.max(initial=0)),
        max_seqlen_k=int(klen.max(initial=0)),
        pad_index=index_tensor(np.flatnonzero(~used), device),
    )


def varlen_meta(plan: Plan, rows: np.ndarray, device: Any = None, chunk_size: int | None = None) -> VarlenMeta:
    """:class:`VarlenMeta` from the plan's ancestor chains (vectorized, no per-token loop).

    Args:
        plan: the plan (segment table and ``attention`` ancestor chains).
        rows: [K] int64 the global rows stacked locally, -1 for an empty row.
        device: where the index tensors go.
        chunk_size: optional chunk size c (chunked attention): each segment is cut at the
            chunk boundaries of its sequence's positions into pieces; a piece's keys are its
            chain from the chunk's first position (``segments`` then lists each piece's
            segment, one entry per piece).
    """
    check_chunk(chunk_size)
    seg, att = plan.segments, plan.attention
    L = plan.seq_len
    segs, _ = row_segments(seg.row_ptr, rows)
    local_of_row = local_row_index(rows, plan.num_rows)
    qlen = seg.length[segs]
    q = localize_flat(segment_tokens(seg, L, segs), local_of_row, L)
    chain = csr_gather(att.anc_ptr, att.anc_segs, segs)
    k = localize_flat(segment_tokens(seg, L, chain), local_of_row, L)
    klen = att.key_lens[segs]
    assert int(klen.sum()) == k.shape[0], "ancestor chains do not add up to key_lens"
    if chunk_size is not None:
        segs, q, k, qlen, klen = _chunk_pieces(segs, seg.seq_start[segs], q, k, qlen, klen, chunk_size)
    return _meta(len(rows) * L, device, segs, q, k, qlen, klen)


def _chunk_pieces(segs, start, q, k, qlen, klen, c):
    """Cut each varlen sequence (a segment: queries at positions start..start+qlen-1 of its
    sequence, keys at positions 0..start+qlen-1) into one piece per chunk of positions."""
    end = start + qlen
    first = start // c
    n = np.where(qlen > 0, (end - 1) // c - first + 1, 0)
    g = np.repeat(np.arange(segs.shape[0]), n)
    m = np.repeat(first, n) + ragged_arange(n)
    qa = np.maximum(start[g], m * c)
    qb = np.minimum(end[g], (m + 1) * c)
    q_ptr = np.concatenate([[0], np.cumsum(qlen)])[:-1]
    k_ptr = np.concatenate([[0], np.cumsum(klen)])[:-1]
    pq, pk = qb - qa, qb - m * c
    q_pos = np.repeat(q_ptr[g] + qa - start[g], pq) + ragged_arange(pq)
    k_pos = np.repeat(k_ptr[g] + m * c, pk) + ragged_arange(pk)
    return segs[g], q[q_pos], k[k_pos], pq, pk


def naive_varlen_meta(plan: Plan, rows: np.ndarray, device: Any = None, chunk_size: int | None = None) -> VarlenMeta:
    """Reference for :func:`varlen_meta` (same arguments): walks parent pointers segment by
    segment, then (with a chunk size) cuts queries and keys position by position."""
    seg = plan.segments
    L = plan.seq_len
    segs, qs, ks, qlen, klen = [], [], [], [], []
    for k_local, r in enumerate(np.asarray(rows).tolist()):
        if r < 0:
            continue
        for g in range(int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])):
            base = k_local * L
            own = list(range(base + int(seg.row_start[g]), base + int(seg.row_start[g] + seg.length[g])))
            keys = list(own)
            p = int(seg.parent[g])
            while p >= 0:
                keys = list(range(base + int(seg.row_start[p]), base + int(seg.row_start[p] + seg.length[p]))) + keys
                p = int(seg.parent[p])
            pieces = [(own, keys)]
            if chunk_size is not None:
                s0 = int(seg.seq_start[g])  # keys[t] is position t of the sequence
                chunks = sorted({(s0 + i) // chunk_size for i in range(len(own))})
                pieces = [
                    (
                        [x for i, x in enumerate(own) if (s0 + i) // chunk_size == m],
                        [x for t, x in enumerate(keys) if t // chunk_size == m and t < s0 + len(own)],
                    )
                    for m in chunks
                ]
            for qp, kp in pieces:
                segs.append(g)
                qs += qp
                ks += kp
                qlen.append(len(qp))
                klen.append(len(kp))
    arr = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return _meta(len(rows) * L, device, arr(segs), arr(qs), arr(ks), arr(qlen), arr(klen))
