"""Varlen calls that read every key and value in place: one call per tree level (SPEC 8).

The gathered varlen layout (:func:`~treepack.trainer.kernels.masks.varlen_meta`) copies each
segment's ancestor chain: for 8 completions of one prompt, 8 copies of the prompt's keys and
values per layer. Here nothing is copied. A query's keys are its own segment's earlier
tokens plus every token of each ancestor segment, and both kinds are contiguous row ranges:

- the **own level**: one varlen sequence per segment (queries = keys = the segment, causal)
  and one length-1 sequence per padding token (it sees itself), in row order, so the
  sequences tile the flattened rows ``[0, K * L)`` on both sides: queries, keys, values and
  the output are the rows themselves (no gather, no scatter);
- one **ancestor level** per tree depth d: every segment A at depth d that has descendants
  in its row is one sequence whose queries are A's strict subtree ``[end_A, subtree_end_A)``
  and whose keys are A's tokens ``[start_A, end_A)``, every pair visible (not causal). Within
  a level both sides are disjoint and in row order; the gaps between them become sequences
  with no keys (``(gap, 0)``) or no queries (``(0, gap)``), so the call reads the rows in
  place over the level's span, and a gap row is never read back (:attr:`VarlenLevel.q_valid`,
  :attr:`VarlenLevel.k_valid`).

Each query's attention is then the log-sum-exp merge of its own-level result and one
result per ancestor (:mod:`~treepack.trainer.kernels.varlen_merge`). Positions are flat:
``local_row * L + index``. :func:`naive_varlen_levels` is the loop reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.index import ragged_arange, row_segments
from treepack.proto.plan import Plan
from treepack.trainer.kernels.index import index_tensor

__all__ = ["VarlenLevel", "VarlenLevels", "varlen_levels", "naive_varlen_levels"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VarlenLevel:
    """One varlen call over a span of the flattened rows.

    Attributes:
        q_start, q_end: the call's queries are flat positions ``q_start .. q_end - 1``.
        k_start, k_end: its keys and values are ``k_start .. k_end - 1``.
        cu_seqlens_q: [n+1] int32 from 0, offsets inside the query span (they end at its length).
        cu_seqlens_k: [n+1] int32 from 0, offsets inside the key span.
        max_seqlen_q, max_seqlen_k: longest real sequence (gap sequences may be longer; no
            row of theirs is read back).
        causal: own level (bottom-right causal, equal lengths) or ancestor level (all visible).
        q_valid: [q_end - q_start] bool, the queries of real sequences; None: all.
        k_valid: [k_end - k_start] bool, the keys of real sequences; None: all.
        pairs: visible (query, key) pairs of the call.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    q_valid: torch.Tensor | None
    k_valid: torch.Tensor | None
    pairs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class VarlenLevels:
    """The own level, then one ancestor level per tree depth (module docstring).

    Attributes:
        size: K * L, the flattened rows.
        levels: the calls, own level first.
    """

    size: int
    levels: tuple[VarlenLevel, ...]

    @property
    def keys_read(self) -> int:
        """Key (and value) rows the calls read in place, summed over the calls (gaps excluded)."""
        own = self.levels[0].k_end - self.levels[0].k_start if self.levels else 0
        return own + sum(int(lv.k_valid.sum()) for lv in self.levels[1:] if lv.k_valid is not None)


def _level(qa: np.ndarray, qb: np.ndarray, ka: np.ndarray, kb: np.ndarray, causal: bool, device: Any) -> VarlenLevel:
    """A call over the real sequences ``[qa, qb) x [ka, kb)`` ([n] int64 each; both sides
    disjoint and ascending, every sequence with queries and keys).

    Gaps become ``(gap, 0)`` and ``(0, gap)`` sequences so that the sequences tile the
    spans ``[qa[0], qb[-1])`` and ``[ka[0], kb[-1])``.
    """
    qs, qe, ks, ke = int(qa[0]), int(qb[-1]), int(ka[0]), int(kb[-1])
    n = qa.shape[0]
    gap_q = qa - np.concatenate([[qs], qb[:-1]])
    gap_k = ka - np.concatenate([[ks], kb[:-1]])
    nq = np.stack([gap_q, np.zeros(n, np.int64), qb - qa], 1).reshape(-1)
    nk = np.stack([np.zeros(n, np.int64), gap_k, kb - ka], 1).reshape(-1)
    keep = (nq > 0) | (nk > 0)
    nq, nk = nq[keep], nk[keep]
    cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q_valid = k_valid = None
    if not (gap_q == 0).all():
        qv = np.zeros(qe - qs, dtype=bool)
        qv[np.repeat(qa - qs, qb - qa) + ragged_arange(qb - qa)] = True
        q_valid = torch.from_numpy(qv).to(device)
    if not (gap_k == 0).all():
        kv = np.zeros(ke - ks, dtype=bool)
        kv[np.repeat(ka - ks, kb - ka) + ragged_arange(kb - ka)] = True
        k_valid = torch.from_numpy(kv).to(device)
    lq, lk = qb - qa, kb - ka
    pairs = int((lq * (lq + 1) // 2).sum()) if causal else int((lq * lk).sum())
    return VarlenLevel(
        q_start=qs,
        q_end=qe,
        k_start=ks,
        k_end=ke,
        cu_seqlens_q=index_tensor(cu_q, device, torch.int32),
        cu_seqlens_k=index_tensor(cu_k, device, torch.int32),
        max_seqlen_q=int(lq.max()),
        max_seqlen_k=int(lk.max()),
        causal=causal,
        q_valid=q_valid,
        k_valid=k_valid,
        pairs=pairs,
    )


def varlen_levels(plan: Plan, rows: np.ndarray, device: Any = None) -> VarlenLevels:
    """:class:`VarlenLevels` of the local rows from the plan's segment table (vectorized).

    Args:
        plan: the plan.
        rows: [K] int64 the global rows stacked locally, -1 for an empty row.
        device: where the index tensors go.
    """
    seg, L = plan.segments, plan.seq_len
    K = len(rows)
    segs, local = row_segments(seg.row_ptr, rows)
    start = local * L + seg.row_start[segs]
    end = start + seg.length[segs]
    sub = local * L + seg.subtree_end[segs]
    used = np.zeros(K * L, dtype=bool)
    used[np.repeat(start, seg.length[segs]) + ragged_arange(seg.length[segs])] = True
    # Own level: every segment, and every padding position as its own sequence, in row order.
    first = np.sort(np.concatenate([start, np.flatnonzero(~used)]))
    last = np.concatenate([first[1:], [K * L]])
    levels = [_level(first, last, first, last, True, device)] if K * L else []
    depth = seg.depth[segs]
    for d in range(int(depth.max(initial=-1)) + 1):
        sel = np.flatnonzero((depth == d) & (sub > end))
        if sel.shape[0]:
            levels.append(_level(end[sel], sub[sel], start[sel], end[sel], False, device))
    return VarlenLevels(size=K * L, levels=tuple(levels))


def naive_varlen_levels(plan: Plan, rows: np.ndarray, device: Any = None) -> VarlenLevels:
    """Reference for :func:`varlen_levels` (same arguments): walks parent pointers.

    Each segment's strict subtree is found as the segments whose parent chain reaches it
    (no ``subtree_end``); padding is every position no segment holds; each level lists its
    (queries, keys) ranges in row order and goes through the same tiling.
    """
    seg, L = plan.segments, plan.seq_len
    K = len(rows)
    owned: dict[int, tuple[int, int, int]] = {}  # segment -> (start, end, depth)
    for k_local, r in enumerate(np.asarray(rows).tolist()):
        if r < 0:
            continue
        for g in range(int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])):
            a = k_local * L + int(seg.row_start[g])
            d, p = 0, int(seg.parent[g])
            while p >= 0:
                d, p = d + 1, int(seg.parent[p])
            owned[g] = (a, a + int(seg.length[g]), d)
    used: set[int] = set()
    for a, b, _ in owned.values():
        used.update(range(a, b))
    own = sorted([(a, b) for a, b, _ in owned.values()] + [(i, i + 1) for i in range(K * L) if i not in used])
    levels = []
    if own:
        f = np.array([a for a, _ in own])
        e = np.array([b for _, b in own])
        levels.append(_level(f, e, f, e, True, device))
    for d in range(max((x[2] for x in owned.values()), default=-1) + 1):
        ranges = []
        for g, (a, b, dg) in owned.items():
            if dg != d:
                continue
            below = []
            for h, (ha, hb, _) in owned.items():
                p = int(seg.parent[h])
                while p >= 0 and p != g:
                    p = int(seg.parent[p])
                if p == g:
                    below.append((ha, hb))
            if below:
                ranges.append((min(x for x, _ in below), max(y for _, y in below), a, b))
        if ranges:
            ranges.sort()
            qa, qb, ka, kb = (np.array(c) for c in zip(*ranges))
            levels.append(_level(qa, qb, ka, kb, False, device))
    return VarlenLevels(size=K * L, levels=tuple(levels))
