"""A proven lower bound on the rows any placement needs (SPEC section 4).

:func:`lower_bound_rows` returns ``max(L1, L2)``:

- **L1 = ceil(T / C)**, T the tree's token count: every tree token lies in some row.
- **L2, the duplication bound.** A row that holds any token of the subtree below node v
  holds v's whole root path too (rows are ancestor-closed), i.e. ``end(v)`` tokens, so it
  has at most ``C - end(v)`` tokens for v's descendants. Those descendants hold
  ``D(v) = S(v) - len(v)`` tokens (S = subtree size), each in at least one row, hence v sits
  in at least ``k(v) = ceil(D(v) / (C - end(v)))`` rows; and in at least as many rows as
  any of its children, so ``K(v) = max(k(v), max over children K(c), 1)``. Distinct rows
  hold distinct copies, so the rows together hold at least ``sum over v of len(v) * K(v)``
  tokens, and ``L2 = ceil(that / C)``. L2 >= L1 since K >= 1.

Both are computed in O(nodes) with numpy.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.index import accumulate_up
from treepack.service.planner.tree import Tree

__all__ = ["lower_bound_rows", "subtree_sizes", "min_copies"]


def subtree_sizes(tree: Tree) -> np.ndarray:
    """[N] int64 tokens in each node's subtree (the node included)."""
    return accumulate_up(tree.length.astype(np.int64), tree.parent, tree.depth)


def min_copies(tree: Tree, seq_len: int, size: np.ndarray | None = None) -> np.ndarray:
    """[N] int64 K(v): a proven minimum number of rows holding node v (module docstring)."""
    if size is None:
        size = subtree_sizes(tree)
    end = tree.end
    desc = size - tree.length
    room = np.maximum(seq_len - end, 1)
    k = np.where(desc > 0, -(-desc // room), 1)
    return accumulate_up(np.maximum(k, 1), tree.parent, tree.depth, np.maximum)


def lower_bound_rows(tree: Tree, seq_len: int) -> int:
    """max(L1, L2) of the module docstring; 0 for an empty tree."""
    if tree.num_nodes == 0:
        return 0
    copies = min_copies(tree, seq_len)
    total = int((tree.length * copies).sum())
    return int(-(-total // seq_len))
