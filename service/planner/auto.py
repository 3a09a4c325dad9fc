"""The ``auto`` placement: the best of several sharing-aware packings, never worse than ``bfd``.

Candidates, tried in this order, cheapest first; the first one that reaches the proven
lower bound (:func:`~.bounds.lower_bound_rows`) wins at once since nothing can beat it:

1. ``grouped`` — best-fit decreasing over *units*: the maximal subtrees that fit one row
   with their root path (``start(v) + S(v) <= C``). A GRPO group, its prompt and all its
   completions travel as one item, so a shared prompt is not split across rows unless it
   must be; a unit's marginal cost in a row is its cost minus the part of its root path
   the row already holds, exactly as for leaves. Units are visited tree by tree (trees by
   total size, largest first; units largest first inside a tree), so rows fill with units
   of one system prompt and its copies stay few.
2. ``grouped+split`` — the same, but a unit that fits no open row is split into its child
   units (which then fill the gaps of open rows) before a new row is opened.
3. ``bfd`` — the reference leaf-level best fit (SPEC section 4).

(A global order, units largest first across all trees, never beat the grouped order on
the benchmark workloads, so it is not a candidate.)

The winner has the fewest rows, then the fewest packed tokens, then the earliest
candidate; since ``bfd`` is a candidate whenever no cheaper one reaches the bound, ``auto``
never uses more rows than ``bfd``.

Time: units are far fewer than leaves (about one per group); each best-fit query costs
O(depth log R) (:mod:`.rows`), so the whole is near-linear in the number of leaves.
"""

from __future__ import annotations

import numpy as np

from treepack.service.planner.bounds import lower_bound_rows, subtree_sizes
from treepack.proto.batch import SequenceBatch
from treepack.service.planner.placement import _bfd, row_costs
from treepack.service.planner.rows import OpenRows
from treepack.service.planner.tree import Tree

__all__ = ["auto_place", "unit_place"]


def unit_place(tree: Tree, batch: SequenceBatch, seq_len: int, *, split: bool) -> np.ndarray:
    """Best-fit decreasing over units (see module docstring).

    Args:
        tree: the batch's tree.
        batch: the batch.
        seq_len: row capacity C.
        split: split a unit that fits no open row into its child units first.

    Returns:
        [S] int64 row of each sequence (-1 for dropped ones).
    """
    size = subtree_sizes(tree)
    start = tree.start
    cost = start + size
    parent = tree.parent
    fits = cost <= seq_len
    pfits = np.where(parent >= 0, fits[np.maximum(parent, 0)], False)
    units = np.flatnonzero(fits & ~pfits)
    if split:
        # Children of each node, largest cost first (CSR over a stable sort by parent).
        child = np.flatnonzero(parent >= 0)
        child = child[np.lexsort((-cost[child], parent[child]))]
        kid_ptr = np.searchsorted(parent[child], np.arange(tree.num_nodes + 1)).tolist()
        kid_list = child.tolist()

    ptr = tree.path_ptr.tolist()
    pnodes = tree.path_nodes.tolist()
    ends = tree.end.tolist()
    src = tree.source.tolist()
    depth = tree.depth.tolist()
    costl = cost.tolist()

    def ancestors(v: int) -> list[int]:
        s = src[v]
        return pnodes[ptr[s] : ptr[s] + depth[v]]

    rows = OpenRows(seq_len)
    node_row = np.full(tree.num_nodes, -1, dtype=np.int64)
    placed: list[int] = []
    placed_row: list[int] = []
    root = tree.path_nodes[tree.path_ptr[tree.source]]  # [N] root of each node's tree
    order = units[np.lexsort((-cost[units], root[units], -size[root[units]]))].tolist()
    stack = order[::-1]
    while stack:
        v = stack.pop()
        anc = ancestors(v)
        aend = [ends[a] for a in anc]
        r, m = rows.best_fit(anc, aend, costl[v])
        if r < 0:
            if split and kid_ptr[v] < kid_ptr[v + 1]:
                stack.extend(kid_list[kid_ptr[v + 1] - 1 : kid_ptr[v] - 1 if kid_ptr[v] else None : -1])
                continue
            r = rows.open_row()
        rows.add(r, anc, m)
        placed.append(v)
        placed_row.append(r)
    # Each kept sequence's path crosses exactly one placed unit: its row is that unit's.
    node_row[placed] = placed_row
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    kept = np.flatnonzero(tree.leaf_of >= 0)
    if kept.shape[0]:
        per_node = node_row[tree.path_nodes]
        row_of[kept] = np.maximum.reduceat(per_node, tree.path_ptr[kept])
    return row_of


def auto_place(tree: Tree, batch: SequenceBatch, seq_len: int) -> tuple[np.ndarray, str]:
    """Run the candidates of the module docstring; return (row_of, winning candidate)."""
    bound = lower_bound_rows(tree, seq_len)
    best: tuple[int, int] | None = None
    best_rows = None
    best_name = ""
    candidates = (
        ("grouped", lambda: unit_place(tree, batch, seq_len, split=False)),
        ("grouped+split", lambda: unit_place(tree, batch, seq_len, split=True)),
        ("bfd", lambda: _bfd(tree, batch, seq_len)),
    )
    for name, run in candidates:
        row_of = run()
        n = int(row_of.max()) + 1 if (row_of >= 0).any() else 0
        score = (n, int(row_costs(tree, row_of, n).sum()))
        if best is None or score < best:
            best, best_rows, best_name = score, row_of, name
        if n <= bound:
            break
    assert best_rows is not None
    return best_rows, best_name
