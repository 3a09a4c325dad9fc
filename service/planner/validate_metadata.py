"""Plan invariants of the per-segment metadata and of what the plan carries about its batch.

- attention chains: root first, the segment last, key lengths;
- GDN levels: each segment once, at its depth, ``cu_seqlens``, parent slots, conv context
  equal to :func:`~.metadata.naive_conv_context`;
- planned with: ``first_trainable``, group codes and trainable flags of the right shapes,
  and agreeing with each other.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.plan import Plan
from treepack.proto.strategy import strategy_of
from treepack.service.planner.invariant import _check
from treepack.service.planner.metadata import naive_conv_context

__all__ = ["check_attention", "check_gdn", "check_planned_with"]


def check_attention(plan: Plan) -> None:
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


def check_gdn(plan: Plan) -> None:
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


def check_planned_with(plan: Plan) -> None:
    """What the plan carries about its batch: per-sequence arrays of the right shapes, and
    its typed strategy (``packing``) saying what its segments do: a tree at the plan's
    ``min_shared_len`` when one is shared, else plain."""
    _check(plan.packing == strategy_of(plan.segments.sharers, plan.min_shared_len), f"packing {plan.packing}")
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
