"""Plan invariants: :func:`validate_plan` and the naive token-level mask.

``validate_plan(plan)`` checks what a plan alone can prove; given the sequences it also
checks them against the tokens:

- rows: segments tile ``[0, row_len)`` contiguously in pre-order, ``row_len <= seq_len``;
- tree: every parent precedes its child in the same row, depths follow parents, and
  ``subtree_end`` is where the subtree ends;
- mask: the interval form (``j <= i < subtree_end[j]``) equals the ancestor relation,
  segment by segment for every row (and token by token via :func:`naive_tree_mask` when
  ``dense_check_max`` allows);
- no data loss: each kept sequence's segments form a root-to-leaf chain in its row that
  covers positions ``0 .. len-1`` exactly once, strictly increasing in the row; every
  segment's ``sharers`` counts the sequences through it; dropped sequences have none;
- metadata: attention chains, GDN levels (each segment once, at its depth, ``cu_seqlens``,
  parent slots, conv context equal to :func:`~.metadata.naive_conv_context`), ranks (each
  row once, equal counts), stats;
- with sequences: every token at ``idx(s, p)`` is ``s[p]`` (keys too), a shared segment is
  at least ``min_shared_len`` long (or, with ``min_shared_saving``, saves enough: at least
  that many tokens over the sequences that could share its end) and holds no trainable
  token and no scored position of any sharer (generalized mode: no scored position its
  sharers predict differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treepack.proto.batch import SequenceBatch, normalize_batch
from treepack.proto.options import CP_ALIGN
from treepack.proto.plan import Plan
from treepack.service.planner.metadata import naive_conv_context

__all__ = ["PlanInvariantError", "validate_plan", "naive_tree_mask", "interval_mask"]


class PlanInvariantError(AssertionError):
    """A plan breaks one of its invariants (a planner bug, never a caller mistake)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise PlanInvariantError(what)


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


def _as_batch(plan: Plan, sequences: Any, trainable: Any, keys: Any) -> SequenceBatch:
    if isinstance(sequences, SequenceBatch):
        return sequences
    if trainable is None:
        trainable = _planned_trainable(plan, sequences)
    return normalize_batch(sequences, seq_len=plan.seq_len, trainable=trainable, keys=keys, on_overflow="truncate")


def _planned_trainable(plan: Plan, sequences: Any) -> list[Any]:
    """The flags the plan says it was planned with, at the submitted lengths (a truncated
    or dropped tail is not trainable)."""
    out: list[Any] = []
    for s in range(min(len(sequences), plan.num_sequences)):
        n = len(sequences[s])
        if plan.trainable is None:
            out.append(min(int(plan.first_trainable[s]), n) if plan.seq_lens[s] else n)
        else:
            flags = np.zeros(n, dtype=bool)
            flags[: int(plan.seq_lens[s])] = plan.trainable_of(s)
            out.append(flags)
    return out


def validate_plan(
    plan: Plan,
    sequences: Sequence[Any] | SequenceBatch | None = None,
    *,
    trainable: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    dense_check_max: int = 2048,
    gather_check_max: int = 1 << 24,
) -> None:
    """Check every plan invariant (module docstring); raise :class:`PlanInvariantError`.

    Args:
        plan: the plan.
        sequences: optionally the planned sequences (or their :class:`SequenceBatch`) for the
            token-level checks; ``trainable`` and ``keys`` as given to the planner
            (``trainable`` defaults to the flags the plan carries).
        dense_check_max: rows up to this many tokens also get the token-level mask check.
        gather_check_max: with sequences, plans of up to this many row slots (R * C) are
            also materialized through ``token_source``/``token_index`` and read back (the
            segment-level checks above already cover every token; this checks the
            per-token views the trainer uses, within a bounded memory).
    """
    _check_rows(plan)
    _check_row_trees(plan, dense_check_max)
    _check_sequences(plan)
    _check_attention(plan)
    _check_gdn(plan)
    _check_ranks_and_stats(plan)
    _check_planned_with(plan)
    if sequences is None:
        return
    batch = _as_batch(plan, sequences, trainable, keys)
    _check_tokens(plan, batch)
    if plan.num_rows * plan.seq_len <= gather_check_max:
        _check_gather(plan, batch)


def _check_rows(plan: Plan) -> None:
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


def _check_row_trees(plan: Plan, dense_check_max: int) -> None:
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


def _check_sequences(plan: Plan) -> None:
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


def _check_attention(plan: Plan) -> None:
    """Attention chains: root first, the segment last, key lengths."""
    seg = plan.segments
    G = seg.num_segments
    par = seg.parent
    # Attention chains.
    att = plan.attention
    _check(bool(np.array_equal(np.diff(att.anc_ptr), seg.depth + 1)), "attention chain lengths")
    for g in range(G):
        ch = att.chain(g)
        _check(
            ch[-1] == g and (ch.shape[0] == 1 or bool(np.all(par[ch[1:]] == ch[:-1]))),
            f"attention chain of segment {g}",
        )
    _check(bool(np.array_equal(att.key_lens, seg.seq_start + seg.length)), "key_lens")


def _check_gdn(plan: Plan) -> None:
    """GDN levels: depth, cu_seqlens, parents, conv context; every segment once."""
    seg = plan.segments
    C, G = plan.seq_len, seg.num_segments
    par = seg.parent
    # GDN levels.
    seen = np.zeros(G, dtype=np.int64)
    ctx_ref = naive_conv_context(seg, C, plan.gdn.conv_width)
    for d, lv in enumerate(plan.gdn.levels):
        _check(lv.depth == d and bool(np.all(seg.depth[lv.segs] == d)), f"GDN level {d} depth")
        seen[lv.segs] += 1
        _check(lv.cu_seqlens.dtype == np.int32 and lv.cu_seqlens[0] == 0, "cu_seqlens dtype/start")
        _check(bool(np.array_equal(np.diff(lv.cu_seqlens), seg.length[lv.segs])), f"cu_seqlens of level {d}")
        _check(bool(np.array_equal(lv.parent, par[lv.segs])), f"GDN parents of level {d}")
        if d > 0:
            prev = plan.gdn.levels[d - 1].segs
            _check(bool(np.array_equal(prev[lv.parent_slot], lv.parent)), f"GDN parent slots of level {d}")
        else:
            _check(bool(np.all(lv.parent_slot == -1)), "GDN roots have parents")
        _check(bool(np.array_equal(lv.conv_context, ctx_ref[lv.segs])), f"conv context of level {d}")
    _check(bool(np.all(seen == 1)), "GDN levels do not cover every segment once")


def _check_ranks_and_stats(plan: Plan) -> None:
    """Every row on one rank; the stats agree with the rows."""
    seg = plan.segments
    C, R = plan.seq_len, plan.num_rows
    # Ranks.
    rr = plan.ranks.rank_rows
    _check(rr.shape[0] == plan.ranks.num_ranks, "rank_rows shape")
    got = np.sort(rr[rr >= 0])
    _check(bool(np.array_equal(got, np.arange(R))), "ranks do not hold every row exactly once")
    # Context parallelism: equal, aligned shards that cover the row.
    cp, shard = plan.ranks.cp_size, plan.ranks.shard_len
    _check(cp == plan.options.cp_size, f"ranks.cp_size {cp} != options.cp_size {plan.options.cp_size}")
    if cp == 1:
        _check(shard == C, f"shard_len {shard} != seq_len {C} without CP")
    else:
        _check(shard % CP_ALIGN == 0, f"CP shard_len {shard} not a multiple of {CP_ALIGN}")
        _check(
            C <= cp * shard < C + cp * CP_ALIGN,
            f"CP shards {cp} x {shard} do not cover seq_len {C} with less than one aligned tile each of padding",
        )
    _check_cp_split(plan)

    # Stats.
    st = plan.stats
    _check(st.rows == R and st.packed_tokens == int(seg.row_len.sum()), "stats rows/packed")
    _check(st.padding_tokens == R * C - st.packed_tokens, "stats padding")
    _check(st.unpacked_tokens == int(plan.seq_lens.sum()), "stats unpacked")
    _check(0 <= st.lower_bound_rows <= R, f"lower bound {st.lower_bound_rows} > rows {R}")
    _check(st.tree_tokens <= st.packed_tokens or plan.placement == "no_share", "packed below tree size")


def naive_attention_work(plan: Plan, r: int) -> np.ndarray:
    """[padded_len] float64 attention work of each position of global row r: the keys its
    query sees (its sequence position + 1, ancestors included), 1 for padding (itself)."""
    seg = plan.segments
    work = np.ones(max(plan.ranks.padded_len, plan.seq_len), dtype=np.float64)
    for g in range(int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])):
        for i in range(int(seg.length[g])):
            work[int(seg.row_start[g]) + i] = int(seg.seq_start[g]) + i + 1
    return work


def _check_cp_split(plan: Plan) -> None:
    """The CP split: contiguous, or (all-gather) tiles dealt evenly and balanced by work."""
    rk = plan.ranks
    cp, R = rk.cp_size, plan.num_rows
    _check(
        rk.cp_attention == plan.options.cp_attention,
        f"ranks.cp_attention {rk.cp_attention!r} != options.cp_attention {plan.options.cp_attention!r}",
    )
    balanced = cp > 1 and rk.cp_attention == "allgather"
    if not balanced:
        _check(rk.contiguous, f"cp_tiles given for a contiguous split (cp_size {cp}, cp_attention {rk.cp_attention!r})")
        return
    per = rk.shard_len // CP_ALIGN
    tiles = rk.cp_tiles
    _check(tiles.shape == (R, cp * per), f"cp_tiles shape {tiles.shape} != {(R, cp * per)}")
    for r in range(R):
        held = np.bincount(np.clip(tiles[r], -1, cp).astype(np.int64) + 1, minlength=cp + 2)
        _check(
            held[0] == 0 and held[-1] == 0 and bool(np.all(held[1:-1] == per)),
            f"row {r}: CP ranks do not hold {per} tiles each",
        )
        tile_work = naive_attention_work(plan, r)[: cp * per * CP_ALIGN].reshape(cp * per, CP_ALIGN).sum(1)
        load = np.bincount(tiles[r], weights=tile_work, minlength=cp)
        _check(
            load.max() - load.min() <= tile_work.max(),
            f"row {r}: CP ranks' attention work {load.min():g}..{load.max():g} differs by more than one tile's {tile_work.max():g}",
        )


def _check_planned_with(plan: Plan) -> None:
    """What the plan carries about its batch: per-sequence arrays of the right shapes."""
    S = plan.num_sequences
    ft = plan.first_trainable
    _check(ft.shape == (S,) and bool(np.all((ft >= 0) & (ft <= plan.seq_lens))), "first_trainable shape or range")
    _check(plan.group_codes.shape == (S,), "group_codes shape")
    if plan.trainable is not None:
        _check(
            plan.trainable.dtype == np.bool_ and plan.trainable.shape == (int(plan.seq_lens.sum()),),
            "trainable flags shape",
        )
        for s in np.flatnonzero(plan.seq_lens > 0).tolist():
            flags = plan.trainable_of(s)
            first = int(np.argmax(flags)) if flags.any() else int(plan.seq_lens[s])
            _check(first == int(ft[s]), f"first_trainable of sequence {s} disagrees with its flags")


def _prefix_sharers(batch: SequenceBatch, plan: Plan, src: int, end: int) -> int:
    """Kept sequences that agree with ``src`` on positions ``0 .. end-1`` (tokens and keys)
    and may share them (default mode: within their shareable prefix)."""
    limit = batch.lens if plan.share_trainable else batch.shareable_lens()
    ref = batch.tokens[src][:end]
    rkey = None if batch.keys is None or batch.keys[src] is None else batch.keys[src][:end]
    count = 0
    for t in np.flatnonzero((plan.row_of >= 0) & (limit >= end)).tolist():
        if not np.array_equal(batch.tokens[t][:end], ref):
            continue
        if batch.keys is not None:
            k = batch.keys[t]
            mine = np.zeros(end, np.uint64) if k is None else k[:end]
            if not np.array_equal(mine, np.zeros(end, np.uint64) if rkey is None else rkey):
                continue
        count += 1
    return count


def _check_tokens(plan: Plan, batch: SequenceBatch) -> None:
    """Token-level rules against the batch: equal runs, sharing rules, what it was planned with."""
    seg = plan.segments
    S = plan.num_sequences
    _check(batch.num_sequences == S, "sequence count differs from the plan")
    _check(
        bool(np.array_equal(batch.lens[plan.row_of >= 0], plan.seq_lens[plan.row_of >= 0])), "sequence lengths differ"
    )
    kept = plan.row_of >= 0
    _check(
        bool(np.array_equal(batch.first_trainable[kept], plan.first_trainable[kept])),
        "first_trainable differs from the batch's",
    )
    for s in np.flatnonzero(kept).tolist():
        _check(
            bool(np.array_equal(batch.trainable_of(s), plan.trainable_of(s))), f"trainable flags of sequence {s} differ"
        )
    sh = batch.shareable_lens()
    msl = plan.min_shared_len
    saving = plan.options.min_shared_saving
    could_share: dict[int, int] = {}
    for s in range(S):
        if plan.row_of[s] < 0:
            continue
        tok = batch.tokens[s]
        key = None if batch.keys is None else batch.keys[s]
        for g in seg.segments_of(s).tolist():
            a, n, src = int(seg.seq_start[g]), int(seg.length[g]), int(seg.seq[g])
            _check(
                bool(np.array_equal(tok[a : a + n], batch.tokens[src][a : a + n])),
                f"sequence {s} tokens differ in segment {g}",
            )
            if batch.keys is not None:
                k1 = np.zeros(n, np.uint64) if key is None else key[a : a + n]
                k2 = batch.keys[src]
                k2 = np.zeros(n, np.uint64) if k2 is None else k2[a : a + n]
                _check(bool(np.array_equal(k1, k2)), f"sequence {s} keys differ in segment {g}")
            if seg.sharers[g] >= 2:
                if not plan.share_trainable:
                    _check(a + n <= sh[s], f"segment {g} shares a trainable token or scored position of sequence {s}")
                if n < msl and plan.placement != "no_share":
                    _check(saving > 0, f"shared segment {g} shorter than min_shared_len")
                    if g not in could_share:
                        could_share[g] = _prefix_sharers(batch, plan, src, a + n)
                    # The segment's last tree node saves (sharers - 1) x its length >= saving,
                    # and its sharers are among those that could share the segment's end.
                    _check(
                        (could_share[g] - 1) * n >= saving,
                        f"shared segment {g} shorter than min_shared_len saves too little",
                    )
    if plan.share_trainable:
        # A shared position may be scored only if every sharer predicts the same next
        # token; inside a segment they do by construction, so check each segment's last.
        ptr_sh, who = plan.segment_sharers()
        for g in np.flatnonzero(seg.sharers >= 2).tolist():
            members = who[ptr_sh[g] : ptr_sh[g + 1]].tolist()
            q = int(seg.seq_start[g] + seg.length[g])
            scored = any(q < batch.lens[m] and batch.trainable_of(m)[q] for m in members)
            if scored:
                nxt = {int(batch.tokens[m][q]) if q < batch.lens[m] else -1 for m in members}
                _check(
                    len(nxt) == 1 and -1 not in nxt,
                    f"shared segment {g} ends on a scored position its sharers predict differently",
                )


def _check_gather(plan: Plan, batch: SequenceBatch) -> None:
    """The gather itself: materialize row tokens and read every sequence back."""
    S = plan.num_sequences
    src_seq, src_pos = plan.token_source()
    offs = np.concatenate([[0], np.cumsum(batch.lens)])
    flat_tokens = np.concatenate(batch.tokens) if S else np.zeros(0, np.uint32)
    valid = src_seq >= 0
    rows_tok = np.zeros(src_seq.shape, dtype=np.int64)
    rows_tok[valid] = flat_tokens[offs[src_seq[valid]] + src_pos[valid]]
    ptr, flat = plan.token_index()
    kept = plan.row_of >= 0
    want = np.concatenate([batch.tokens[s] for s in range(S) if kept[s]]) if kept.any() else np.zeros(0)
    got_tok = rows_tok.reshape(-1)[flat]
    _check(bool(np.array_equal(got_tok, want.astype(np.int64))), "row tokens do not reproduce the sequences")
    pos = src_pos.reshape(-1)[flat]
    exp_pos = (
        np.concatenate([np.arange(int(plan.seq_lens[s])) for s in range(S) if kept[s]]) if kept.any() else np.zeros(0)
    )
    _check(bool(np.array_equal(pos, exp_pos)), "position_ids are not 0..len-1 per sequence")
    _check(bool(np.array_equal(np.diff(ptr), plan.seq_lens)), "token_index pointer mismatch")
