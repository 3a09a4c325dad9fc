"""The fewest rows of a whole small batch: the exact search asked for every row count, and its
brute-force reference.

:func:`exact_min_rows` asks the branch and bound of :mod:`.exact` whether the batch's leaves
fit each row count from a proven lower bound up, and stops at the first that fits (the
tests and ``benchmarks/placement_quality.py`` measure ``auto`` against it).
:func:`naive_min_rows` is the obviously correct reference: a dynamic programme over all
subsets of at most ~12 leaves.
"""

from __future__ import annotations

import numpy as np

from treepack.service.planner.exact import FIT, NO_FIT, fit_rows
from treepack.service.planner.items import leaf_items
from treepack.service.planner.tree import Tree

__all__ = ["exact_min_rows", "naive_min_rows"]


def exact_min_rows(tree: Tree, seq_len: int, lower: int, upper: int, *, node_limit: int = 200_000) -> tuple[int, bool]:
    """The fewest rows for every kept leaf, searched between two known bounds.

    Args:
        tree: the batch's tree.
        seq_len: C.
        lower: a proven lower bound (e.g. :func:`~.bounds.lower_bound_rows`).
        upper: the rows of a known placement.
        node_limit: per decision.

    Returns:
        (rows, proven): the fewest rows found; ``proven`` when every smaller count was
        refuted (not merely left unknown).
    """
    items = leaf_items(tree, np.flatnonzero(tree.leaf_of >= 0))
    node_len = tree.length.tolist()
    proven = True
    for m in range(lower, upper):
        status, _ = fit_rows(items, m, seq_len, node_len, node_limit=node_limit)
        if status == FIT:
            return m, proven
        proven = proven and status == NO_FIT
    return upper, proven


def naive_min_rows(tree: Tree, seq_len: int) -> int:
    """Brute force over all subsets of the kept leaves (at most ~12): the optimum rows.

    ``cost[mask]`` is the union of the leaves' paths in ``mask``; ``best[mask]`` the fewest
    rows for ``mask``, trying every fitting row that holds its lowest leaf.
    """
    seqs = np.flatnonzero(tree.leaf_of >= 0).tolist()
    n = len(seqs)
    assert n <= 14, "naive_min_rows is exponential"
    member = np.zeros(tree.num_nodes, dtype=np.int64)
    for bit, s in enumerate(seqs):
        member[tree.path(s)] |= 1 << bit
    masks = np.arange(1 << n, dtype=np.int64)
    cost = np.zeros(1 << n, dtype=np.int64)
    for v in range(tree.num_nodes):
        cost += tree.length[v] * ((masks & member[v]) != 0)
    fits = (cost <= seq_len).tolist()
    best = [0] * (1 << n)
    for mask in range(1, 1 << n):
        low = mask & -mask
        rest = mask ^ low
        b = n + 1
        sub = rest
        while True:
            row = sub | low
            if fits[row] and best[mask ^ row] + 1 < b:
                b = best[mask ^ row] + 1
            if sub == 0:
                break
            sub = (sub - 1) & rest
        best[mask] = b
    return best[(1 << n) - 1]
