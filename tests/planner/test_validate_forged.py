"""One forged plan per ``validate_plan`` check: each check is seen to refuse, with its message.

Every case takes a real, valid plan, breaks one invariant, and asserts that
:func:`validate_plan` raises :class:`PlanInvariantError` with the message of the check that
holds that invariant (so a check switched off, or a bound loosened, fails its case: the plan
passes, or an unrelated check speaks first). A few checks are reached only when an earlier
check is switched off (they back up the earlier one, or verify a :class:`Plan` method); their
cases name the earlier checks in ``skip`` and switch exactly those off.

:data:`CASES` holds a case for every ``_check`` message of the validator; a test reads the
source of every module the validator is made of (those that import its ``_check``) and fails
when a check has no case here (a new check needs its forgery).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import pkgutil
import re
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import treepack.service.planner as planner_pkg
from treepack.proto.plan import Plan
from treepack.proto.strategy import Strategy
from treepack.service.planner import PlanInvariantError, plan_batch, validate_plan
from treepack.service.planner import validate as validate_mod

from helpers.trees import tree_sequences


def _base(share_trainable: bool = False) -> tuple[list[np.ndarray], list[np.ndarray], Plan]:
    """Sequences, trainable flags and a valid plan with every shape the checks look at:
    several rows, two ranks, depth 3 (GDN levels 0..3), shared segments, trainable flags."""
    seqs = tree_sequences(5, trees=3, depth=3, max_len=60)
    flags = [np.arange(len(s)) >= len(s) - 3 for s in seqs]
    if not share_trainable:
        for f in flags:
            f[len(f) // 3] = True  # flags that are not a prompt length
    plan = plan_batch(
        seqs, seq_len=128, min_shared_len=2, num_ranks=2, trainable=flags, share_trainable=share_trainable
    )
    validate_plan(plan, seqs, trainable=flags)
    seg = plan.segments
    assert (
        plan.num_rows >= 3
        and int(seg.depth.max()) >= 3
        and int((seg.sharers >= 2).sum()) >= 5
        and plan.trainable is not None
    )
    return seqs, flags, plan


def _cp() -> tuple[list[np.ndarray], None, Plan]:
    """A plan whose rows are split over a context-parallel group of 2 (shards of 64 tokens)."""
    seqs = tree_sequences(5, trees=3, depth=3, max_len=60)
    plan = plan_batch(seqs, seq_len=128, min_shared_len=2, cp_size=2)
    validate_plan(plan, seqs)
    assert plan.ranks.cp_size == 2 and plan.ranks.shard_len == 64
    return seqs, None, plan


def _cp_allgather() -> tuple[list[np.ndarray], None, Plan]:
    """A CP plan with all-gather attention: 16-token tiles dealt over 2 ranks by attention work."""
    seqs = tree_sequences(5, trees=3, depth=3, max_len=60)
    plan = plan_batch(seqs, seq_len=128, min_shared_len=2, cp_size=2, cp_attention="allgather")
    validate_plan(plan, seqs)
    assert plan.ranks.cp_tiles.shape == (plan.num_rows, 8) and not plan.ranks.contiguous
    return seqs, None, plan


def _twins() -> tuple[list[np.ndarray], None, Plan]:
    """Two trees in one row whose roots have the same length: a child of one can be re-hung
    under the other root with depths, positions and subtree ends unchanged."""
    seqs = [np.array(x, np.uint32) for x in ([1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [9, 9, 3, 4, 5], [9, 9, 7, 7, 7])]
    plan = plan_batch(seqs, seq_len=64, min_shared_len=2)
    validate_plan(plan, seqs)
    assert plan.num_rows == 1 and int((plan.segments.depth == 0).sum()) == 2
    return seqs, None, plan


@dataclasses.dataclass
class Case:
    """A forgery: ``forge(plan, seqs, flags)`` edits deep copies in place or returns
    ``(plan, seqs, flags)``; ``with_seqs`` validates against the sequences."""

    check: str  # regex of the message
    forge: Callable[..., Any]
    with_seqs: bool = False
    skip: tuple[str, ...] = ()  # earlier checks switched off for this case
    base: str = "default"


def _seg(p: Plan):
    return p.segments


def _row_segs(p: Plan, r: int) -> range:
    return range(int(p.segments.row_ptr[r]), int(p.segments.row_ptr[r + 1]))


def _first(cands, what: str) -> Any:
    for c in cands:
        return c
    raise AssertionError(f"the base plan has no {what}: the forgery needs one (change _base)")


def _child(p: Plan) -> int:
    return _first((g for g in range(_seg(p).num_segments) if _seg(p).parent[g] >= 0), "child segment")


def _multi_seg_seq(p: Plan) -> int:
    return _first(
        (s for s in range(p.num_sequences) if _seg(p).segments_of(s).shape[0] >= 2), "sequence of several segments"
    )


def _shared(p: Plan) -> int:
    return _first((g for g in range(_seg(p).num_segments) if _seg(p).sharers[g] >= 2), "shared segment")


def _sharer_not_source(p: Plan) -> tuple[int, int]:
    seg = _seg(p)
    return _first(
        (
            (s, g)
            for s in range(p.num_sequences)
            for g in seg.segments_of(s).tolist()
            if seg.sharers[g] >= 2 and seg.seq[g] != s
        ),
        "sharer that is not its segment's source",
    )


def _replace_seg(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, segments=dataclasses.replace(p.segments, **kw))


def _replace_level(p: Plan, d: int, **kw) -> Plan:
    levels = list(p.gdn.levels)
    levels[d] = dataclasses.replace(levels[d], **kw)
    return dataclasses.replace(p, gdn=dataclasses.replace(p.gdn, levels=tuple(levels)))


def _replace_stats(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, stats=dataclasses.replace(p.stats, **kw))


# --- rows -------------------------------------------------------------------------------


def f_row_ptr_end(p, *_):
    _seg(p).row_ptr[-1] -= 1


def f_row_ptr_decreasing(p, *_):
    rp = _seg(p).row_ptr
    rp[1] = rp[2] + 1  # ends intact, one step down


def f_row_ptr_start(p, *_):
    _seg(p).row_ptr[0] = 1


def f_row_ptr_shape(p, *_):
    return _replace_seg(p, row_ptr=np.append(_seg(p).row_ptr, _seg(p).row_ptr[-1]))


def f_row_grouping(p, *_):
    _seg(p).row[0] = 1


def f_empty_segment(p, *_):
    seg = _seg(p)
    g = int(np.flatnonzero(seg.length >= 2)[0])
    # Shrink a segment to nothing and keep the row tiled and its length summed.
    seg.length[g] = 0


def f_over_capacity(p, *_):
    _seg(p).row_len[0] = p.seq_len + 1


def f_row_len_sum(p, *_):
    _seg(p).row_len[0] -= 1


def f_tiling(p, *_):
    _seg(p).row_start[1] += 1


# --- trees in rows ----------------------------------------------------------------------


def f_parent_after_child(p, *_):
    g = _child(p)
    _seg(p).parent[g] = g


def f_parent_other_row(p, *_):
    seg = _seg(p)
    root = _first((g for g in _row_segs(p, 1) if seg.parent[g] < 0), "root in row 1")
    seg.parent[root] = int(seg.row_ptr[1]) - 1  # the last segment of row 0


def f_depth(p, *_):
    seg = _seg(p)
    leaf = _first(
        (g for g in range(seg.num_segments) if seg.parent[g] >= 0 and g not in set(seg.parent.tolist())), "leaf child"
    )
    seg.depth[leaf] += 1


def f_root_depth(p, *_):
    seg = _seg(p)
    _seg(p).depth[
        _first(
            (g for g in range(seg.num_segments) if seg.parent[g] < 0 and g not in set(seg.parent.tolist())),
            "childless root",
        )
    ] = 1


def f_child_positions(p, *_):
    seg = _seg(p)
    g = _child(p)
    seg.seq_start[g] += 1


def _subtree(p: Plan, g: int) -> list[int]:
    seg = _seg(p)
    out = [g]
    for h in range(g + 1, seg.num_segments):
        if seg.parent[h] in out:
            out.append(h)
    return out


def f_root_position(p, *_):
    seg = _seg(p)
    root = _first((g for g in range(seg.num_segments) if seg.parent[g] < 0), "root")
    for h in _subtree(p, root):
        seg.seq_start[h] += 1  # children still continue their parents


def f_subtree_end(p, *_):
    _seg(p).subtree_end[_child(p)] += 1


def f_ancestor_relation(p, *_):
    # Re-hang a segment under another segment of the same row that has its parent's depth and
    # end position, so depths, positions and subtree ends stay right but the tree is another.
    seg = _seg(p)
    for y in range(seg.num_segments):
        py = int(seg.parent[y])
        if py < 0:
            continue
        for x in range(int(seg.row_ptr[seg.row[y]]), y):
            if (
                x != py
                and seg.depth[x] == seg.depth[py]
                and seg.seq_start[x] + seg.length[x] == seg.seq_start[y]
                and x not in _subtree(p, y)
            ):
                seg.parent[y] = x
                return
    raise AssertionError("no segment to re-hang")


def f_token_mask(p, *_):
    # Reached only with the segment-level checks off: a subtree end one short.
    seg = _seg(p)
    seg.subtree_end[_child(p)] -= 1


def f_plan_subtree_end_method(p, *_):
    return _Forged(p, subtree_end=lambda self: Plan.subtree_end(self.plan) + 1)


class _Forged:
    """A plan whose derived per-token views are replaced (a bug planted in a Plan method)."""

    def __init__(self, plan: Plan, **methods):
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "methods", methods)

    def __getattr__(self, name):
        if name in self.methods:
            return lambda *a: self.methods[name](self, *a)
        return getattr(self.plan, name)


# --- sequences --------------------------------------------------------------------------


def f_seq_ptr_shape(p, *_):
    return _replace_seg(p, seq_ptr=_seg(p).seq_ptr[:-1])


def f_dropped_has_segments(p, *_):
    p.row_of[0] = -1


def f_no_segments(p, *_):
    seg = _seg(p)
    return _replace_seg(
        p, seq_ptr=np.concatenate([seg.seq_ptr[:-1], seg.seq_ptr[-2:-1]]), seq_segs=seg.seq_segs[: seg.seq_ptr[-2]]
    )


def f_spans_rows(p, *_):
    p.row_of[0] = 1 if p.row_of[0] != 1 else 0


def f_chain(p, *_):
    s = _multi_seg_seq(p)
    seg = _seg(p)
    a, b = int(seg.seq_ptr[s]), int(seg.seq_ptr[s + 1])
    seg.seq_segs[a:b] = seg.seq_segs[a:b][::-1].copy()


def f_coverage(p, *_):
    p.seq_lens[0] += 1


def f_sharers(p, *_):
    _seg(p).sharers[0] += 1


def f_orphan_segment(p, *_):
    # Take a sequence with an unshared leaf out of the sequence table (consistently), so its
    # leaf segment stays in the row with no sequence through it.
    seg = _seg(p)
    s = _first(
        (
            s
            for s in range(p.num_sequences)
            if seg.sharers[seg.segments_of(s)[-1]] == 1
            and seg.seq[seg.segments_of(s)[-1]] == s
            and (seg.seq[seg.segments_of(s)[:-1]] != s).all()
        ),
        "sequence with an unshared leaf",
    )
    mine = seg.segments_of(s)
    seg.sharers[mine] -= 1
    counts = np.diff(seg.seq_ptr)
    counts[s] = 0
    keep = np.ones(seg.seq_segs.shape[0], bool)
    keep[int(seg.seq_ptr[s]) : int(seg.seq_ptr[s + 1])] = False
    p.row_of[s] = -1
    p.seq_lens[s] = 0
    p.first_trainable[s] = 0
    return _replace_seg(p, seq_ptr=np.concatenate([[0], np.cumsum(counts)]), seq_segs=seg.seq_segs[keep]), "trainable"


def f_source_row(p, *_):
    seg = _seg(p)
    g = _first((g for g in range(seg.num_segments) if seg.row[g] == 0), "segment in row 0")
    seg.seq[g] = _first((s for s in range(p.num_sequences) if p.row_of[s] == 1), "sequence in row 1")


# --- attention --------------------------------------------------------------------------


def f_chain_lengths(p, *_):
    p.attention.anc_ptr[1] += 1


def f_chain_order(p, *_):
    att = p.attention
    g = _child(p)
    a, b = int(att.anc_ptr[g]), int(att.anc_ptr[g + 1])
    att.anc_segs[a:b] = att.anc_segs[a:b][::-1].copy()


def f_key_lens(p, *_):
    p.attention.key_lens[0] += 1


# --- GDN --------------------------------------------------------------------------------


def f_level_depth(p, *_):
    return _replace_level(p, 1, depth=2)


def f_cu_dtype(p, *_):
    return _replace_level(p, 1, cu_seqlens=p.gdn.levels[1].cu_seqlens.astype(np.int64))


def f_cu_start(p, *_):
    p.gdn.levels[1].cu_seqlens[0] = 1


def f_cu_values(p, *_):
    p.gdn.levels[1].cu_seqlens[-1] += 1


def f_gdn_parent(p, *_):
    lv = p.gdn.levels[1]
    lv.parent[0] = lv.parent[0] + 1 if lv.parent[0] + 1 < lv.segs[0] else lv.parent[0] - 1


def f_gdn_parent_slot(p, *_):
    lv = p.gdn.levels[1]
    assert p.gdn.levels[0].segs.shape[0] >= 2
    lv.parent_slot[0] = 1 if lv.parent_slot[0] == 0 else 0


def f_gdn_root_slot(p, *_):
    p.gdn.levels[0].parent_slot[0] = 0


def f_conv_context(p, *_):
    lv = p.gdn.levels[1]
    lv.conv_context[0, -1] += 1


def f_levels_cover(p, *_):
    return dataclasses.replace(p, gdn=dataclasses.replace(p.gdn, levels=p.gdn.levels[:-1]))


# --- ranks and stats --------------------------------------------------------------------


def f_rank_rows_shape(p, *_):
    rr = p.ranks.rank_rows
    return dataclasses.replace(
        p, ranks=dataclasses.replace(p.ranks, rank_rows=np.vstack([rr, np.full((1, rr.shape[1]), -1)]))
    )


def f_rank_rows_once(p, *_):
    rr = p.ranks.rank_rows
    rr[1, 0] = rr[0, 0]


def _replace_ranks(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, ranks=dataclasses.replace(p.ranks, **kw))


def f_cp_size_options(p, *_):
    return _replace_ranks(p, cp_size=p.options.cp_size + 1)


def f_shard_without_cp(p, *_):
    return _replace_ranks(p, shard_len=p.seq_len + 16)


def f_cp_shard_unaligned(p, *_):
    assert p.ranks.cp_size > 1, "the forgery needs a CP plan (base='cp')"
    return _replace_ranks(p, shard_len=p.ranks.shard_len + 1)


def f_cp_shards_cover(p, *_):
    assert p.ranks.cp_size > 1, "the forgery needs a CP plan (base='cp')"
    return _replace_ranks(p, shard_len=p.ranks.shard_len + 16)  # aligned, but a whole tile of padding per rank too many


def f_cp_attention_options(p, *_):
    return _replace_ranks(p, cp_attention="allgather")


def f_cp_tiles_contiguous(p, *_):
    assert p.ranks.cp_size > 1 and p.ranks.cp_attention == "auto", "the forgery needs a contiguous CP plan (base='cp')"
    return _replace_ranks(p, cp_tiles=np.zeros((p.num_rows, 8), np.int32))


def f_cp_tiles_shape(p, *_):
    return _replace_ranks(p, cp_tiles=p.ranks.cp_tiles[:, :-2])


def f_cp_tiles_count(p, *_):
    t = p.ranks.cp_tiles
    t[0, int(np.flatnonzero(t[0] == 1)[0])] = 0  # rank 0 holds one tile too many


def f_cp_tiles_unbalanced(p, *_):
    # The token split (first half to rank 0): the later half sees the longer chains.
    per = p.ranks.shard_len // 16
    t = np.repeat(np.arange(2, dtype=np.int32), per)[None].repeat(p.num_rows, 0)
    return _replace_ranks(p, cp_tiles=t)


def f_stats_packed(p, *_):
    return _replace_stats(p, packed_tokens=p.stats.packed_tokens + 1)


def f_stats_padding(p, *_):
    return _replace_stats(p, padding_tokens=p.stats.padding_tokens + 1)


def f_stats_unpacked(p, *_):
    return _replace_stats(p, unpacked_tokens=p.stats.unpacked_tokens + 1)


def f_lower_bound(p, *_):
    return _replace_stats(p, lower_bound_rows=p.num_rows + 1)


def f_tree_tokens(p, *_):
    return _replace_stats(p, tree_tokens=p.stats.packed_tokens + 1)


# --- what the plan carries --------------------------------------------------------------


def f_first_trainable_range(p, *_):
    p.first_trainable[0] = p.seq_lens[0] + 1


def f_first_trainable_shape(p, *_):
    return dataclasses.replace(p, first_trainable=p.first_trainable[:-1])


def f_first_trainable_negative(p, *_):
    p.first_trainable[0] = -1


def f_group_codes(p, *_):
    return dataclasses.replace(p, group_codes=p.group_codes[:-1])


def f_flags_shape(p, *_):
    return dataclasses.replace(p, trainable=p.trainable[:-1])


def f_first_trainable_flags(p, *_):
    s = _first((s for s in range(p.num_sequences) if p.first_trainable[s] > 0), "sequence with a prompt")
    p.first_trainable[s] -= 1


# --- against the sequences --------------------------------------------------------------


def f_seq_count(p, seqs, flags):
    return p, seqs[:-1], flags[:-1]


def f_seq_len(p, seqs, flags):
    s = _first((s for s in range(len(seqs)) if seqs[s].shape[0] < p.seq_len), "short sequence")
    seqs[s] = np.concatenate([seqs[s], seqs[s][-1:]])
    flags[s] = np.concatenate([flags[s], [True]])
    return p, seqs, flags


def f_batch_first_trainable(p, seqs, flags):
    s = _first((s for s in range(len(seqs)) if flags[s].argmax() > 0), "sequence with a prompt")
    flags[s][0] = True
    return p, seqs, flags


def f_batch_flags(p, seqs, flags):
    # Flip an untrainable token after the first trainable one: first_trainable stays.
    s, i = _first(
        ((s, i) for s in range(len(seqs)) for i in range(int(flags[s].argmax()) + 1, len(seqs[s])) if not flags[s][i]),
        "untrainable token after a trainable one",
    )
    flags[s][i] = True
    return p, seqs, flags


def f_tokens(p, seqs, flags):
    s, g = _sharer_not_source(p)
    seqs[s][int(_seg(p).seq_start[g])] ^= 1
    return p, seqs, flags


def f_keys(p, seqs, flags):
    s, g = _sharer_not_source(p)
    keys = [None] * len(seqs)
    keys[s] = np.zeros(len(seqs[s]), np.uint64)
    keys[s][int(_seg(p).seq_start[g])] = 7
    return p, seqs, flags, keys


def f_shares_scored(p, seqs, flags):
    # The plan (and the batch read from it) says a shared token is trainable.
    seg = _seg(p)
    g = _shared(p)
    s = int(seg.segments_of(int(seg.seq[g]))[0] * 0 + seg.seq[g])
    pos = int(seg.seq_start[g] + seg.length[g]) - 1
    first = int(p.first_trainable[s])
    p.trainable[int(p.seq_ptr[s]) + pos] = True
    p.first_trainable[s] = min(first, pos)
    return p, seqs, None


def f_min_shared_len(p, seqs, flags):
    g = _shared(p)
    n = int(_seg(p).length[g])
    # The typed strategy claims the same threshold, so the segment check is what refuses it.
    packing = Strategy(kind="tree", min_shared_len=n + 1)
    return (
        dataclasses.replace(p, options=dataclasses.replace(p.options, min_shared_len=n + 1), packing=packing),
        seqs,
        flags,
    )


def f_min_shared_saving(p, seqs, flags):
    g = _shared(p)
    n = int(_seg(p).length[g])
    return (
        dataclasses.replace(
            p,
            options=dataclasses.replace(p.options, min_shared_len=n + 1, min_shared_saving=10**6),
            packing=Strategy(kind="tree", min_shared_len=n + 1),
        ),
        seqs,
        flags,
    )


def f_packing(p, seqs, flags):
    return dataclasses.replace(p, packing=Strategy(kind="plain")), seqs, flags


def f_generalized_divergence(p, seqs, flags):
    # A shared segment whose sharers continue with different tokens: make the position after
    # it trainable (scored) for one sharer, in the plan and hence in the batch.
    seg = _seg(p)
    ptr, who = p.segment_sharers()
    for g in np.flatnonzero(seg.sharers >= 2).tolist():
        q = int(seg.seq_start[g] + seg.length[g])
        members = who[ptr[g] : ptr[g + 1]].tolist()
        nxt = {int(seqs[m][q]) if q < len(seqs[m]) else -1 for m in members}
        if len(nxt) > 1 and -1 not in nxt:
            m = members[0]
            p.trainable[int(p.seq_ptr[m]) + q] = True
            p.first_trainable[m] = min(int(p.first_trainable[m]), q)
            return p, seqs, None
    raise AssertionError("no branch point with distinct next tokens")


# --- the gather (Plan methods) ----------------------------------------------------------


def f_gather_tokens(p, *rest):
    def token_source(self):
        seq, pos = Plan.token_source(self.plan)
        return seq, np.where(seq >= 0, np.maximum(pos - 1, 0), pos)

    return (_Forged(p, token_source=token_source), *rest)


def f_token_index(p, *rest):
    def token_index(self):
        ptr, flat = Plan.token_index(self.plan)
        ptr = ptr.copy()
        ptr[1] += 1
        return ptr, flat

    return (_Forged(p, token_index=token_index), *rest)


CASES: dict[str, Case] = {
    "row_ptr_end": Case(check=r"^row_ptr shape/ends$", forge=f_row_ptr_end),
    "row_ptr_start": Case(check=r"^row_ptr shape/ends$", forge=f_row_ptr_start),
    "row_ptr_shape": Case(check=r"^row_ptr shape/ends$", forge=f_row_ptr_shape),
    "row_ptr_decreasing": Case(check=r"^row_ptr not monotone$", forge=f_row_ptr_decreasing),
    "row_grouping": Case(check=r"^segments not grouped by row$", forge=f_row_grouping),
    "empty_segment": Case(check=r"^empty segment in a row$", forge=f_empty_segment),
    "over_capacity": Case(check=r"^row over capacity: max 129 > 128$", forge=f_over_capacity),
    "row_len_sum": Case(check=r"^row_len != segment sum$", forge=f_row_len_sum),
    "tiling": Case(check=r"^segments do not tile their row contiguously$", forge=f_tiling),
    "parent_after_child": Case(check=r"^parent does not precede child$", forge=f_parent_after_child),
    "parent_other_row": Case(check=r"^parent in another row$", forge=f_parent_other_row),
    "depth": Case(check=r"^depth mismatch$", forge=f_depth),
    "root_depth": Case(check=r"^depth mismatch$", forge=f_root_depth),
    "child_positions": Case(check=r"^child does not continue its parent's positions$", forge=f_child_positions),
    "root_position": Case(check=r"^row root does not start at position 0$", forge=f_root_position),
    "subtree_end": Case(check=r"^subtree_end wrong in row \d+$", forge=f_subtree_end),
    "ancestor_relation": Case(
        check=r"^interval mask != ancestor relation in row \d+$", forge=f_ancestor_relation, base="twins"
    ),
    "token_mask": Case(
        check=r"^token mask mismatch in row \d+$", forge=f_token_mask, skip=(r"subtree_end wrong", r"interval mask")
    ),
    "plan_subtree_end": Case(check=r"^Plan\.subtree_end\(\) wrong in row 0$", forge=f_plan_subtree_end_method),
    "seq_ptr_shape": Case(check=r"^seq_ptr shape$", forge=f_seq_ptr_shape),
    "dropped_has_segments": Case(check=r"^dropped sequence 0 has segments$", forge=f_dropped_has_segments),
    "no_segments": Case(check=r"^sequence \d+ has no segments$", forge=f_no_segments),
    "spans_rows": Case(check=r"^sequence 0 spans rows$", forge=f_spans_rows),
    "chain": Case(check=r"^sequence \d+ is not a root-to-leaf chain$", forge=f_chain),
    "coverage": Case(check=r"^sequence 0 covers (\d+) of (\d+) tokens$", forge=f_coverage),
    "sharers": Case(check=r"^sharers count mismatch$", forge=f_sharers),
    "orphan_segment": Case(check=r"^a segment belongs to no sequence$", forge=f_orphan_segment),
    "source_row": Case(check=r"^a segment's source sequence is in another row$", forge=f_source_row),
    "chain_lengths": Case(check=r"^attention chain lengths$", forge=f_chain_lengths),
    "chain_order": Case(check=r"^attention chain of segment \d+$", forge=f_chain_order),
    "key_lens": Case(check=r"^key_lens$", forge=f_key_lens),
    "level_depth": Case(check=r"^GDN level 1 depth$", forge=f_level_depth),
    "cu_dtype": Case(check=r"^cu_seqlens dtype/start$", forge=f_cu_dtype),
    "cu_start": Case(check=r"^cu_seqlens dtype/start$", forge=f_cu_start),
    "cu_values": Case(check=r"^cu_seqlens of level 1$", forge=f_cu_values),
    "gdn_parent": Case(check=r"^GDN parents of level 1$", forge=f_gdn_parent),
    "gdn_parent_slot": Case(check=r"^GDN parent slots of level 1$", forge=f_gdn_parent_slot),
    "gdn_root_slot": Case(check=r"^GDN roots have parents$", forge=f_gdn_root_slot),
    "conv_context": Case(check=r"^conv context of level 1$", forge=f_conv_context),
    "levels_cover": Case(check=r"^GDN levels do not cover every segment once$", forge=f_levels_cover),
    "rank_rows_shape": Case(check=r"^rank_rows shape$", forge=f_rank_rows_shape),
    "rank_rows_once": Case(check=r"^ranks do not hold every row exactly once$", forge=f_rank_rows_once),
    "cp_size_options": Case(check=r"^ranks\.cp_size 2 != options\.cp_size 1$", forge=f_cp_size_options),
    "shard_without_cp": Case(check=r"^shard_len 144 != seq_len 128 without CP$", forge=f_shard_without_cp),
    "cp_shard_unaligned": Case(check=r"^CP shard_len 65 not a multiple of 16$", forge=f_cp_shard_unaligned, base="cp"),
    "cp_shards_cover": Case(
        check=r"^CP shards 2 x 80 do not cover seq_len 128 with less than one aligned tile each of padding$",
        forge=f_cp_shards_cover,
        base="cp",
    ),
    "cp_attention_options": Case(
        check=r"^ranks\.cp_attention 'allgather' != options\.cp_attention 'auto'$", forge=f_cp_attention_options
    ),
    "cp_tiles_contiguous": Case(
        check=r"^cp_tiles given for a contiguous split \(cp_size 2, cp_attention 'auto'\)$",
        forge=f_cp_tiles_contiguous,
        base="cp",
    ),
    "cp_tiles_shape": Case(check=r"^cp_tiles shape \(\d+, 6\) != \(\d+, 8\)$", forge=f_cp_tiles_shape, base="cp_ag"),
    "cp_tiles_count": Case(check=r"^row 0: CP ranks do not hold 4 tiles each$", forge=f_cp_tiles_count, base="cp_ag"),
    "cp_tiles_unbalanced": Case(
        check=r"^row 0: CP ranks' attention work .+ differs by more than one tile's .+$",
        forge=f_cp_tiles_unbalanced,
        base="cp_ag",
    ),
    "stats_packed": Case(check=r"^stats rows/packed$", forge=f_stats_packed),
    "stats_padding": Case(check=r"^stats padding$", forge=f_stats_padding),
    "stats_unpacked": Case(check=r"^stats unpacked$", forge=f_stats_unpacked),
    "lower_bound": Case(check=r"^lower bound \d+ > rows \d+$", forge=f_lower_bound),
    "tree_tokens": Case(check=r"^packed below tree size$", forge=f_tree_tokens),
    "first_trainable_range": Case(check=r"^first_trainable shape or range$", forge=f_first_trainable_range),
    "first_trainable_shape": Case(check=r"^first_trainable shape or range$", forge=f_first_trainable_shape),
    "first_trainable_negative": Case(check=r"^first_trainable shape or range$", forge=f_first_trainable_negative),
    "group_codes": Case(check=r"^group_codes shape$", forge=f_group_codes),
    "packing": Case(check=r"^packing plain$", forge=f_packing),
    "flags_shape": Case(check=r"^trainable flags shape$", forge=f_flags_shape),
    "first_trainable_flags": Case(
        check=r"^first_trainable of sequence \d+ disagrees with its flags$", forge=f_first_trainable_flags
    ),
    "seq_count": Case(check=r"^sequence count differs from the plan$", forge=f_seq_count, with_seqs=True),
    "seq_len": Case(check=r"^sequence lengths differ$", forge=f_seq_len, with_seqs=True),
    "batch_first_trainable": Case(
        check=r"^first_trainable differs from the batch's$", forge=f_batch_first_trainable, with_seqs=True
    ),
    "batch_flags": Case(check=r"^trainable flags of sequence \d+ differ$", forge=f_batch_flags, with_seqs=True),
    "tokens": Case(check=r"^sequence \d+ tokens differ in segment \d+$", forge=f_tokens, with_seqs=True),
    "keys": Case(check=r"^sequence \d+ keys differ in segment \d+$", forge=f_keys, with_seqs=True),
    "shares_scored": Case(
        check=r"^segment \d+ shares a trainable token or scored position of sequence \d+$",
        forge=f_shares_scored,
        with_seqs=True,
    ),
    "min_shared_len": Case(
        check=r"^shared segment \d+ shorter than min_shared_len$", forge=f_min_shared_len, with_seqs=True
    ),
    "min_shared_saving": Case(
        check=r"^shared segment \d+ shorter than min_shared_len saves too little$",
        forge=f_min_shared_saving,
        with_seqs=True,
    ),
    "generalized_divergence": Case(
        check=r"^shared segment \d+ ends on a scored position its sharers predict differently$",
        forge=f_generalized_divergence,
        with_seqs=True,
        base="generalized",
    ),
    "gather_tokens": Case(check=r"^row tokens do not reproduce the sequences$", forge=f_gather_tokens, with_seqs=True),
    "gather_positions": Case(
        check=r"^position_ids are not 0\.\.len-1 per sequence$",
        forge=f_gather_tokens,
        with_seqs=True,
        skip=(r"row tokens do not reproduce",),
    ),
    "token_index": Case(check=r"^token_index pointer mismatch$", forge=f_token_index, with_seqs=True),
}


@pytest.fixture(scope="module")
def bases() -> dict[str, tuple]:
    return {
        "default": _base(False),
        "generalized": _base(True),
        "twins": _twins(),
        "cp": _cp(),
        "cp_ag": _cp_allgather(),
    }


def _forge(case: Case, bases: dict[str, tuple]):
    seqs, flags, plan = copy.deepcopy(bases[case.base])
    out = case.forge(plan, seqs, flags)
    keys = None
    if out is None:
        out = (plan, seqs, flags)
    elif isinstance(out, tuple) and len(out) == 2 and out[1] == "trainable":
        out = (out[0], seqs, flags)  # the forgery edits what the plan says was trainable
    elif not isinstance(out, tuple):
        out = (out, seqs, flags)
    if len(out) == 4:
        keys = out[3]
    return out[0], out[1], out[2], keys


def _validator_modules() -> list[ModuleType]:
    """Every module the validator is made of: the planner's modules that import the one
    ``_check`` primitive (the module of :class:`PlanInvariantError` defines it)."""
    check = sys.modules[PlanInvariantError.__module__]._check
    found = []
    for info in pkgutil.iter_modules(planner_pkg.__path__, planner_pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        if getattr(mod, "_check", None) is check and mod.__name__ != PlanInvariantError.__module__:
            found.append(mod)
    return found


VALIDATOR_MODULES = _validator_modules()


def _run(case: Case, plan, seqs, flags, keys, monkeypatch) -> None:
    if case.skip:
        original = sys.modules[PlanInvariantError.__module__]._check

        def selective(ok: bool, what: str) -> None:
            if not any(re.search(pat, what) for pat in case.skip):
                original(ok, what)

        for mod in VALIDATOR_MODULES:
            monkeypatch.setattr(mod, "_check", selective)
    if case.with_seqs:
        validate_plan(plan, seqs, trainable=flags, keys=keys)
    else:
        validate_plan(plan)


@pytest.mark.parametrize("name", list(CASES))
def test_each_check_refuses_its_forged_plan(name, bases, monkeypatch):
    case = CASES[name]
    plan, seqs, flags, keys = _forge(case, bases)
    with pytest.raises(PlanInvariantError) as e:
        _run(case, plan, seqs, flags, keys, monkeypatch)
    assert re.search(case.check, str(e.value)), f"{name}: expected /{case.check}/, the validator said {str(e.value)!r}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.skip])
def test_a_skipped_check_is_really_off(name, bases, monkeypatch):
    """Negative control for the ``skip`` cases: the earlier check does catch the forgery."""
    case = CASES[name]
    plan, seqs, flags, keys = _forge(case, bases)
    with pytest.raises(PlanInvariantError) as e:
        _run(dataclasses.replace(case, skip=()), plan, seqs, flags, keys, monkeypatch)
    assert any(re.search(pat, str(e.value)) for pat in case.skip), str(e.value)


def test_the_bases_are_valid(bases):
    """Negative control: the unforged plans pass, so each refusal is the forgery's."""
    for seqs, flags, plan in bases.values():
        validate_plan(plan, seqs, trainable=flags)
        validate_plan(plan)


def _message_text(node: ast.expr) -> str:
    """A ``_check`` message as written, its f-string fields as ``{...}`` (a string split over
    lines is one node by then)."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.JoinedStr), ast.dump(node)
    return "".join(
        str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values
    )


def _validator_messages() -> list[str]:
    """The message of every ``_check(...)`` call in the source of every validator module."""
    out = []
    for mod in VALIDATOR_MODULES:
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_check" and len(node.args) >= 2:
                out.append(_message_text(node.args[1]))
    return out


def test_the_validator_modules_are_found():
    """Negative control for the source scan: the entry module calls no ``_check`` itself, and
    each module found holds checks (a module missed would leave its checks unscanned)."""
    names = {m.__name__.rsplit(".", 1)[1] for m in VALIDATOR_MODULES}
    assert {"validate_rows", "validate_metadata", "validate_ranks", "validate_tokens"} <= names, names
    assert validate_mod not in VALIDATOR_MODULES


def test_every_check_of_the_validator_has_a_forged_plan(bases, monkeypatch):
    """Each ``_check`` message of the validator's source is raised by at least one case."""
    messages = _validator_messages()
    assert len(messages) >= 55, (
        f"the source scan found only {len(messages)} checks: the pattern no longer matches the validator"
    )
    said: list[str] = []
    for _name, case in CASES.items():
        plan, seqs, flags, keys = _forge(case, bases)
        with monkeypatch.context() as m, pytest.raises(PlanInvariantError) as e:
            _run(case, plan, seqs, flags, keys, m)
        said.append(str(e.value))
    per_check: Counter = Counter()
    for msg in messages:
        pattern = "".join(".+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{[^}]*\})", msg))
        per_check[msg] = sum(bool(re.fullmatch(pattern, s)) for s in said)
    missing = [m for m, n in per_check.items() if n == 0]
    assert not missing, f"validate_plan checks with no forged-plan case: {missing}"
    print(f"forged-plan cases per check ({len(messages)} checks, {len(CASES)} cases): {dict(per_check)}")
