"""Plans on the wire: :class:`~treepack.proto.plan.Plan` <-> ``PlanMessage`` (response side).

Shared by the service (encode) and the HTTP client (decode); no FastAPI here. Every plan
array travels as a typed array object (:mod:`treepack.proto.buffers`) whose dtype and
rank are fixed by :data:`ARRAYS`; the decoder checks them, so a decoded plan has exactly
the embedded plan's dtypes and shapes. The plan travels whole: its options, per-sequence
first trainable index, trainable flags (when given as flags) and group codes included.

:func:`plan_differences` compares two plans field by field and array by array (dtype
included); the backends are tested to agree with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treepack.proto.buffers import Format, array_from_wire, array_to_wire, exact_sum
from treepack.proto.errors import RequestError
from treepack.proto.options import CP_ALIGN, PlanOptions, cp_shard_len
from treepack.proto.pack_messages import PlanMessage
from treepack.proto.plan import AttentionMeta, GdnLevel, GdnMeta, OverflowEvent, Plan, PlanStats, Ranks, Segments
from treepack.proto.strategy import Strategy, strategy_of
from treepack.proto.version import WIRE_VERSION
from treepack.proto.wire_fields import StrategyMessage

__all__ = ["ARRAYS", "plan_to_wire", "plan_from_wire", "strategy_to_wire", "strategy_from_wire"]
__all__ += ["check_plan_structure", "plan_differences"]

_I8, _I4, _F8 = "<i8", "<i4", "<f8"

# (message section, field) -> (dtype, ndim). Section "" is the plan itself.
ARRAYS: dict[tuple[str, str], tuple[str, int]] = {
    **{("", f): (_I8, 1) for f in ("seq_lens", "orig_lens", "row_of", "first_trainable", "group_codes")},
    **{("segments", f): (_I8, 1) for f in Segments.__dataclass_fields__},
    **{("attention", f): (_I8, 1) for f in AttentionMeta.__dataclass_fields__},
    ("gdn.levels", "segs"): (_I8, 1),
    ("gdn.levels", "cu_seqlens"): (_I4, 1),
    ("gdn.levels", "parent"): (_I8, 1),
    ("gdn.levels", "parent_slot"): (_I8, 1),
    ("gdn.levels", "conv_context"): (_I8, 2),
    ("ranks", "rank_rows"): (_I8, 2),
    ("ranks", "row_cost"): (_F8, 1),
    ("ranks", "rank_cost"): (_F8, 1),
}
_STATS = tuple(f for f in PlanStats.__dataclass_fields__ if f not in ("timings_ms", "predicted_ms"))


_SECTIONS: dict[str, tuple[tuple[str, str, int], ...]] = {
    sec: tuple((f, dt, nd) for (s, f), (dt, nd) in ARRAYS.items() if s == sec)
    for sec in dict.fromkeys(s for s, _ in ARRAYS)
}


def _section(obj: Any, section: str, fmt: Format) -> dict[str, Any]:
    return {f: array_to_wire(getattr(obj, f), dt, fmt) for f, dt, _ in _SECTIONS[section]}


def plan_to_wire(plan: Plan, fmt: Format, version: int = WIRE_VERSION) -> dict[str, Any]:
    """The ``PlanMessage`` dict of a plan (byte views for msgpack, lists for JSON).

    Args:
        plan: the plan.
        fmt: ``msgpack`` or ``json``.
        version: the wire version to answer in: 1 leaves out ``packing`` (:mod:`~treepack.proto.version`).
    """
    st = plan.stats
    typed = {"packing": strategy_to_wire(plan.packing)} if version >= 2 else {}
    return {
        "version": version,
        "seq_len": plan.seq_len,
        "num_rows": plan.num_rows,
        "placement": plan.placement,
        "strategy": plan.strategy,
        **typed,
        "min_shared_len": plan.min_shared_len,
        "share_trainable": plan.share_trainable,
        "on_overflow": plan.options.on_overflow,
        "min_shared_saving": plan.options.min_shared_saving,
        "repair_ms": plan.options.repair_ms,
        **_section(plan, "", fmt),
        "trainable": None if plan.trainable is None else array_to_wire(plan.trainable.view(np.uint8), "|u1", fmt),
        "segments": _section(plan.segments, "segments", fmt),
        "attention": _section(plan.attention, "attention", fmt),
        "gdn": {
            "conv_width": plan.gdn.conv_width,
            "levels": [{"depth": lv.depth, **_section(lv, "gdn.levels", fmt)} for lv in plan.gdn.levels],
        },
        "ranks": {
            "num_ranks": plan.ranks.num_ranks,
            "cp_size": plan.ranks.cp_size,
            "shard_len": plan.ranks.shard_len,
            "cp_attention": plan.ranks.cp_attention,
            **_section(plan.ranks, "ranks", fmt),
            **({} if plan.ranks.contiguous else {"cp_tiles": array_to_wire(plan.ranks.cp_tiles, _I4, fmt)}),
        },
        "stats": {
            **{f: getattr(st, f) for f in _STATS},
            "saved_fraction": float(st.saved_fraction),
            "timings_ms": {k: float(v) for k, v in st.timings_ms.items()},
            "predicted_ms": None if st.predicted_ms is None else float(st.predicted_ms),
        },
        "overflow": [{"index": e.index, "length": e.length, "action": e.action} for e in plan.overflow],
    }


def _arrays(msg: Any, section: str, path: str) -> dict[str, np.ndarray]:
    # The validated ArrayMessages are read as they are (dumping each to a dict cost more
    # than decoding it).
    prefix = path or "$"
    return {
        f: array_from_wire(getattr(msg, f), dtype=dt, ndim=nd, path=f"{prefix}.{f}") for f, dt, nd in _SECTIONS[section]
    }


def plan_from_wire(msg: PlanMessage | dict[str, Any]) -> Plan:
    """Rebuild a :class:`Plan` from its message.

    Raises:
        RequestError: an array of the wrong dtype, rank or size, or arrays that disagree
            (:func:`check_plan_structure`; the path names the field).
    """
    if not isinstance(msg, PlanMessage):
        from treepack.proto.codec import parse_message  # msgpack is only needed here

        msg = parse_message(PlanMessage, msg)
    seg = Segments(**_arrays(msg.segments, "segments", "$.segments"))
    att = AttentionMeta(**_arrays(msg.attention, "attention", "$.attention"))
    levels = []
    for d, lv in enumerate(msg.gdn.levels):
        arrs = _arrays(lv, "gdn.levels", f"$.gdn.levels[{d}]")
        levels.append(GdnLevel(depth=lv.depth, **arrs))
    if any(lv.conv_context.shape[1:] != (max(msg.gdn.conv_width - 1, 0),) for lv in levels):
        raise RequestError("conv_context must have conv_width - 1 columns", path="$.gdn.levels", rule="shape")
    shard = cp_shard_len(msg.seq_len, msg.ranks.cp_size)
    if msg.ranks.shard_len is not None and msg.ranks.shard_len != shard:
        raise RequestError(
            f"ranks.shard_len {msg.ranks.shard_len} is not the CP shard of seq_len {msg.seq_len} "
            f"over {msg.ranks.cp_size} ranks ({shard})",
            path="$.ranks.shard_len",
            rule="cp_shard",
        )
    tiles = (
        np.zeros((0, 0), dtype=np.int32)
        if msg.ranks.cp_tiles is None
        else array_from_wire(msg.ranks.cp_tiles, dtype=_I4, ndim=2, path="$.ranks.cp_tiles")
    )
    ranks = Ranks(
        num_ranks=msg.ranks.num_ranks,
        cp_size=msg.ranks.cp_size,
        shard_len=shard,
        cp_attention=msg.ranks.cp_attention,
        cp_tiles=tiles,
        **_arrays(msg.ranks, "ranks", "$.ranks"),
    )
    st = msg.stats
    stats = PlanStats(
        **{f: getattr(st, f) for f in _STATS}, timings_ms=dict(st.timings_ms), predicted_ms=st.predicted_ms
    )
    options = PlanOptions(
        seq_len=msg.seq_len,
        min_shared_len=msg.min_shared_len,
        placement=msg.placement,
        num_ranks=msg.ranks.num_ranks,
        conv_width=msg.gdn.conv_width,
        share_trainable=msg.share_trainable,
        on_overflow=msg.on_overflow,
        min_shared_saving=msg.min_shared_saving,
        repair_ms=msg.repair_ms,
        cp_size=msg.ranks.cp_size,
        cp_attention=msg.ranks.cp_attention,
    )
    top = _arrays(msg, "", "")
    plan = Plan(
        options=options,
        num_rows=msg.num_rows,
        strategy=msg.strategy,
        packing=_packing(msg, seg),
        **top,
        trainable=_flags(msg.trainable, exact_sum(top["seq_lens"])),
        segments=seg,
        attention=att,
        gdn=GdnMeta(conv_width=msg.gdn.conv_width, levels=tuple(levels)),
        ranks=ranks,
        stats=stats,
        overflow=tuple(OverflowEvent(index=e.index, length=e.length, action=e.action) for e in msg.overflow),
    )
    check_plan_structure(plan)
    return plan


def strategy_to_wire(s: Strategy) -> dict[str, Any]:
    """The ``StrategyMessage`` dict of a :class:`~treepack.proto.strategy.Strategy`."""
    return {"kind": s.kind, "min_shared_len": s.min_shared_len}


def strategy_from_wire(msg: StrategyMessage) -> Strategy:
    """The :class:`~treepack.proto.strategy.Strategy` of a validated ``StrategyMessage``."""
    return Strategy(kind=msg.kind, min_shared_len=msg.min_shared_len)


def _packing(msg: PlanMessage, seg: Segments) -> Strategy:
    """The plan's typed strategy; a version-1 plan has none: derived from its segments."""
    if msg.packing is not None:
        return strategy_from_wire(msg.packing)
    return strategy_of(seg.sharers, msg.min_shared_len)


def _need(ok: bool, what: str, path: str) -> None:
    if not ok:
        raise RequestError(f"the plan's fields disagree: {what}", path=path, rule="plan_structure")


def _sizes(arrays: dict[str, np.ndarray], n: int, section: str, count: str) -> None:
    for name, a in arrays.items():
        _need(a.shape[0] == n, f"{name} has {a.shape[0]} entries for {n} {count}", f"$.{section}{name}")


def _in(a: np.ndarray, lo: int, hi: int, path: str) -> None:
    """Every value in [lo, hi)."""
    _need(a.size == 0 or (int(a.min()) >= lo and int(a.max()) < hi), f"values outside [{lo}, {hi})", path)


def _csr(ptr: np.ndarray, total: int, path: str) -> None:
    _need(ptr.shape[0] >= 1 and int(ptr[0]) == 0 and int(ptr[-1]) == total, f"must run from 0 to {total}", path)
    _need(bool(np.all(np.diff(ptr) >= 0)), "must not decrease", path)


def check_plan_structure(plan: Plan) -> None:
    """Cheap O(size) checks that a decoded plan's fields agree, before anything is derived from it.

    Sizes between tables (S sequences, R = ``num_rows`` rows, G segments), CSR pointers,
    index ranges, and token counts against ``seq_len``: a plan that passes cannot make
    :meth:`Plan.position_ids` (``[R, C]``) or the gathers index out of range or allocate
    more than its own arrays imply. (The planner's invariants are
    ``validate_plan``'s job; this is the receiver's guard.)

    Raises:
        RequestError: (rule ``plan_structure``) naming the first field that disagrees.
    """
    s, r, g = int(plan.seq_lens.shape[0]), int(plan.num_rows), int(plan.segments.row.shape[0])
    _check_sequences_and_segments(plan, s, r, g)
    _check_attention(plan, g)
    _check_gdn_levels(plan, r, g)
    _check_ranks(plan, r)
    _need(plan.stats.rows == r, f"stats.rows {plan.stats.rows} for num_rows {r}", "$.stats.rows")


def _check_sequences_and_segments(plan: Plan, s: int, r: int, g: int) -> None:
    """The per-sequence arrays and the segment table: sizes, CSR pointers, ranges, lengths within seq_len."""
    seg, c = plan.segments, plan.seq_len
    _sizes({f: getattr(plan, f) for f in ("orig_lens", "row_of", "first_trainable", "group_codes")}, s, "", "sequences")
    _sizes(
        {
            f: getattr(seg, f)
            for f in ("row_start", "length", "seq", "seq_start", "parent", "depth", "subtree_end", "sharers")
        },
        g,
        "segments.",
        "segments",
    )
    _need(seg.row_ptr.shape[0] == r + 1 and seg.row_len.shape[0] == r, f"row tables for {r} rows", "$.segments.row_ptr")
    _csr(seg.row_ptr, g, "$.segments.row_ptr")
    _need(seg.seq_ptr.shape[0] == s + 1, f"seq_ptr for {s} sequences", "$.segments.seq_ptr")
    _csr(seg.seq_ptr, int(seg.seq_segs.shape[0]), "$.segments.seq_ptr")
    _in(seg.seq_segs, 0, g, "$.segments.seq_segs")
    _in(seg.row, 0, r, "$.segments.row")
    _in(seg.seq, 0, s, "$.segments.seq")
    _in(seg.parent, -1, g, "$.segments.parent")
    _in(seg.length, 1, c + 1, "$.segments.length")
    _in(seg.row_start, 0, c, "$.segments.row_start")
    _need(bool(np.all(seg.row_start + seg.length <= c)), f"segments end past seq_len {c}", "$.segments.length")
    _in(seg.subtree_end, 0, c + 1, "$.segments.subtree_end")
    _in(seg.row_len, 0, c + 1, "$.segments.row_len")
    _in(plan.seq_lens, 0, 2**48, "$.seq_lens")
    _in(seg.seq_start, 0, 2**48, "$.segments.seq_start")
    # A segment reads its source's positions seq_start .. seq_start + length - 1: past the
    # source's length the trainer's flat gathers would read the next sequence's payloads.
    _need(
        bool(np.all(seg.seq_start + seg.length <= plan.seq_lens[seg.seq])),
        "segments run past their source sequence's seq_lens",
        "$.segments.seq_start",
    )
    _in(plan.row_of, -1, r, "$.row_of")
    _need(
        bool(np.all((plan.first_trainable >= 0) & (plan.first_trainable <= plan.seq_lens))),
        "first_trainable outside [0, seq_lens]",
        "$.first_trainable",
    )


def _check_attention(plan: Plan, g: int) -> None:
    """The ancestor chains: one per segment, pointing at segments."""
    att = plan.attention
    _need(
        att.anc_ptr.shape[0] == g + 1 and att.key_lens.shape[0] == g,
        f"attention tables for {g} segments",
        "$.attention.anc_ptr",
    )
    _csr(att.anc_ptr, int(att.anc_segs.shape[0]), "$.attention.anc_ptr")
    _in(att.anc_segs, 0, g, "$.attention.anc_segs")


def _check_gdn_levels(plan: Plan, r: int, g: int) -> None:
    """Each GDN level: sizes, segments and conv context in range, parent slots in the previous level."""
    seg, c = plan.segments, plan.seq_len
    prev = 0
    for d, lv in enumerate(plan.gdn.levels):
        n = int(lv.segs.shape[0])
        where = f"$.gdn.levels[{d}]"
        _sizes(
            {"parent": lv.parent, "parent_slot": lv.parent_slot, "conv_context": lv.conv_context},
            n,
            f"gdn.levels[{d}].",
            "segments",
        )
        _need(lv.cu_seqlens.shape[0] == n + 1, f"cu_seqlens for {n} segments", f"{where}.cu_seqlens")
        _in(lv.segs, 0, g, f"{where}.segs")
        _in(lv.conv_context, -1, r * c, f"{where}.conv_context")
        _in(lv.parent, -1, g, f"{where}.parent")
        _in(lv.parent_slot, -1, prev, f"{where}.parent_slot")  # a slot of the previous level
        _csr(lv.cu_seqlens, int(seg.length[lv.segs].sum()), f"{where}.cu_seqlens")
        prev = n


def _check_ranks(plan: Plan, r: int) -> None:
    """The rank tables and, under CP, the tile map."""
    rk = plan.ranks
    _need(
        rk.rank_rows.shape[0] == rk.num_ranks and rk.rank_cost.shape[0] == rk.num_ranks,
        f"rank tables for {rk.num_ranks} ranks",
        "$.ranks.rank_rows",
    )
    _need(rk.row_cost.shape[0] == r, f"row_cost for {r} rows", "$.ranks.row_cost")
    _in(rk.rank_rows, -1, r, "$.ranks.rank_rows")
    tiles = (r, rk.padded_len // CP_ALIGN)
    want = (
        f"none or {list(tiles)} (one entry per {CP_ALIGN}-token tile of each row)"
        if rk.cp_size > 1
        else "none without CP"
    )
    _need(
        rk.contiguous or (rk.cp_size > 1 and rk.cp_tiles.shape == tiles),
        f"cp_tiles of shape {list(rk.cp_tiles.shape)}, expected {want}",
        "$.ranks.cp_tiles",
    )


def _flags(obj: Any, num_tokens: int) -> np.ndarray | None:
    if obj is None:
        return None
    flags = array_from_wire(obj, dtype="|u1", ndim=1, path="$.trainable")
    if flags.shape[0] != num_tokens:
        raise RequestError(
            f"trainable has {flags.shape[0]} flags for {num_tokens} placed tokens",
            path="$.trainable",
            rule="length_mismatch",
        )
    if flags.size and flags.max() > 1:
        raise RequestError("trainable flags must be 0 or 1", path="$.trainable", rule="flag")
    return flags.view(np.bool_)


def _diff_array(name: str, a: np.ndarray, b: np.ndarray, out: list[str]) -> None:
    if a.dtype != b.dtype and (a.size or b.size):
        out.append(f"{name}: dtype {a.dtype} != {b.dtype}")
    elif a.shape != b.shape:
        out.append(f"{name}: shape {a.shape} != {b.shape}")
    elif not np.array_equal(a, b):
        i = tuple(int(x) for x in np.argwhere(a != b)[0])
        out.append(f"{name}: differs first at {list(i)} ({a[i]} != {b[i]})")


def plan_differences(a: Plan, b: Plan, *, timings: bool = False) -> list[str]:
    """Every difference between two plans, one line each; ``[]`` when they are equal.

    Compares scalars, every array (dtype, shape, values; the dtype of an empty array is
    not compared: numpy gives some empty results a default dtype), GDN levels, ranks,
    stats, overflow events, options and trainable flags. The stats' phase timings are
    ignored unless ``timings`` is True.
    """
    out: list[str] = []
    if a.options != b.options:
        out.append(f"options: {a.options!r} != {b.options!r}")
    for f in ("num_rows", "strategy", "packing"):
        if getattr(a, f) != getattr(b, f):
            out.append(f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}")
    if (a.trainable is None) != (b.trainable is None):
        flags_a = "flags" if a.trainable is not None else "None"
        flags_b = "flags" if b.trainable is not None else "None"
        out.append(f"trainable: {flags_a} != {flags_b}")
    elif a.trainable is not None and b.trainable is not None:
        _diff_array("trainable", a.trainable, b.trainable, out)
    sources = {
        "": (a, b),
        "segments": (a.segments, b.segments),
        "attention": (a.attention, b.attention),
        "ranks": (a.ranks, b.ranks),
    }
    for (sec, f), _ in ARRAYS.items():
        if sec in sources:
            x, y = sources[sec]
            _diff_array(f"{sec + '.' if sec else ''}{f}", getattr(x, f), getattr(y, f), out)
    if a.gdn.conv_width != b.gdn.conv_width:
        out.append(f"gdn.conv_width: {a.gdn.conv_width} != {b.gdn.conv_width}")
    if len(a.gdn.levels) != len(b.gdn.levels):
        out.append(f"gdn.levels: {len(a.gdn.levels)} != {len(b.gdn.levels)} levels")
    else:
        for d, (la, lb) in enumerate(zip(a.gdn.levels, b.gdn.levels)):
            if la.depth != lb.depth:
                out.append(f"gdn.levels[{d}].depth: {la.depth} != {lb.depth}")
            for (sec, f), _ in ARRAYS.items():
                if sec == "gdn.levels":
                    _diff_array(f"gdn.levels[{d}].{f}", getattr(la, f), getattr(lb, f), out)
    for f in ("num_ranks", "cp_size", "shard_len", "cp_attention"):
        if getattr(a.ranks, f) != getattr(b.ranks, f):
            out.append(f"ranks.{f}: {getattr(a.ranks, f)} != {getattr(b.ranks, f)}")
    _diff_array("ranks.cp_tiles", a.ranks.cp_tiles, b.ranks.cp_tiles, out)
    for f in _STATS + ("predicted_ms",) + (("timings_ms",) if timings else ()):
        if getattr(a.stats, f) != getattr(b.stats, f):
            out.append(f"stats.{f}: {getattr(a.stats, f)!r} != {getattr(b.stats, f)!r}")
    if tuple(a.overflow) != tuple(b.overflow):
        out.append(f"overflow: {a.overflow!r} != {b.overflow!r}")
    return out
