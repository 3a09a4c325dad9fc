"""Which leaves share a row (SPEC section 4): the named placements and the one entry point.

- ``bfd``, ``in_order``, ``no_share`` — the baselines (:mod:`.baselines`).
- ``auto`` — the best of several sharing-aware packings (:mod:`.auto`), never more rows
  than ``bfd``.

A placement is ``row_of[s]`` per sequence (-1 for dropped sequences). Both build on
:mod:`.rows` (open rows, best fit, the one best-fit-decreasing loop) and :mod:`.items`
(each item's chain of ancestors); :func:`~.baselines.naive_place` is the loop-based
reference of the baselines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.options import REPAIR_MS
from treepack.service.planner.auto import auto_place
from treepack.service.planner.baselines import BASELINES
from treepack.service.planner.tree import Tree

__all__ = ["Placement", "place_leaves"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Rows chosen for the leaves.

    Attributes:
        row_of: [S] int64 row of each sequence, -1 for dropped ones.
        num_rows: number of rows.
        strategy: for ``auto``, the candidate that won; else the name.
        timings_ms: sub-phases worth reporting (``auto``: ``repair``).
    """

    row_of: np.ndarray
    num_rows: int
    strategy: str
    timings_ms: dict[str, float] = field(default_factory=dict)


def place_leaves(
    tree: Tree,
    batch: SequenceBatch,
    seq_len: int,
    placement: str = "auto",
    *,
    bound: int | None = None,
    repair_ms: float = REPAIR_MS,
) -> Placement:
    """Assign every kept sequence's leaf to a row.

    Args:
        tree: the batch's tree (its leaves are the items).
        batch: the batch (lengths, groups, kept flags).
        seq_len: row capacity C.
        placement: one of :data:`~treepack.proto.options.PLACEMENTS` (checked by
            ``check_options``).
        bound: ``auto``: the tree's lower bound on rows, if already computed.
        repair_ms: ``auto``: the repair pass's budget in ms (0: none).

    Returns:
        The :class:`Placement`.
    """
    timings: dict[str, float] = {}
    if placement == "auto":
        row_of, strategy, timings = auto_place(tree, batch, seq_len, bound=bound, repair_ms=repair_ms)
    else:
        row_of, strategy = BASELINES[placement](tree, batch, seq_len), placement
    num_rows = int(row_of.max()) + 1 if (row_of >= 0).any() else 0
    return Placement(row_of=row_of, num_rows=num_rows, strategy=strategy, timings_ms=timings)
