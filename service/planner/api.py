"""The planner's entry point: :func:`plan_batch`."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError
from treepack.service.planner.bounds import lower_bound_rows
from treepack.service.planner.inputs import Batch, normalize_batch
from treepack.service.planner.layout import layout_rows
from treepack.service.planner.metadata import attention_meta, gdn_meta
from treepack.service.planner.placement import check_placement, place_leaves
from treepack.proto.plan import Plan, PlanStats
from treepack.service.planner.ranks import assign_ranks, check_num_ranks
from treepack.service.planner.tree import build_tree, check_min_shared_len, flat_tree

__all__ = ["plan_batch", "plan_normalized"]


def _check_conv_width(conv_width: object) -> int:
    if isinstance(conv_width, bool) or not isinstance(conv_width, int):
        raise InputTypeError(f"conv_width must be an int, got {type(conv_width).__name__}", path="$.conv_width", rule="type")
    if not 1 <= conv_width <= 64:
        raise RequestError(f"conv_width must be in [1, 64], got {conv_width}", path="$.conv_width", rule="range")
    return conv_width


def plan_batch(
    sequences: Sequence[Any],
    *,
    seq_len: int,
    min_shared_len: int = 64,
    placement: str = "auto",
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    num_ranks: int = 1,
    on_overflow: str = "error",
    conv_width: int = 4,
    share_trainable: bool = False,
    repair_ms: float | None = None,
) -> Plan:
    """Pack a batch as one global prefix tree into rows of ``seq_len`` tokens.

    Args:
        sequences: S sequences of token ids in [0, 2**32).
        seq_len: row capacity C.
        min_shared_len: no shared segment shorter than this (rule 4), >= 1.
        placement: ``auto`` (default), ``bfd``, ``in_order`` or ``no_share``.
        trainable: None (nothing trainable: every sequence fully shareable) or per
            sequence a bool array or a prompt length.
        groups: per sequence an int/str group id (orders ``bfd``; never limits sharing).
        keys: per sequence None or one uint64 per token that must also match to share.
        num_ranks: ranks to deal rows to (equal row counts).
        on_overflow: ``error``, ``truncate`` or ``drop`` for sequences longer than C.
        conv_width: GDN short-conv width W (conv context of W-1 tokens).
        share_trainable: the generalized mode (SPEC section 2): trainable tokens and scored
            positions are shared where every sharer predicts the same next token; the
            trainer then weights a shared loss position by the sum of its sharers' weights.
        repair_ms: ``auto``'s repair-pass budget in ms (None: the default,
            :data:`~.auto.REPAIR_MS`; 0: no repair). Reported as ``timings_ms["repair"]``.

    Returns:
        The :class:`Plan`.

    Raises:
        RequestError: (or a subclass) for any invalid argument, naming it.
    """
    t0 = time.perf_counter()
    msl = check_min_shared_len(min_shared_len)
    name = check_placement(placement)
    ranks = check_num_ranks(num_ranks)
    width = _check_conv_width(conv_width)
    batch = normalize_batch(sequences, seq_len=seq_len, trainable=trainable, groups=groups, keys=keys, on_overflow=on_overflow)
    return plan_normalized(
        batch,
        seq_len=int(seq_len),
        min_shared_len=msl,
        placement=name,
        num_ranks=ranks,
        conv_width=width,
        share_trainable=_check_flag(share_trainable, "share_trainable"),
        repair_ms=repair_ms,
        t0=t0,
    )


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{name} must be a bool, got {type(value).__name__}", path=f"$.{name}", rule="type")
    return bool(value)


def _check_repair_ms(repair_ms: object) -> float | None:
    if repair_ms is None:
        return None
    if isinstance(repair_ms, (bool, np.bool_)) or not isinstance(repair_ms, (int, float, np.integer, np.floating)):
        raise InputTypeError(f"repair_ms must be a number, got {type(repair_ms).__name__}", path="$.repair_ms", rule="type")
    if not 0 <= repair_ms <= 60_000:
        raise RequestError(f"repair_ms must be in [0, 60000], got {repair_ms}", path="$.repair_ms", rule="range")
    return float(repair_ms)


def plan_normalized(
    batch: Batch,
    *,
    seq_len: int,
    min_shared_len: int = 64,
    placement: str = "auto",
    num_ranks: int = 1,
    conv_width: int = 4,
    share_trainable: bool = False,
    repair_ms: float | None = None,
    t0: float | None = None,
) -> Plan:
    """:func:`plan_batch` on an already validated :class:`Batch` (the service's path)."""
    t0 = time.perf_counter() if t0 is None else t0
    msl = check_min_shared_len(min_shared_len)
    name = check_placement(placement)
    num_ranks = check_num_ranks(num_ranks)
    conv_width = _check_conv_width(conv_width)
    repair_ms = _check_repair_ms(repair_ms)
    t1 = time.perf_counter()
    share_trainable = _check_flag(share_trainable, "share_trainable")
    tree = build_tree(batch, msl, share_trainable=share_trainable)
    t2 = time.perf_counter()
    bound = lower_bound_rows(tree, seq_len)
    placed = place_leaves(tree, batch, seq_len, name, bound=bound, repair_ms=repair_ms)
    t3 = time.perf_counter()
    layout_tree = flat_tree(batch) if name == "no_share" else tree
    seg = layout_rows(layout_tree, placed.row_of, placed.num_rows)
    t4 = time.perf_counter()
    att = attention_meta(seg)
    gdn = gdn_meta(seg, seq_len, conv_width)
    rk = assign_ranks(seg, placed.num_rows, num_ranks)
    t5 = time.perf_counter()
    unpacked = int(batch.lens.sum())
    packed = int(seg.row_len.sum())
    stats = PlanStats(
        sequences=batch.num_sequences,
        kept_sequences=int(batch.kept.sum()),
        unpacked_tokens=unpacked,
        tree_tokens=tree.num_tokens,
        packed_tokens=packed,
        rows=placed.num_rows,
        lower_bound_rows=bound,
        padding_tokens=placed.num_rows * seq_len - packed,
        saved_fraction=(1.0 - packed / unpacked) if unpacked else 0.0,
        timings_ms={
            "normalize": (t1 - t0) * 1e3,
            "tree": (t2 - t1) * 1e3,
            "placement": (t3 - t2) * 1e3,
            "repair": placed.timings_ms.get("repair", 0.0),
            "layout": (t4 - t3) * 1e3,
            "metadata": (t5 - t4) * 1e3,
            "total": (t5 - t0) * 1e3,
        },
    )
    return Plan(
        seq_len=seq_len,
        num_rows=placed.num_rows,
        placement=name,
        strategy=placed.strategy,
        min_shared_len=msl,
        share_trainable=share_trainable,
        seq_lens=batch.lens,
        orig_lens=batch.orig_lens,
        row_of=placed.row_of,
        segments=seg,
        attention=att,
        gdn=gdn,
        ranks=rk,
        stats=stats,
        overflow=batch.overflow,
        tree=tree,
    )
