"""How to pack a batch: :class:`PlanOptions`, and the limits every option is held to.

One frozen dataclass carries the options from the caller (``plan_batch``, either client,
the wire) to the planner, and the plan keeps the checked copy (``Plan.options``). It is
loosely typed on purpose: whatever a caller gave travels as given, and one function of the planner
(:func:`treepack.service.planner.options.check_options`) judges it, so the embedded
planner and the sidecar answer a bad option with the same error, rule, path and message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from treepack.proto.errors import InputTypeError

__all__ = [
    "PlanOptions",
    "PLACEMENTS",
    "ON_OVERFLOW",
    "MAX_SEQ_LEN",
    "MAX_RANKS",
    "MAX_CONV_WIDTH",
    "MAX_CP_SIZE",
    "CP_ALIGN",
    "CP_ATTENTION",
    "cp_shard_len",
    "REPAIR_MS",
    "MAX_REPAIR_MS",
    "OPTION_NAMES",
    "as_options",
]

PLACEMENTS = ("auto", "bfd", "in_order", "no_share")
ON_OVERFLOW = ("error", "truncate", "drop")
MAX_SEQ_LEN = 2**31 - 1  # cu_seqlens are int32
MAX_RANKS = 65536
MAX_CONV_WIDTH = 64
MAX_CP_SIZE = 1024
CP_ALIGN = 16  # under context parallelism, every rank's shard of a row is a multiple of this many tokens
CP_ATTENTION = ("auto", "ulysses", "allgather")
REPAIR_MS = 10.0  # default budget of auto's repair pass, ms
MAX_REPAIR_MS = 60_000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """The options of one plan (SPEC sections 2-5); defaults are the planner's.

    Attributes:
        seq_len: row capacity C, in [1, MAX_SEQ_LEN] (required).
        min_shared_len: no shared segment shorter than this (rule 4), in [1, MAX_SEQ_LEN].
        placement: one of :data:`PLACEMENTS`.
        num_ranks: ranks to deal rows to, in [1, MAX_RANKS]; with ``cp_size`` > 1 these are
            the data-parallel ranks (each row then goes to one CP group).
        cp_size: context-parallel group size, in [1, MAX_CP_SIZE]: every row is split into
            ``cp_size`` equal contiguous shards of :func:`cp_shard_len` tokens (a multiple
            of :data:`CP_ALIGN`; the row padded to ``cp_size`` shards), one per rank of its
            CP group. 1: no split (the row is ``seq_len`` tokens, as without CP).
        cp_attention: how attention runs under CP, one of :data:`CP_ATTENTION`:
            ``"ulysses"`` (all-to-all to whole rows of ``H / cp_size`` heads) or
            ``"allgather"`` (each rank keeps its queries, keys and values gathered over the
            group), both with contiguous shards except ``"allgather"``, whose shards are
            ``CP_ALIGN``-token tiles in a few runs per rank, balancing attention work
            (visible keys per query; ``ranks.cp_tiles``); ``"auto"``: contiguous shards, Ulysses where a
            layer's heads divide by ``cp_size``, all-gather where they do not.
        conv_width: GDN short-conv width W, in [1, MAX_CONV_WIDTH].
        share_trainable: the generalized sharing mode.
        on_overflow: one of :data:`ON_OVERFLOW`, for sequences longer than ``seq_len``.
        min_shared_saving: 0 (off, rule 4 alone), or also share a run shorter than
            ``min_shared_len`` when ``(sharers - 1) * length`` is at least this many tokens;
            in [0, MAX_SEQ_LEN].
        repair_ms: budget of ``auto``'s repair pass, in CPU ms of the planning thread, in
            [0, MAX_REPAIR_MS] (0: no repair); the wall time it took is reported as
            ``stats.timings_ms["repair"]``.
    """

    seq_len: Any
    min_shared_len: Any = 64
    placement: Any = "auto"
    num_ranks: Any = 1
    conv_width: Any = 4
    share_trainable: Any = False
    on_overflow: Any = "error"
    min_shared_saving: Any = 0
    repair_ms: Any = REPAIR_MS
    cp_size: Any = 1
    cp_attention: Any = "auto"

    def to_wire(self) -> dict[str, Any]:
        """The options as message fields (numpy scalars as Python numbers: msgpack cannot
        write them; anything else as given, for the receiver's check to name)."""
        return {f: _py_scalar(getattr(self, f)) for f in OPTION_NAMES}


OPTION_NAMES = tuple(f.name for f in fields(PlanOptions))


def cp_shard_len(seq_len: int, cp_size: int) -> int:
    """Tokens of each rank's shard of a row: ``seq_len`` when ``cp_size`` is 1, else
    ``seq_len / cp_size`` rounded up to a multiple of :data:`CP_ALIGN` (the row is then
    padded to ``cp_size * cp_shard_len`` tokens)."""
    if cp_size == 1:
        return seq_len
    per = -(-seq_len // cp_size)
    return -(-per // CP_ALIGN) * CP_ALIGN


def _py_scalar(v: Any) -> Any:
    # numpy ints and bools are what the planner accepts too (a seq_len read from a config
    # array); they travel as Python numbers. Anything else goes as it is, so the
    # receiver names the same type the embedded planner would.
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


def as_options(options: PlanOptions | None, kwargs: dict[str, Any]) -> PlanOptions:
    """``options``, or a :class:`PlanOptions` made of the option keywords (not both).

    Raises:
        InputTypeError: both given, or a keyword that is no option.
    """
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if unknown:
        raise InputTypeError(
            f"unknown option {unknown[0]!r}; options are {OPTION_NAMES}", path=f"$.{unknown[0]}", rule="unknown"
        )
    if options is None:
        if "seq_len" not in kwargs:
            raise InputTypeError("seq_len is required", path="$.seq_len", rule="required")
        return PlanOptions(**kwargs)
    if kwargs:
        raise InputTypeError(
            f"give options or option keywords, not both (got {sorted(kwargs)})", path="$", rule="exclusive"
        )
    return options
