"""Plan invariants of the ranks, the context-parallel split and the stats.

- ranks: each row on exactly one rank;
- CP: equal shards, multiples of ``CP_ALIGN``, that cover the row; with all-gather attention
  the tiles dealt evenly and balanced by attention work (:func:`naive_attention_work`);
- stats: rows, packed, padding and unpacked tokens agree with the rows.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.options import CP_ALIGN
from treepack.proto.plan import Plan
from treepack.service.planner.invariant import _check

__all__ = ["check_ranks_and_stats", "naive_attention_work", "check_cp_split"]


def check_ranks_and_stats(plan: Plan) -> None:
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
    check_cp_split(plan)

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


def check_cp_split(plan: Plan) -> None:
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
            f"row {r}: CP ranks' attention work {load.min():g}..{load.max():g} "
            f"differs by more than one tile's {tile_work.max():g}",
        )
