"""The one check of :class:`~treepack.proto.options.PlanOptions` (every caller's path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.options import (
    CP_ATTENTION,
    MAX_CONV_WIDTH,
    MAX_CP_SIZE,
    MAX_RANKS,
    MAX_REPAIR_MS,
    MAX_SEQ_LEN,
    ON_OVERFLOW,
    PLACEMENTS,
    PlanOptions,
)

__all__ = ["check_options"]


def _int(name: str, value: Any, lo: int, hi: int, rule: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}", path=f"$.{name}", rule="type")
    if value < lo:
        lo_text = {"positive": "> 0", "minimum": f">= {lo}"}.get(rule, f"in [{lo}, {hi}]")
        raise RequestError(f"{name} must be {lo_text}, got {value}", path=f"$.{name}", rule=rule)
    if value > hi:
        hi_text = f"in [{lo}, {hi}]" if rule == "range" else f"<= {hi}"
        raise RequestError(
            f"{name} must be {hi_text}, got {value}", path=f"$.{name}", rule="range" if rule == "range" else "maximum"
        )
    return int(value)


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    ok = (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, ok):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__}", path=f"$.{name}", rule="type")
    if not lo <= value <= hi:  # NaN fails too
        raise RequestError(f"{name} must be in [{lo:g}, {hi:g}], got {value}", path=f"$.{name}", rule="range")
    return float(value)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        what = "unknown placement" if name == "placement" else f"{name} must be one of {choices}, got"
        tail = f"; expected one of {choices}" if name == "placement" else ""
        raise RequestError(f"{what} {value!r}{tail}", path=f"$.{name}", rule="enum")
    return value


def check_options(options: PlanOptions) -> PlanOptions:
    """Validate every option once and return them normalized (Python ints, bools, strs).

    Raises:
        InputTypeError: an option of the wrong type (rule ``type``).
        RequestError: an option out of range (rules ``positive``, ``minimum``,
            ``maximum``, ``range``) or not one of its choices (``enum``); the path is
            ``$.<option>``.
    """
    if not isinstance(options, PlanOptions):
        raise InputTypeError(f"options must be a PlanOptions, got {type(options).__name__}", path="$", rule="type")
    seq_len = _int("seq_len", options.seq_len, 1, MAX_SEQ_LEN, "positive")
    min_shared_len = _int("min_shared_len", options.min_shared_len, 1, MAX_SEQ_LEN, "minimum")
    placement = _choice("placement", options.placement, PLACEMENTS)
    num_ranks = _int("num_ranks", options.num_ranks, 1, MAX_RANKS, "minimum")
    conv_width = _int("conv_width", options.conv_width, 1, MAX_CONV_WIDTH, "range")
    share = options.share_trainable
    if not isinstance(share, (bool, np.bool_)):
        raise InputTypeError(
            f"share_trainable must be a bool, got {type(share).__name__}", path="$.share_trainable", rule="type"
        )
    on_overflow = _choice("on_overflow", options.on_overflow, ON_OVERFLOW)
    saving = _int("min_shared_saving", options.min_shared_saving, 0, MAX_SEQ_LEN, "minimum")
    repair_ms = _number("repair_ms", options.repair_ms, 0.0, MAX_REPAIR_MS)
    cp_size = _int("cp_size", options.cp_size, 1, MAX_CP_SIZE, "range")
    cp_attention = _choice("cp_attention", options.cp_attention, CP_ATTENTION)
    return PlanOptions(
        seq_len=seq_len,
        min_shared_len=min_shared_len,
        placement=placement,
        num_ranks=num_ranks,
        conv_width=conv_width,
        share_trainable=bool(share),
        on_overflow=on_overflow,
        min_shared_saving=saving,
        repair_ms=repair_ms,
        cp_size=cp_size,
        cp_attention=cp_attention,
    )
