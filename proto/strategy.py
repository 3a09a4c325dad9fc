"""What a plan packs, typed: :class:`Strategy` (``"tree"`` at a ``min_shared_len``, or ``"plain"``).

``Plan.strategy`` is the planner's free-text reason (``"auto:grouped+repair"``,
``"no_share by time: 598.9 ms vs tree 599.3 ms"``); ``Plan.packing`` and every what-if
trial carry this typed form, which an autotuner compares without parsing text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["STRATEGY_KINDS", "Strategy", "strategy_of"]

STRATEGY_KINDS = ("tree", "plain")
"""``tree``: sequences share their common prefixes (SPEC rule 4 at ``min_shared_len``), at
least one segment is shared; ``plain``: every sequence laid out whole, nothing shared
(placement ``no_share``, or a tree in which no run met the threshold: the same segments)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """How a plan packs its batch.

    Attributes:
        kind: ``"tree"`` or ``"plain"`` (:data:`STRATEGY_KINDS`): whether the plan shares
            any segment.
        min_shared_len: the rule-4 threshold the tree was built with (with a cost model,
            ``auto`` may have raised it); None for ``plain``, which shares nothing.
    """

    kind: Literal["tree", "plain"]
    min_shared_len: int | None = None

    def __post_init__(self) -> None:
        assert self.kind in STRATEGY_KINDS, self.kind
        assert (self.min_shared_len is None) == (self.kind == "plain"), (self.kind, self.min_shared_len)

    def __str__(self) -> str:
        return "plain" if self.kind == "plain" else f"tree (min_shared_len={self.min_shared_len})"


def strategy_of(sharers: np.ndarray, min_shared_len: int) -> Strategy:
    """The strategy of a plan from its segments' sharer counts.

    Args:
        sharers: [G] int64 sequences sharing each segment (``plan.segments.sharers``).
        min_shared_len: the rule-4 threshold the plan was made with.
    """
    if not bool((np.asarray(sharers) >= 2).any()):
        return Strategy(kind="plain")
    return Strategy(kind="tree", min_shared_len=int(min_shared_len))
