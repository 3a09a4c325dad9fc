"""Plan invariants of the rows and the trees in them, and the reference token mask.

- rows: segments tile ``[0, row_len)`` contiguously in pre-order, ``row_len <= seq_len``;
- tree: every parent precedes its child in the same row, depths follow parents, and
  ``subtree_end`` is where the subtree ends;
- mask: the interval form (``j <= i < subtree_end[j]``) equals the ancestor relation,
  segment by segment for every row (and token by token via :func:`naive_tree_mask` when
  ``dense_check_max`` allows);
- sequences: each kept sequence's segments form a root-to-leaf chain in its row that
  covers positions ``0 .. len-1`` exactly once, strictly increasing in the row; every
  segment's ``sharers`` counts the sequences through it; dropped sequences have none.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.plan import Plan
from treepack.service.planner.invariant import _check

__all__ = ["naive_tree_mask", "interval_mask", "check_rows", "check_row_trees", "check_sequences"]


def naive_tree_mask(plan: Plan, r: int) -> np.ndarray:
    """[L, L] bool reference mask of row r from the ancestor relation, L = row_len.

    ``m[i, j]`` is True iff token j is i itself, an earlier token of i's segment, or a
    token of an ancestor segment (walking parent pointers; no interval arithmetic).
    """
    seg = plan.segments
    lo, hi = int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])
    L = int(seg.row_len[r])
    m = np.zeros((L, L), dtype=bool)
    for g in range(lo, hi):
        a, n = int(seg.row_start[g]), int(seg.length[g])
        for i in range(n):
            m[a + i, a : a + i + 1] = True
        p = int(seg.parent[g])
        while p >= 0:
            pa, pn = int(seg.row_start[p]), int(seg.length[p])
            m[a : a + n, pa : pa + pn] = True
            p = int(seg.parent[p])
    return m


def interval_mask(subtree_end: np.ndarray) -> np.ndarray:
    """[L, L] bool mask of the interval contract: ``m[i, j] = j <= i < subtree_end[j]``."""
    L = subtree_end.shape[0]
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    return (j <= i) & (i < subtree_end[None, :])


def check_rows(plan: Plan) -> None:
    """Rows: CSR bounds, capacity, contiguous tiling."""
    seg = plan.segments
    C, R, G = plan.seq_len, plan.num_rows, seg.num_segments
    _check(seg.row_ptr.shape == (R + 1,) and seg.row_ptr[0] == 0 and seg.row_ptr[-1] == G, "row_ptr shape/ends")
    _check(bool(np.all(np.diff(seg.row_ptr) >= 0)), "row_ptr not monotone")
    _check(bool(np.all(seg.row == np.repeat(np.arange(R), np.diff(seg.row_ptr)))), "segments not grouped by row")
    _check(bool(np.all(seg.length >= 1)), "empty segment in a row")
    _check(bool(np.all(seg.row_len <= C)), f"row over capacity: max {int(seg.row_len.max(initial=0))} > {C}")
    _check(bool(np.all(seg.row_len == np.bincount(seg.row, weights=seg.length, minlength=R))), "row_len != segment sum")
    expect_start = np.cumsum(seg.length) - seg.length
    if G:
        expect_start = expect_start - expect_start[seg.row_ptr[seg.row]]
    _check(bool(np.array_equal(seg.row_start, expect_start)), "segments do not tile their row contiguously")


def check_row_trees(plan: Plan, dense_check_max: int) -> None:
    """The tree inside each row: parents, depths, positions, subtree ends, the mask."""
    seg = plan.segments
    C, R, G = plan.seq_len, plan.num_rows, seg.num_segments
    # Tree shape inside rows.
    par = seg.parent
    has = par >= 0
    idx = np.arange(G)
    _check(bool(np.all(par[has] < idx[has])), "parent does not precede child")
    _check(bool(np.all(seg.row[par[has]] == seg.row[has])), "parent in another row")
    _check(
        bool(np.all(seg.depth[~has] == 0)) and bool(np.all(seg.depth[has] == seg.depth[par[has]] + 1)), "depth mismatch"
    )
    _check(
        bool(np.all(seg.seq_start[has] == seg.seq_start[par[has]] + seg.length[par[has]])),
        "child does not continue its parent's positions",
    )
    _check(bool(np.all(seg.seq_start[~has] == 0)), "row root does not start at position 0")
    for r in range(R):
        lo, hi = int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])
        k = hi - lo
        if k == 0:
            continue
        d = seg.depth[lo:hi]
        starts = seg.row_start[lo:hi]
        end_row = int(seg.row_len[r])
        # Naive subtree end: next segment at depth <= own depth, else the row's end.
        exp = np.empty(k, dtype=np.int64)
        stack: list[int] = []
        for i in range(k):
            while stack and d[stack[-1]] >= d[i]:
                exp[stack.pop()] = starts[i]
            stack.append(i)
        for i in stack:
            exp[i] = end_row
        _check(bool(np.array_equal(exp, seg.subtree_end[lo:hi])), f"subtree_end wrong in row {r}")
        # Segment-level mask == ancestor relation.
        anc = np.zeros((k, k), dtype=bool)
        for i in range(k):
            p = int(par[lo + i])
            while p >= 0:
                anc[i, p - lo] = True
                p = int(par[p])
        sub_end = seg.subtree_end[lo:hi]
        inside = (starts[None, :] < starts[:, None]) & (starts[:, None] < sub_end[None, :])
        _check(bool(np.array_equal(inside, anc)), f"interval mask != ancestor relation in row {r}")
        if end_row <= dense_check_max:
            se = np.repeat(seg.subtree_end[lo:hi], seg.length[lo:hi])  # this row's per-token subtree_end
            _check(bool(np.array_equal(interval_mask(se), naive_tree_mask(plan, r))), f"token mask mismatch in row {r}")

    if C <= dense_check_max:
        # The per-token form the trainer uses: segment subtree ends, padding sees itself.
        full = plan.subtree_end()
        for r in range(R):
            lo, hi, L = int(seg.row_ptr[r]), int(seg.row_ptr[r + 1]), int(seg.row_len[r])
            want = np.concatenate([np.repeat(seg.subtree_end[lo:hi], seg.length[lo:hi]), np.arange(L, C) + 1])
            _check(bool(np.array_equal(full[r], want)), f"Plan.subtree_end() wrong in row {r}")


def check_sequences(plan: Plan) -> None:
    """Every placed sequence is one root-to-leaf chain of its row; sharer counts."""
    seg = plan.segments
    G, S = seg.num_segments, plan.num_sequences
    par = seg.parent
    # Sequences: chains covering 0..len-1, sharers.
    _check(seg.seq_ptr.shape == (S + 1,), "seq_ptr shape")
    sharers = np.zeros(G, dtype=np.int64)
    for s in range(S):
        segs = seg.segments_of(s)
        r = int(plan.row_of[s])
        if r < 0:
            _check(segs.shape[0] == 0 and plan.seq_lens[s] == 0, f"dropped sequence {s} has segments")
            continue
        _check(segs.shape[0] > 0, f"sequence {s} has no segments")
        _check(bool(np.all(seg.row[segs] == r)), f"sequence {s} spans rows")
        _check(
            par[segs[0]] == -1 and bool(np.all(par[segs[1:]] == segs[:-1])), f"sequence {s} is not a root-to-leaf chain"
        )
        _check(
            int(seg.length[segs].sum()) == int(plan.seq_lens[s]),
            f"sequence {s} covers {int(seg.length[segs].sum())} of {int(plan.seq_lens[s])} tokens",
        )
        sharers[segs] += 1
    _check(bool(np.array_equal(sharers, seg.sharers)), "sharers count mismatch")
    _check(bool(np.all(sharers >= 1)), "a segment belongs to no sequence")
    src_row = plan.row_of[seg.seq]
    _check(bool(np.all(src_row == seg.row)), "a segment's source sequence is in another row")
